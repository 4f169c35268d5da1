"""PipeDream weight stashing (Narayanan et al., SOSP 2019, §3.3): a microbatch's backward uses the very
weights its forward used, although the stage has updated them since.

In PipeDream's asynchronous 1F1B every stage applies an optimizer update after each backward, with no
flush, so on stage r up to p − r − 1 other microbatches' updates land between a microbatch's forward
and its backward. Computing that backward against the newer weights would pair activations from one
version with weights from another — a gradient of no function at all. The stash keeps, per weight
version still needed, a copy of the stage's parameters: a forward runs on the copy of the current
version (`torch.func.functional_call`), its backward fills that copy's `.grad`, and the gradient is
then applied to the live weights (W ← W − lr·∇f(W_stashed), PipeDream's update rule). A version is
freed when its last microbatch's backward is done, so stage r holds at most p − r versions (the
memory PipeDream trades for no flush; PipeDream-2BW bounds it at 2).

Which version each microbatch uses is `parallel.schedules.weight_versions`; `used` records what ran,
and tests/parallel/test_pipeline.py holds the executed pipeline against a single-process replay of
the same versions.
"""

import torch
from torch import nn
from torch.func import functional_call

from mlsyslab.measure.memory import storage_bytes


class WeightStash:
    """The weight versions one pipeline chunk still owes a backward to, and its update after each one."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.version = 0  # updates applied to the live weights so far
        self.copies: dict[int, dict[str, torch.Tensor]] = {}  # version -> parameters as they were then
        self.pending: dict[int, int] = {}  # version -> microbatches whose backward is still to come
        self.used: dict[int, int] = {}  # microbatch -> version its forward (and so its backward) used
        self.peak_copy_bytes = 0  # the most bytes the copies held at once (measure.memory.storage_bytes)
        self.peak_gradient_bytes = 0  # the most a version's gradient held, between its backward and its update

    def current(self) -> dict[str, torch.Tensor]:
        """The copy of the current weights the next forward runs on (made on the version's first forward)."""
        if self.version not in self.copies:
            self.copies[self.version] = {name: parameter.detach().clone().requires_grad_(parameter.requires_grad)
                                         for name, parameter in self.module.named_parameters()}
            copies = storage_bytes(t for copy in self.copies.values() for t in copy.values())
            self.peak_copy_bytes = max(self.peak_copy_bytes, copies)
        return self.copies[self.version]

    def forward(self, microbatch: int, *inputs) -> torch.Tensor:
        """Run the module on the current weights, through a copy kept for this microbatch's backward."""
        self.current()
        self.pending[self.version] = self.pending.get(self.version, 0) + 1
        self.used[microbatch] = self.version
        return functional_call(self.module, self.copies[self.version], inputs)

    def update(self, microbatch: int, optimizer: torch.optim.Optimizer) -> None:
        """After `microbatch`'s backward: apply its gradient (taken at its stashed version) to the live weights."""
        version = self.used[microbatch]
        copy = self.copies[version]
        self.peak_gradient_bytes = max(self.peak_gradient_bytes, storage_bytes(t.grad for t in copy.values()))
        for name, parameter in self.module.named_parameters():
            parameter.grad, copy[name].grad = copy[name].grad, None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.version += 1
        self.pending[version] -= 1
        if not self.pending[version]:
            del self.copies[version], self.pending[version]

    @property
    def versions_held(self) -> int:
        return len(self.copies)
