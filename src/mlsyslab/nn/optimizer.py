"""The optimizer the models train with, in one place: both trainers step it and `mlsys calibrate` times it for the
twin (predict's `optimizer_bytes_per_parameter`)."""

import torch


def adamw(params, lr: float = 3e-4) -> torch.optim.AdamW:
    """torch's AdamW (decoupled weight decay 0.1, Loshchilov & Hutter 2019), one tensor at a time (foreach=False: no
    list-wide temporaries beside a rank's largest tensors)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, foreach=False)
