"""The general PyTorch trainer (trainer=ddp, trainer=fsdp): every part from the user's package
through _target_ (model, datasets, loss, step function, optimizer, scheduler, metrics), the
global batch fixed whatever the world size (gradient accumulation fills in), exact resume."""
