"""Clipping by the global gradient norm on a device mesh (Pascanu et al. 2013; Megatron-LM's `clip_grad_norm_fp32`).

The norm is the whole model's, the one torch's `clip_grad_norm_` computes on one process: ‖g‖² is the sum of every
parameter's gradient's squares. On a mesh each rank holds pieces of that gradient, some of them held by other ranks
too, so each rank sums its pieces' squares weighted to count every piece once over the world, and one all-reduce
of that scalar over every rank gives ‖g‖² (Megatron counts a piece once by leaving duplicates out and sums over the
model-parallel group; here the data-parallel copies are weighted instead, so that one all-reduce serves every
layout, experts included). The weights (`piece_weights`):
- a weight TP does not split (the norms, an MoE router) has the same gradient on every TP rank: counted on TP rank 0;
- under PP the tied embedding is held by the first stage and the last, its gradient summed over the pipeline:
  counted on the first stage;
- without ZeRO every DP × CP rank holds the same averaged gradients, so each counts 1/(dp·cp) of its squares; an
  expert's are held by the (dp/ep)·cp ranks holding the same experts: ep/(dp·cp);
- under ZeRO each rank of the DP × CP group holds its own slice (an expert's, of the `edcp` group): counted whole.
Every gradient is then scaled by min(1, max / (norm + 1e-6)), torch's factor. The all-reduce (one fp32, or fp64
for fp64 gradients) is logged as `gradient_norm`. Not under PipeDream's schedule, whose stages step after every
microbatch's backward: a norm there would be each microbatch's (refused by train.trainer).
Held against torch's `clip_grad_norm_` on one process in tests/parallel/test_mesh.py.
"""

from collections.abc import Iterable

import torch
import torch.distributed as dist

from mlsyslab.comm.launch import Rank
from mlsyslab.comm.log import CommLog, nbytes, traced


def clip_factor(norm: float, max_norm: float) -> float:
    """What every gradient is multiplied by: torch's clip_grad_norm_ factor, at most 1."""
    return min(1.0, max_norm / (norm + 1e-6))


def piece_weights(parameters: Iterable[torch.Tensor], mesh, split: set[int], experts: set[int], tied: tuple,
                  sharded: bool) -> dict[int, float]:
    """Parameter id → the weight of its gradient's squares on this rank (see above). `split`: the ids TP splits
    (parallel.tensor.split_parameters); `experts`: the experts' (parallel.mesh.expert_parameters); `tied`: the
    parameters the first and the last pipeline stage both hold; `sharded`: under ZeRO."""
    layout = mesh.layout
    weights = {}
    for parameter in parameters:
        duplicate = (layout.tp > 1 and mesh.tp.rank > 0 and id(parameter) not in split) or \
                    (layout.pp > 1 and mesh.pp.rank > 0 and any(parameter is t for t in tied))
        copies = 1 if sharded else layout.dp * layout.cp / (layout.ep if id(parameter) in experts else 1)
        weights[id(parameter)] = 0.0 if duplicate else 1.0 / copies
    return weights


def squares_dtype(gradients: Iterable[torch.Tensor | None]) -> torch.dtype:
    """fp32, or fp64 where a gradient is fp64."""
    return torch.float64 if any(g is not None and g.dtype == torch.float64 for g in gradients) else torch.float32


def global_norm(squares: torch.Tensor, log: CommLog | None = None, rank: Rank | None = None) -> float:
    """The whole gradient's norm from this rank's weighted squares: one all-reduce over every rank (or over `rank`'s
    group, where its ranks hold the whole gradient between them: ZeRO alone)."""
    group, size = (None, dist.get_world_size()) if rank is None else (rank.group, rank.world_size)
    traced(log, "all_reduce", nbytes(squares), size, dist.all_reduce, squares, group=group)
    return squares.sqrt().item()


@torch.no_grad()
def clip_gradients(parameters: list, weights: dict[int, float], max_norm: float, log: CommLog | None = None) -> float:
    """Without ZeRO: scale the `.grad` of this rank's `parameters` in place to the global norm `max_norm`; returns
    the norm before."""
    gradients = [p.grad for p in parameters]
    squares = torch.zeros((), dtype=squares_dtype(gradients))
    for parameter, gradient in zip(parameters, gradients):
        if gradient is not None and weights[id(parameter)]:
            squares += weights[id(parameter)] * gradient.to(squares.dtype).pow(2).sum()
    norm = global_norm(squares, log)
    factor = clip_factor(norm, max_norm)
    for gradient in gradients:
        if gradient is not None:
            gradient.mul_(factor)
    return norm
