import torch.nn.functional as F


def huber(output, target, delta: float = 1.0):
    """Squared error near the target, absolute error far from it: robust to a few outliers."""
    return F.huber_loss(output, target, delta=delta)
