"""ZeRO: shard what data parallelism replicates (Rajbhandari et al., SC'20; Ren et al. 2021, ZeRO-Offload).

Stage 1 shards the optimizer state over the N data-parallel ranks, stage 2 also the gradients,
stage 3 also the parameters (see zero3.py). Model-state bytes per rank for mixed-precision Adam:
4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N; with fp32 training 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N (no master copy).
Wire bytes per step per rank: stages 1 and 2 reduce-scatter the gradients and all-gather the updated
parameters, 2·Ψ·(N−1)/N elements; stage 3 gathers parameters twice more per step, 3·Ψ·(N−1)/N.

Layout: parameters are grouped into buckets (about `bucket_bytes`, reverse registration order ≈ the
order backward produces gradients); each bucket is one flat buffer padded to a multiple of N, and
rank r owns slice r of every bucket (so a bucket's gradients are reduce-scattered the moment they
and those of the buckets before it are ready — the same order of calls on every rank, `buckets.InOrder` — overlapping the rest of backward on the process group; ranks of one x86 host that only do data
parallelism reduce-scatter and all-gather through shared memory instead, `comm/shared_memory.py`, synchronously). Ψ above counts that padding. The optimizer (any
torch.optim class, via `optimizer_factory`) steps only over this rank's slices: fp32 master copies
under mixed precision (bf16 compute), or views of the flat fp32 buffers themselves. With
`offload=True` the master slices, the optimizer state and the step live on the CPU (on a CPU-only
machine this moves nothing physically; the accounting still separates host from device bytes).

Twin: predict.memory.model_state_bytes (held to the byte in tests/parallel/test_zero.py, with
padding), predict.collectives ring bytes for the wire.
`step(max_grad_norm)` clips by the global gradient norm as torch's `clip_grad_norm_` would over the whole model:
each rank sums the squares of its slices' gradients, one all-reduce of that scalar gives the norm, and every slice is
scaled by min(1, max / (norm + 1e-6)) — the shards never gathered. Not done: loss scaling for fp16 (bf16 needs none).
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from mlsyslab.comm import shared_memory
from mlsyslab.comm.launch import Rank
from mlsyslab.comm.log import CommLog, nbytes, traced
from mlsyslab.comm.p2p import Pending
from mlsyslab.errors import InvalidValue
from mlsyslab.parallel.buckets import InOrder, bucket_parameters
from mlsyslab.parallel.clipping import clip_factor, global_norm


class ZeroDataParallel(nn.Module):
    """Wrap `module` for ZeRO stage 1, 2 or 3; call `step()` and `zero_grad()` instead of an optimizer's."""

    def __init__(self, module: nn.Module, rank: Rank, stage: int, optimizer_factory, mixed_precision: bool = False,
                 offload: bool = False, bucket_bytes: int = 25_000_000, log: CommLog | None = None, units=None,
                 alone: tuple = (), parameters: list | None = None, divisor: int | None = None):
        """`alone` (stages 1, 2): parameters that get a bucket of their own, so that their shard is the same
        slice of them on every rank that holds them (a pipeline's tied embedding: `shard_gradient`).
        `parameters`: the ones this instance shards over `rank`'s group (default: every parameter, and the
        buffers are broadcast too), so that two instances can shard one model over two groups — an MoE
        model's dense weights over DP and its experts over the ranks that hold the same experts.
        `divisor`: what the summed gradients are divided by (default: the group's size, their mean)."""
        super().__init__()
        if stage not in (1, 2, 3):
            raise InvalidValue("stage", stage, "1, 2 or 3 (stage 0 is plain data parallelism: parallel.ddp)")
        self.module, self.rank, self.stage, self.log = module, rank, stage, log
        self.compute_dtype = torch.bfloat16 if mixed_precision else torch.float32
        self.offload_device = torch.device("cpu") if offload else rank.device
        self.offload = offload
        n = rank.world_size
        divisor = divisor or n
        params = [p for p in (module.parameters() if parameters is None else parameters) if p.requires_grad]
        with torch.no_grad():  # every rank starts from the group's first rank's weights
            for tensor in [*params, *(module.buffers() if parameters is None else ())]:
                traced(log, "broadcast", nbytes(tensor), n, dist.broadcast, tensor, group=rank.group, group_src=0)
        # ranks of one x86 host that only do data parallelism: the collectives through shared memory (gloo's wake-ups
        # had ZeRO-3's backward wait on its all-gathers a quarter of the step: benchmarks/README.md)
        shared = shared_memory.for_data_parallel(rank)
        if stage == 3:
            from mlsyslab.parallel.zero3 import PartitionedParameters

            self.partition = PartitionedParameters(module, rank, self.compute_dtype, log, units, params, divisor,
                                                   shared)
            slices = self.partition.shards
        else:
            single = {id(p) for p in alone}
            groups = [[p] for p in params[::-1] if id(p) in single]
            groups += bucket_parameters([p for p in params[::-1] if id(p) not in single], bucket_bytes)
            self.buckets = [_FlatBucket(b, rank, self.compute_dtype, stage, divisor, shared) for b in groups]
            slices = [b.slice for b in self.buckets]
            self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
            self._in_order = InOrder([len(b.params) for b in self.buckets],
                                     lambda index: self.buckets[index].reduce_scatter_gradients(self.log))
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_gradient)
            self._callback_queued = False
        self._sync = True
        # The optimizer's parameters: fp32 masters (mixed precision or offload) or the slices themselves.
        self._separate_masters = mixed_precision or offload
        self.masters = [nn.Parameter(s.detach().to(self.offload_device, torch.float32, copy=True))
                        if self._separate_masters else s for s in slices]
        self.optimizer = optimizer_factory(self.masters)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Stage 1: accumulate full gradients locally, reduce once. Stages 2 and 3 reduce every backward
        (they keep no full gradient), so inside no_sync they still communicate."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def reduce_gradients(self) -> None:
        """Stage 1: reduce-scatter what accumulated under `no_sync` now — for callers whose backward
        passes are not theirs to mark (a pipeline step runs them all; parallel/mesh.py)."""
        if self.stage != 1:
            raise InvalidValue("stage", self.stage, "1 (stages 2 and 3 reduce inside every backward)")
        for bucket in self.buckets:
            bucket.reduce_scatter_gradients(self.log)
            bucket.finish_reduce()

    @torch.no_grad()
    def step(self, max_grad_norm: float = 0.0, norm: float | None = None) -> float | None:
        """Optimizer step on this rank's slices, then all-gather the updated parameters (stages 1, 2). With
        `max_grad_norm` > 0 the gradients are first clipped to that global norm: the norm over this group's ranks,
        or `norm` where the caller computed it over more (a mesh: parallel/clipping.py). Returns the norm before
        clipping (else None)."""
        gradients = self.partition.shard_gradients() if self.stage == 3 else [b.slice_grad for b in self.buckets]
        slices = self.partition.shards if self.stage == 3 else [b.slice for b in self.buckets]
        if max_grad_norm > 0 and norm is None:  # each rank's slices are its own: their squares summed over the group
            norm = global_norm(self.gradient_squares(), self.log, self.rank)
        scale = clip_factor(norm, max_grad_norm) if max_grad_norm > 0 else None
        for master, gradient in zip(self.masters, gradients):
            master.grad = torch.zeros_like(master) if gradient is None else gradient.to(master.device, master.dtype)
            if scale is not None:
                master.grad.mul_(scale)
        self.optimizer.step()
        for master, piece in zip(self.masters, slices):
            if master is not piece:
                piece.copy_(master)
        if self.stage < 3:
            for bucket in self.buckets:
                bucket.gather_parameters(self.log)
        return norm if max_grad_norm > 0 else None

    def gradient_squares(self, weights: dict[int, float] | None = None) -> torch.Tensor:
        """The sum of the squares of this rank's gradient slices (padding is zeros), in fp32; with `weights`
        (parameter id → weight, default 1) each parameter's part of a slice weighted — for a norm over ranks that
        hold some parameters twice (parallel/clipping.py)."""
        holders = self.partition.units if self.stage == 3 else self.buckets
        gradients = self.partition.shard_gradients() if self.stage == 3 else [b.slice_grad for b in self.buckets]
        weights = weights or {}
        squares = torch.zeros((), dtype=torch.float32, device=self.rank.device)
        for holder, gradient in zip(holders, gradients):
            if gradient is None:
                continue
            first = self.rank.rank * gradient.numel()  # where this rank's slice starts in the holder's flat buffer
            for key, offset, numel in holder.pieces:
                start, end = max(offset, first) - first, min(offset + numel, first + gradient.numel()) - first
                if start < end and weights.get(key, 1.0):
                    squares += weights.get(key, 1.0) * gradient[start:end].float().pow(2).sum()
        return squares

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.stage == 3:
            self.partition.zero_grad()
        else:
            for bucket in self.buckets:
                bucket.zero_grad()

    def model_state_tensors(self) -> dict:
        """The tensors this rank holds by category (the input of measure.memory)."""
        if self.stage == 3:
            weights, gradients = self.partition.state_tensors()
        else:
            weights = [b.flat for b in self.buckets]
            gradients = [b.flat_grad if self.stage == 1 else b.slice_grad for b in self.buckets]
        # Per-element optimizer state (Adam's m and v); the scalar step counter is not model state.
        state = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        optimizer = (list(self.masters) if self._separate_masters else []) + state
        return {"weights": weights, "gradients": gradients,
                "optimizer": [] if self.offload else optimizer, "host_offload": optimizer if self.offload else []}

    def shard_gradient(self, parameter: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the reduced gradient of `parameter`, which must have a bucket (stages 1, 2:
        `alone`) or a unit (stage 3: a module of its own) to itself; zeros of that size where this rank
        does not hold it. Summing it over another group, in place, sums the parameter's gradient (a
        pipeline's tied embedding)."""
        held = self.partition.shard_gradient(parameter) if self.stage == 3 else None
        index = self._bucket_of.get(id(parameter)) if self.stage < 3 else None
        bucket = None if index is None else self.buckets[index]
        if bucket is not None and (len(bucket.params) != 1 or bucket.params[0] is not parameter):
            raise InvalidValue("parameter", tuple(parameter.shape), "one with a bucket of its own (alone=)")
        if bucket is not None:
            held = bucket.slice_grad
        if held is None:  # no backward has reached it yet, or this rank does not hold it
            held = torch.zeros(-(-parameter.numel() // self.rank.world_size), dtype=torch.float32,
                               device=self.rank.device)
            if bucket is not None:
                bucket.slice_grad = held
        return held

    @property
    def padded_numel(self) -> int:
        """Ψ as the shards count it: every bucket (unit) padded to a multiple of N."""
        if self.stage == 3:
            return self.partition.padded_numel
        return sum(b.flat.numel() for b in self.buckets)

    # ---- stages 1 and 2: gradients reduce-scattered bucket by bucket as backward produces them ----

    def _on_gradient(self, param: torch.Tensor) -> None:
        if self.stage == 1 and not self._sync:
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._in_order.arrived(self._bucket_of[id(param)])

    def _finish_backward(self) -> None:
        self._in_order.finish()  # buckets some parameter of which got no gradient this step
        for bucket in self.buckets:
            bucket.finish_reduce()
        self._callback_queued = False


class _FlatBucket:
    """Parameters that live as views of one flat buffer padded to a multiple of N; rank r owns slice r."""

    def __init__(self, params: list, rank: Rank, dtype: torch.dtype, stage: int, divisor: int,
                 shared: shared_memory.SharedMemoryCollectives | None = None):
        """shared: the group's shared-memory collectives (synchronous), or None for the process group's."""
        self.params, self.rank, self.stage, self.divisor, self.shared = params, rank, stage, divisor, shared
        n = rank.world_size
        numel = sum(p.numel() for p in params)
        padded = -(-numel // n) * n
        self.flat = torch.zeros(padded, dtype=dtype, device=rank.device)
        offset, self.pieces = 0, []  # pieces: (parameter id, offset, numel) in the flat buffer
        for p in params:  # the module's parameters become views of the flat buffer
            self.flat[offset: offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset: offset + p.numel()].view_as(p)
            self.pieces.append((id(p), offset, p.numel()))
            offset += p.numel()
        size = padded // n
        self.slice = self.flat[rank.rank * size: (rank.rank + 1) * size]
        self.flat_grad = torch.zeros_like(self.flat) if stage == 1 else None
        if stage == 1:  # gradients accumulate in place in views of one full flat buffer
            offset = 0
            for p in params:
                p.grad = self.flat_grad[offset: offset + p.numel()].view_as(p)
                offset += p.numel()
        self.slice_grad = None
        self.pending, self._incoming = None, None

    def reduce_scatter_gradients(self, log: CommLog | None) -> None:
        """Launch the reduce-scatter (sum) of this bucket's gradients into this rank's slice: asynchronous on the
        process group; through shared memory (ranks of one host) done on return, gloo's wake-ups having cost more
        than the overlap gained (`mlsys train --strategy zero2`, llama-tiny, 2 ranks: 483 → 431 ms a step)."""
        if self.stage == 1:
            source = self.flat_grad
        else:  # stage 2: gather the fresh gradients into a temporary, then drop the full ones
            source = torch.empty_like(self.flat)  # each piece written once: a gradient, or zeros where there is none
            offset = 0
            for p in self.params:
                piece = source[offset: offset + p.numel()]
                if p.grad is not None:
                    piece.copy_(p.grad.reshape(-1))
                    p.grad = None
                else:
                    piece.zero_()
                offset += p.numel()
            source[offset:].zero_()  # the padding
        self._incoming = torch.empty_like(self.slice)
        works = shared_memory.start_sharded(log, "reduce_scatter", self.shared, self.rank, self._incoming, source)
        self.pending = Pending(works, self.rank, "ZeRO gradient reduce-scatter", tuple(source.shape), (source,))

    def finish_reduce(self) -> None:
        self.pending.wait()
        self._incoming.div_(self.divisor)  # the sum over ranks → (by default) the mean gradient
        if self.stage == 1:  # keep it in this rank's part of the full buffer: no extra memory
            size = self.slice.numel()
            self.slice_grad = self.flat_grad[self.rank.rank * size: (self.rank.rank + 1) * size]
            self.slice_grad.copy_(self._incoming)
        else:
            self.slice_grad = self._incoming if self.slice_grad is None else self.slice_grad.add_(self._incoming)
        self.pending, self._incoming = None, None

    def gather_parameters(self, log: CommLog | None) -> None:
        mine = self.slice.clone()
        works = shared_memory.start_sharded(log, "all_gather", self.shared, self.rank, self.flat, mine)
        Pending(works, self.rank, "ZeRO parameter all-gather", tuple(self.flat.shape), (mine,)).wait()

    def zero_grad(self) -> None:
        self.slice_grad = None
        if self.stage == 1:
            self.flat_grad.zero_()
