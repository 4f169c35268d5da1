"""Gradient buckets: parameters grouped into contiguous runs of about `bucket_bytes` each, and reduced in bucket order
on every rank."""

from collections.abc import Callable

import torch


def bucket_parameters(params: list, bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Split `params` in order into buckets of at most `bucket_bytes` (a larger parameter gets its own)."""
    buckets, current, size = [], [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


class InOrder:
    """Launch buckets 0, 1, 2, ... in index order, each once it and every bucket before it are full, so that every
    rank makes the same collective calls in the same order whatever order its backward fills them in: a parameter one
    rank leaves unused (an expert no token reached there) only holds back the buckets after it until `finish`, which
    launches the rest, in order, at the end of backward. (Launched as each fills, the ranks' calls went out of step:
    tests/parallel/test_ddp.py.)"""

    def __init__(self, sizes: list[int], launch: Callable[[int], None]):
        self.sizes, self.launch = sizes, launch
        self.filled = [0] * len(sizes)
        self.launched = 0

    def arrived(self, index: int) -> None:
        """One more of bucket `index`'s parameters has its gradient."""
        self.filled[index] += 1
        while self.launched < len(self.sizes) and self.filled[self.launched] == self.sizes[self.launched]:
            self.launch(self.launched)
            self.launched += 1

    def finish(self) -> None:
        """Launch the buckets not launched yet, in order, and start over for the next backward."""
        for index in range(self.launched, len(self.sizes)):
            self.launch(index)
        self.filled = [0] * len(self.sizes)
        self.launched = 0
