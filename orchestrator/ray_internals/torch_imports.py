"""What a PyTorch worker's process imports ahead (no import here: the driver names them).

torch's compiler front end (torch._dynamo) is a private module that torch imports with the
first optimizer (torch.optim's add_param_group marks its methods not to be compiled): ~0.8 s
of a worker's start on this machine. Imported ahead, in a process kept ready for a restart
(orchestrator/worker/spare.py) that time is off the recovery (1.8-2.6 s here,
docs/benchmarks.md), and a sweep's fork server imports it once for all its trials' workers.
A torch without it (renamed) warns in the worker's log that it could not be imported ahead,
and the optimizer imports what it needs, as it would anyway.
"""

# torch and Ray Train's torch side (its process group set-up), and torch's compiler front end:
# ~1 s and ~0.8 s of a worker's start here (orchestrator/worker/warm.py).
TORCH_WARM = ("ray.train.torch", "torch._dynamo")
# A sweep's fork server (orchestrator/ray_internals/fork_server/): the same, and the parts of
# torch every trial's workers use, nothing that starts threads at import.
TORCH_FORK = ("torch", "torch._dynamo", "torch.optim", "torch.nn.parallel", "torch.distributed",
              "ray.train.torch")
