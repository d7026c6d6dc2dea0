"""PyTorch DistributedDataParallel on Ray Train's TorchTrainer (gloo on CPU, nccl on GPU)."""
