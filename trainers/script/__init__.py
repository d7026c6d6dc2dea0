"""trainer=script: the user's unchanged torchrun-style script, one process per worker."""
