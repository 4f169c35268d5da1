"""ZeRO inside a device mesh: the optimizer state, gradients (stage 2) and weights (stage 3) of each rank's
TP shards and pipeline stages, sharded over the ranks that hold the same weights.

Those are the DP × CP ranks (Megatron's distributed optimizer shards over DP × CP too): `MeshRanks.dcp`.
Under expert parallelism the experts are not replicated over DP — each EP rank holds E/ep of them — so
an MoE model takes two `ZeroDataParallel`s (DeepSpeed-MoE's expert data parallelism): the dense weights
over DP × CP, the experts over the DP × CP ranks holding the same experts (`MeshRanks.edcp`, dp·cp/ep
ranks). Both divide their summed gradients by the DP × CP size: an expert's gradient already sums the
tokens its whole EP group sent it, so the dense weights' mean over DP × CP is the experts' sum over
`edcp` divided by dp·cp, not by its own size. (Adam hides a gradient off by a constant factor in the
losses — tests/parallel/test_mesh.py holds this under SGD.) predict.training prices the two groups'
collectives the same way. With `max_grad_norm` the step clips by the whole model's gradient norm, from every rank's
slices (parallel/clipping.py). Used by `train.trainer.train_on_mesh`.
"""

from collections.abc import Callable
from contextlib import ExitStack

from torch import nn

from mlsyslab.comm.log import CommLog
from mlsyslab.nn.llama import DecoderLayer
from mlsyslab.parallel.clipping import global_norm, piece_weights
from mlsyslab.parallel.mesh import MeshRanks, expert_parameters
from mlsyslab.parallel.tensor import split_parameters
from mlsyslab.parallel.zero import ZeroDataParallel


class MeshZero:
    """`loss, norm = zero.train_step(lambda tied_gradient: composed_step(..., reduce_data_parallel=False,
    tied_gradient=tied_gradient))`: one step's forward, backward and optimizer step."""

    def __init__(self, model: nn.Module, module: nn.Module, mesh: MeshRanks, stage: int, optimizer_factory,
                 bucket_bytes: int = 25_000_000, log: CommLog | None = None, tied: tuple = (),
                 mixed_precision: bool = False, offload: bool = False, norm_log: CommLog | None = None):
        """`model`: the whole model (to find the experts); `module`: what this rank holds of it (its
        pipeline stages, or the model); `tied`: parameters two pipeline stages hold (`ZeroDataParallel`'s
        `alone`); `norm_log`: where clipping's all-reduce is counted."""
        self.stage, self.tied, self.norm_log = stage, tied, norm_log
        held = list(module.parameters())
        experts = expert_parameters(model) if mesh.layout.ep > 1 else set()
        self.weights = piece_weights(held, mesh, split_parameters(module), experts, tied, sharded=True)
        groups = [(mesh.dcp, [p for p in held if id(p) not in experts], tied)]
        if experts:
            groups.append((mesh.edcp, [p for p in held if id(p) in experts], ()))
        # ZeRO-3 gathers a decoder layer at a time, as the trainer's data-parallel path (and FSDP's per-block
        # wrapping) does, not each linear apart: a tenth of the collectives, each larger, and what predict prices
        # (two gathered layers; (layers + 2) gathers a pass). A layer also covers the sequence-parallel entries
        # that multiply the gathered sequence by their children's weights without calling those children.
        layers = [m for m in module.modules() if isinstance(m, DecoderLayer)]
        self.zeros = [ZeroDataParallel(module, rank, stage, optimizer_factory, mixed_precision, offload,
                                       bucket_bytes, log, units=layers, alone=alone,
                                       parameters=parameters if experts else None, divisor=mesh.dcp.world_size)
                      for rank, parameters, alone in groups]
        if log is not None:
            log.reset()  # the start-up broadcasts are not a step's traffic

    def train_step(self, forward_backward: Callable, max_grad_norm: float = 0.0,
                   measure: Callable[[dict], None] | None = None) -> tuple[float, float | None]:
        """Run `forward_backward(tied_gradient)` (for ZeRO-2 and -3, a function giving this rank's slice of
        the tied parameter's gradient, to sum over the pipeline; else None), reduce what it left (ZeRO-1
        once, after every microbatch), clip to `max_grad_norm` if > 0, step, clear. Returns the loss and the
        gradient's norm before clipping (None without). `measure`, if given, is called with the tensors the rank
        holds by category (`model_state_tensors`) after the step, before the gradients are cleared."""
        with ExitStack() as accumulating:
            if self.stage == 1:  # accumulate over the pipeline's backwards, reduce once
                for zero in self.zeros:
                    accumulating.enter_context(zero.no_sync())
            tied_gradient = (lambda: self.zeros[0].shard_gradient(self.tied[0])) if self.tied and self.stage > 1 else None
            loss = forward_backward(tied_gradient)
        if self.stage == 1:
            for zero in self.zeros:
                zero.reduce_gradients()
        norm = global_norm(sum(zero.gradient_squares(self.weights) for zero in self.zeros), self.norm_log) \
            if max_grad_norm > 0 else None
        for zero in self.zeros:
            zero.step(max_grad_norm, norm)
        if measure is not None:
            measure(self.model_state_tensors())
        for zero in self.zeros:
            zero.zero_grad()
        return loss, norm

    def model_state_tensors(self) -> dict:
        """The tensors this rank holds by category, over both groups (`ZeroDataParallel.model_state_tensors`)."""
        held = [zero.model_state_tensors() for zero in self.zeros]
        return {category: [t for states in held for t in states[category]] for category in held[0]}

    @property
    def padded_numel(self) -> tuple[int, int]:
        """(dense, experts) parameters as the shards count them, each group's padded to a multiple of its ranks."""
        return self.zeros[0].padded_numel, self.zeros[1].padded_numel if len(self.zeros) > 1 else 0
