"""Where checkpoints and data live: location.py names a place (a local folder, s3://, any
pyarrow filesystem) with its credentials; check.py checks it on the driver before anything is
written; probe.py checks that every node of a cluster sees the same place. The checkpoint
format on top of it is orchestrator/checkpoint/.
"""
