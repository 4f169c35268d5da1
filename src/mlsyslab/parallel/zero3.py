"""ZeRO-3 parameter partitioning: each rank stores 1/N of every parameter (Rajbhandari et al., SC'20).

Parameters are grouped into units (by default each module that owns parameters; `mlsys train` and the mesh
pass each decoder layer, as FSDP wraps one block at a time; modules that share a parameter, as tied embeddings
do, form one unit). A unit's parameters live as one flat buffer
padded to a multiple of N, of which this rank keeps slice r (`shards`). Just before a unit's
forward its full buffer is all-gathered — the next unit's gather is already in flight (prefetch) —
and the module's parameters become views of it; right after, they are dropped. Autograd would keep
the gathered weights alive until backward, so inside the unit a saved-tensor hook replaces any
tensor that lives in the gathered buffer by a small handle; when the gradient reaches the unit's
output the buffer is gathered again (prefetching the unit before it) and the handles resolve into
it. The unit's gradient is then reduce-scattered into this rank's slice. Per step every parameter
crosses the wire three times: all-gather forward, all-gather backward, reduce-scatter:
3·Ψ·(N−1)/N elements per rank. At most two units are gathered at once (predict counts two layers). Ranks of one
x86 host that only do data parallelism gather and reduce-scatter through shared memory (`comm/shared_memory.py`,
chosen by `ZeroDataParallel`), synchronously: a prefetch then completes when issued.
Not handled: a unit one rank skips (a branch only some ranks take) leaves its gathers out of step with the others' —
every rank must run the same units in the same order (shared memory raises `CollectiveMismatch` where the calls differ
in kind or size, not where two units happen to be the same size). Stages 1 and 2 and DDP allow it (`buckets.InOrder`).
Twin: predict.memory (16Ψ/N, two gathered layers), predict.training (3Ψ data-parallel volume).
Held against DDP and the byte-exact prediction in tests/parallel/test_zero.py.
"""

from dataclasses import dataclass

import torch
from torch import nn

from mlsyslab.comm.launch import Rank
from mlsyslab.comm.log import CommLog
from mlsyslab.comm.p2p import Pending
from mlsyslab.comm.shared_memory import SharedMemoryCollectives, start_sharded
from mlsyslab.errors import InvalidValue
from mlsyslab.measure.memory import count_saved


class PartitionedParameters:
    def __init__(self, module: nn.Module, rank: Rank, dtype: torch.dtype, log: CommLog | None, units=None,
                 parameters: list | None = None, divisor: int | None = None,
                 shared: SharedMemoryCollectives | None = None):
        """Partition `parameters` (default: all of `module`'s) over `rank`'s group; the unit gradients'
        sums are divided by `divisor` (default: the group's size). `shared`: the group's shared-memory
        collectives (synchronous), or None for the process group's."""
        self.rank, self.log, self.divisor, self.shared = rank, log, divisor or rank.world_size, shared
        module.register_forward_pre_hook(self._new_forward)  # before any unit's own hook
        chosen = None if parameters is None else {id(p) for p in parameters}
        self.units = [_Unit(self, slots, hooks, dtype) for slots, hooks in _group(module, units, chosen)]
        self.unit_of = {key: unit for unit in self.units for key in unit.parameter_ids}
        self.order: list = []  # units in the order the first forward used them (for prefetch)
        self._live_storages: dict = {}  # storage pointer of a gathered buffer → its unit

    def _new_forward(self, module, args) -> None:
        """A new forward pass: no unit is still live from the last one (e.g. a tied module never called)."""
        for unit in self.units:
            unit.release()

    @property
    def shards(self) -> list:
        return [u.shard for u in self.units]

    @property
    def padded_numel(self) -> int:
        return sum(u.padded for u in self.units)

    def shard_gradients(self) -> list:
        return [u.shard.grad for u in self.units]

    def shard_gradient(self, parameter: torch.Tensor) -> torch.Tensor | None:
        """This rank's slice of `parameter`'s reduced gradient (zeros until a backward reaches it), for a
        parameter that is a unit to itself; None where this rank does not hold it
        (`ZeroDataParallel.shard_gradient`)."""
        unit = self.unit_of.get(id(parameter))
        if unit is None:
            return None
        if len(unit.parameter_ids) != 1:
            raise InvalidValue("parameter", tuple(parameter.shape), "one that is a ZeRO-3 unit of its own")
        if unit.shard.grad is None:
            unit.shard.grad = torch.zeros_like(unit.shard)
        return unit.shard.grad

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.shard.grad = None

    def state_tensors(self):
        return [u.shard for u in self.units], [u.shard.grad for u in self.units if u.shard.grad is not None]

    def gather(self, unit: "_Unit") -> Pending:
        """Start the all-gather of `unit`'s full buffer from every rank's slice."""
        buffer = torch.empty(unit.padded, dtype=unit.shard.dtype, device=unit.shard.device)
        works = start_sharded(self.log, "all_gather", self.shared, self.rank, buffer, unit.shard.detach())
        return Pending(works, self.rank, "ZeRO-3 parameter all-gather", (unit.padded,), (buffer,))

    def neighbour(self, unit: "_Unit", step: int):
        if unit not in self.order:
            return None
        index = self.order.index(unit) + step
        return self.order[index] if 0 <= index < len(self.order) else None

    def pack(self, tensor: torch.Tensor):
        unit = self._live_storages.get(tensor.untyped_storage().data_ptr())
        if unit is None:  # an activation: an ActivationMeter's hooks, which these hide, count it
            count_saved(tensor)
            return tensor
        return _Handle(unit, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())

    def unpack(self, saved):
        if not isinstance(saved, _Handle):
            return saved
        return saved.unit.full_for_backward().as_strided(saved.shape, saved.stride, saved.offset)


@dataclass(frozen=True)
class _Handle:
    """Where a saved tensor lived in a unit's gathered buffer: enough to find it again after a re-gather."""

    unit: "_Unit"
    shape: tuple
    stride: tuple
    offset: int


class _Unit:
    def __init__(self, owner: PartitionedParameters, slots: list, hook_modules: list, dtype: torch.dtype):
        self.owner = owner
        rank = owner.rank
        unique = list({id(p): p for _, _, p in slots}.values())
        self.parameter_ids = [id(p) for p in unique]  # not the objects: their full storage is freed below
        offsets, numel = {}, 0
        for p in unique:
            offsets[id(p)] = numel
            numel += p.numel()
        self.pieces = [(id(p), offsets[id(p)], p.numel()) for p in unique]  # in the flat buffer (ZeroDataParallel)
        n = rank.world_size
        self.padded = -(-numel // n) * n
        size = self.padded // n
        flat = torch.zeros(self.padded, dtype=dtype, device=rank.device)
        for p in unique:
            flat[offsets[id(p)]: offsets[id(p)] + p.numel()].copy_(p.detach().reshape(-1))
        self.shard = nn.Parameter(flat[rank.rank * size: (rank.rank + 1) * size].clone())
        # The parameters are pieces of one split of the buffer, so that backward assembles the unit's gradient in one
        # pass (split's backward concatenates); a slice per parameter would give each a zero-filled buffer-sized
        # gradient for autograd to add up: k passes over the buffer for a unit of k parameters.
        self.split_sizes = [p.numel() for p in unique] + [self.padded - numel]
        index = {id(p): i for i, p in enumerate(unique)}
        self.slots = [(module, name, index[id(p)], p.shape) for module, name, p in slots]
        for module, name, _, _ in self.slots:  # the module no longer owns these parameters
            module._parameters.pop(name, None)
            object.__setattr__(module, name, None)
        self.live = None  # the gathered buffer (autograd-tracked) while the unit's forward runs
        self.incoming = None  # the buffer handed to _GatherUnit
        self.users_left = 0
        self.prefetched: Pending | None = None
        self.backward_buffer: torch.Tensor | None = None
        self.backward_pending: Pending | None = None
        self._contexts: list = []
        for module in hook_modules:
            module.register_forward_pre_hook(self._before_forward)
            module.register_forward_hook(self._after_forward)
        self._users = len(hook_modules)

    # ---- forward ----

    def _before_forward(self, module, args):
        owner = self.owner
        if self.live is None:
            if self not in owner.order:
                owner.order.append(self)
            pending = self.prefetched or owner.gather(self)
            self.prefetched = None
            pending.wait()
            buffer = pending.buffers[0]
            self.incoming = buffer
            self.live = _GatherUnit.apply(self.shard, self) if torch.is_grad_enabled() else buffer
            self.incoming = None
            owner._live_storages[buffer.untyped_storage().data_ptr()] = self
            pieces = torch.split(self.live, self.split_sizes)
            for slot_module, name, piece, shape in self.slots:
                object.__setattr__(slot_module, name, pieces[piece].view(shape))
            self.users_left = self._users
            following = owner.neighbour(self, +1)
            if following is not None and following.live is None and following.prefetched is None:
                following.prefetched = owner.gather(following)
        context = torch.autograd.graph.saved_tensors_hooks(owner.pack, owner.unpack)
        context.__enter__()
        self._contexts.append(context)

    def _after_forward(self, module, args, output):
        self._contexts.pop().__exit__(None, None, None)
        if torch.is_grad_enabled():
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._before_backward)
        self.users_left -= 1
        if self.users_left == 0:  # free the full parameters until backward needs them
            self.release()

    def release(self) -> None:
        if self.live is not None:
            self.owner._live_storages.pop(self.live.untyped_storage().data_ptr(), None)
        for slot_module, name, _, _ in self.slots:
            object.__setattr__(slot_module, name, None)
        self.live = None

    # ---- backward ----

    def _before_backward(self, gradient):
        """The gradient reached this unit's output: gather its parameters again, prefetch the previous unit."""
        if self.backward_buffer is None:
            self.full_for_backward()
            previous = self.owner.neighbour(self, -1)
            if previous is not None and previous.backward_buffer is None and previous.backward_pending is None:
                previous.backward_pending = self.owner.gather(previous)
        return gradient

    def full_for_backward(self) -> torch.Tensor:
        if self.backward_buffer is None:
            pending = self.backward_pending or self.owner.gather(self)
            self.backward_pending = None
            pending.wait()
            self.backward_buffer = pending.buffers[0]
        return self.backward_buffer

    def reduce_gradient(self, gradient: torch.Tensor) -> torch.Tensor:
        """Sum the unit's gradient over ranks into this rank's slice (mean over ranks), free the buffer."""
        owner = self.owner
        gradient = gradient.contiguous()
        mine = torch.empty_like(self.shard)
        works = start_sharded(owner.log, "reduce_scatter", owner.shared, owner.rank, mine, gradient)
        Pending(works, owner.rank, "ZeRO-3 gradient reduce-scatter", tuple(gradient.shape)).wait()
        self.backward_buffer = None
        return mine.div_(owner.divisor)


class _GatherUnit(torch.autograd.Function):
    """Forward: the gathered buffer stands for the shard. Backward: reduce-scatter its gradient."""

    @staticmethod
    def forward(ctx, shard, unit):
        ctx.unit = unit
        return unit.incoming

    @staticmethod
    def backward(ctx, gradient):
        return ctx.unit.reduce_gradient(gradient), None


def _group(module: nn.Module, units, chosen: set | None) -> list:
    """[(slots [(module, name, parameter)], modules to hook)]: one group per unit, tied parameters merged;
    only parameters whose id is in `chosen` (None: all)."""
    def slots_of(m):
        return [(m, n, p) for n, p in m._parameters.items()
                if p is not None and p.requires_grad and (chosen is None or id(p) in chosen)]

    groups = []
    covered = set()
    for unit in units or []:
        slots = [slot for m in unit.modules() for slot in slots_of(m)]
        covered.update(id(m) for m in unit.modules())
        if slots:
            groups.append((slots, [unit]))
    for m in module.modules():
        if id(m) in covered:
            continue
        slots = slots_of(m)
        if slots:
            groups.append((slots, [m]))
    merged: list = []
    for slots, hooks in groups:  # modules sharing a parameter become one unit
        ids = {id(p) for _, _, p in slots}
        for other in merged:
            if ids & {id(p) for _, _, p in other[0]}:
                other[0].extend(slots)
                other[1].extend(hooks)
                break
        else:
            merged.append((list(slots), list(hooks)))
    return merged


def _tensors(output):
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    return []
