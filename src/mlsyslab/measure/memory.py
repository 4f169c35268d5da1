"""Bytes a rank holds, by category, counted from the tensors themselves (RSS is too noisy on CPU).

Tensors are counted by their storage, once each: a view and its base, or parameters that are views
of one flat buffer, cost what the buffer costs. Activations are measured with autograd's
saved-tensor hooks: every tensor saved for backward during a forward pass is counted (once per
storage) at the moment it is saved, and the peak is what backward will need.
Twin: predict.memory (weights, gradients, optimizer, activations per rank).
"""

from contextlib import contextmanager

import torch
from torch import nn


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen, total = set(), 0
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def model_state_bytes(tensors_by_category: dict) -> dict:
    """{category: bytes} for {category: [tensors]} (as ZeroDataParallel.model_state_tensors gives)."""
    return {category: storage_bytes(tensors) for category, tensors in tensors_by_category.items()}


def plain_model_state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Categories for an unsharded model (DDP or single process): weights, gradients, optimizer state."""
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    return {"weights": params, "gradients": [p.grad for p in params], "optimizer": state, "host_offload": []}


class ActivationMeter:
    """Counts the bytes autograd saves for backward: `with meter.track([*model.parameters(), x, y]): loss = ...`.

    Tensors living in the storage of the tensors given — the weights and the batch's token ids and targets, which
    the step holds anyway, and their views — are not activations.
    Across forwards whose activations are held at once (a pipeline's microbatches in flight), each tracked
    forward adds its bytes to `held_bytes` until its backward `release`s them; `peak_bytes` is the most held.
    Autograd calls only the innermost saved-tensor hooks, so hooks of their own inside a tracked forward (ZeRO-3's
    units) pass the tensors they do not take on to `count_saved`.
    """

    def __init__(self):
        self.saved_bytes = 0  # by the latest tracked forward
        self.held_bytes = self.peak_bytes = 0
        self._storages: set = set()

    def release(self, nbytes: int) -> None:
        """A tracked forward's activations are freed (its backward ran)."""
        self.held_bytes -= nbytes

    def count(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._storages:
            self._storages.add(storage.data_ptr())
            self.saved_bytes += storage.nbytes()
        return tensor

    @contextmanager
    def track(self, held=()):
        self.saved_bytes = 0
        self._storages = {tensor.untyped_storage().data_ptr() for tensor in held}
        _tracking.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.count, lambda tensor: tensor):
                yield self
        finally:
            _tracking.pop()
        self.held_bytes += self.saved_bytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)


_tracking: list[ActivationMeter] = []  # meters inside track(), innermost last


def count_saved(tensor: torch.Tensor) -> None:
    """`tensor` is saved for backward by saved-tensor hooks that hide the meter's (see ActivationMeter): count it in
    the meter tracking this forward, if any."""
    if _tracking:
        _tracking[-1].count(tensor)
