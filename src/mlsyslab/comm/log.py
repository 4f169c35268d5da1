"""The communication log: calls and bytes each rank sends, by operation.

Our collectives count what their send/recv calls really put on the wire (exact). torch.distributed's
own collectives, called through `traced`, are counted with the bytes a ring algorithm sends per
rank — (n−1)/n·M for reduce-scatter / all-gather / all-to-all, 2(n−1)/n·M for all-reduce — the
same convention as predict.collectives, so a run and its prediction can be held side by side.
Twin of: mlsyslab.predict.collectives (`*_bytes_per_rank`).
"""

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommLog:
    calls: dict = field(default_factory=lambda: defaultdict(int))
    bytes_sent: dict = field(default_factory=lambda: defaultdict(int))
    _label: list = field(default_factory=list)

    @contextmanager
    def op(self, name: str):
        """Attribute the sends inside to collective `name` (the outermost label wins) and count one call."""
        outer = not self._label
        if outer:
            self.calls[name] += 1
        self._label.append(name)
        try:
            yield
        finally:
            self._label.pop()

    def record_send(self, nbytes: int, name: str = "send") -> None:
        label = self._label[0] if self._label else name
        if not self._label:
            self.calls[name] += 1
        self.bytes_sent[label] += int(nbytes)

    def total_bytes(self) -> int:
        return sum(self.bytes_sent.values())

    def as_dict(self) -> dict:
        return {op: {"calls": self.calls[op], "bytes_sent": self.bytes_sent.get(op, 0)} for op in sorted(self.calls)}

    def reset(self) -> None:
        self.calls.clear()
        self.bytes_sent.clear()


_RING_FACTOR = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0, "all_to_all": 1.0,
                "all_reduce_routing": 2.0,  # parallel.tensor: MoE routing weights' gradient under TP
                "broadcast": 1.0}  # broadcast: a chain's (n−1)·M bytes averaged over the n ranks


def traced(log: CommLog | None, name: str, tensor_bytes: int, world_size: int, call, *args, **kwargs):
    """Call a torch.distributed collective, logging its ring-equivalent bytes per rank.

    `tensor_bytes` is the full message M (the unsharded tensor for reduce-scatter / all-gather,
    what a rank holds for all-to-all).
    """
    if log is not None:
        log.calls[name] += 1
        # a rank's share of the ring's traffic, fractional where n does not divide M (as predict's): not rounded per call
        log.bytes_sent[name] += _RING_FACTOR[name] * (world_size - 1) / world_size * tensor_bytes
    return call(*args, **kwargs)


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def world_size(group=None) -> int:
    return dist.get_world_size(group)
