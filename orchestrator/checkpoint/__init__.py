"""Checkpoints in a storage URI, one folder per step, committed by a manifest written last."""
