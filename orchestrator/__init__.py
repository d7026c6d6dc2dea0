"""Elastic, preemption-aware distributed training on Ray, configured with Hydra."""
