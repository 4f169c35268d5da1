"""Pipeline bubble (Huang et al. 2019, GPipe; Narayanan et al. 2021, interleaved 1F1B).

With p stages and m microbatches a fill-drain schedule (GPipe or 1F1B) runs m + p − 1 slots of
one microbatch's forward + backward, so the idle fraction of the step is (p − 1)/(m + p − 1);
1F1B does not shrink it, it bounds the microbatches in flight at p. Interleaving v virtual stages
per rank shrinks the fill and drain v-fold: (p − 1)/v slots, fraction ((p−1)/v)/(m + (p−1)/v).
Stages are balanced by cost (`balanced_split`, the one split parallel/pipeline.py runs): with a large output
layer the last stage gets fewer layers, and the stage that bounds the step may be another.
Twin of: parallel/schedules.py (the executed timeline's measured bubble is held against this).
"""

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from mlsyslab.predict.architecture import parameters
from mlsyslab.predict.layout import Layout
from mlsyslab.specs.schema import Model


def pipeline_slots(stages, microbatches, interleave=1):
    """Step length in units of one microbatch's forward + backward on one full stage."""
    p, m, v = (np.asarray(x, dtype=float) for x in (stages, microbatches, interleave))
    return m + (p - 1) / v


def pipeline_bubble_fraction(stages, microbatches, interleave=1):
    """Idle fraction of a pipelined step: (p−1)/(m+p−1), or ((p−1)/v)/(m+(p−1)/v) interleaved."""
    p, v = np.asarray(stages, dtype=float), np.asarray(interleave, dtype=float)
    return ((p - 1) / v) / pipeline_slots(stages, microbatches, interleave)


def balanced_split(costs, stages: int, tail: float = 0.0) -> list[tuple[int, int]]:
    """[first, last) layers of each of `stages` contiguous stages, at least one each, for layers costing `costs` and a
    last stage that also pays `tail` (the output layer): of the splits, the one whose costliest stage costs least, and
    among those the one whose stage costs have the least sum of squares (the most even) — two linear partitions by
    dynamic programming: the least bottleneck, then the most even split under it."""
    return list(_balanced_split(tuple(float(c) for c in costs), int(stages), float(tail)))


@lru_cache(maxsize=256)
def _balanced_split(costs: tuple, stages: int, tail: float) -> tuple:
    layers = len(costs)
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    cost = prefix[None, :] - prefix[:, None] + np.where(np.arange(layers + 1) == layers, tail, 0.0)[None, :]  # [i, j)
    bottleneck, _ = _partition(cost, stages, np.maximum)
    within = bottleneck * (1 + 1e-9)  # the prefix sums' rounding
    _, starts = _partition(cost, stages, lambda best, stage: np.where(stage <= within, best + stage ** 2, np.inf))
    bounds, j = [], layers
    for k in range(stages, 0, -1):
        i = int(starts[k - 1][j])
        bounds.append((i, j))
        j = i
    return tuple(bounds[::-1])


def _partition(cost: np.ndarray, stages: int, extend) -> tuple:
    """Over splits of layers [0, j) into k contiguous stages, k = 1..stages: the best value (least), where
    `extend(value of [0, i), cost of [i, j))` is a split's value with stage [i, j) added; one numpy pass over (i, j)
    a stage. Returns the best value of all layers, and per k the start of the last stage of the best split of [0, j)."""
    ends = np.arange(cost.shape[0])
    best = np.where(ends == 0, 0.0, np.inf)
    starts = []
    for k in range(1, stages + 1):
        candidates = np.where(ends[:, None] < ends[None, :], extend(best[:, None], cost), np.inf)
        start = candidates.argmin(axis=0)  # ties: the earliest start
        reachable = (ends >= k) & (ends <= ends[-1] - (stages - k))
        best = np.where(reachable, candidates[start, ends], np.inf)
        starts.append(start)
    return best[-1], starts


@dataclass(frozen=True)
class StageLayers:
    """Decoder layers one pipeline rank holds under the balanced split, arrays over layouts (`*_moe`: of them, those
    with experts): the first rank (the embedding, and the most microbatches in flight), the last (the output layer),
    and the busiest of the others (the most forward FLOPs; none when pp = 1). The slowest rank is the last or that one:
    predict.training times both. `middle`, `middle_moe` and `middle_rank` hold, along a last axis, the layers of the
    ranks between the first and the last, each (layers, MoE layers) once with the first rank holding it (zeros where
    none): the rank holding the most parameters, or activations, can be one of them (predict.memory)."""

    first: np.ndarray
    first_moe: np.ndarray
    last: np.ndarray
    last_moe: np.ndarray
    busiest_other: np.ndarray
    busiest_other_moe: np.ndarray
    middle: np.ndarray
    middle_moe: np.ndarray
    middle_rank: np.ndarray


def stage_layers(model: Model, layout: Layout) -> StageLayers:
    """Each layout's split of `model`'s layers into pp × v virtual stages (`balanced_split` on forward FLOPs per token:
    a dense layer's matmul weights, an MoE layer's attention, shared experts, router and top-k routed experts, and the
    output layer on the last), virtual stage i on rank i mod pp (parallel/pipeline.py). Where pp × v exceeds the layers
    (an infeasible layout) the layers are shared evenly, fractions and all."""
    costs, dense_layers, head = _forward_costs(model)
    pp = np.asarray(layout.pp, dtype=np.int64)
    chunks = np.broadcast_to(np.where(np.asarray(layout.schedule) == 2, np.asarray(layout.interleave), 1), pp.shape)
    pairs, which = np.unique(pp * (1 << 32) + chunks, return_inverse=True)  # each (pp, v) split once
    rows = [_rank_layers(costs, dense_layers, head, int(pair >> 32), int(pair & 0xFFFFFFFF)) for pair in pairs]
    width = max((len(row["middle"]) for row in rows), default=1)  # the middle ranks', padded with ranks of none
    middle = ("middle", "middle_moe", "middle_rank")
    for row in rows:
        row.update({name: row[name] + [0.0] * (width - len(row[name])) for name in middle})
    return StageLayers(**{name: np.array([row[name] for row in rows], dtype=float)[which].reshape(
        pp.shape + ((width,) if name.startswith("middle") else ())) for name in StageLayers.__dataclass_fields__})


def virtual_stage_layers(model: Model, stages: int) -> list[tuple[int, int]]:
    """(layers, MoE layers) of each of `stages` virtual stages under the split `stage_layers` sums per rank."""
    return [(layers, moe) for layers, moe, _ in _virtual_stages(*_forward_costs(model), stages)]


def virtual_stage_costs(model: Model, stages: int) -> list[float]:
    """Forward FLOPs per token of each of `stages` virtual stages under that split, the output layer's on the last."""
    return [flops for _, _, flops in _virtual_stages(*_forward_costs(model), stages)]


def _virtual_stages(costs: tuple, dense_layers: int, head: float, stages: int) -> list[tuple[int, int, float]]:
    """(layers, MoE layers, forward FLOPs per token with the output layer's on the last) of each virtual stage of
    `balanced_split`."""
    bounds = balanced_split(costs, stages, head)
    return [(j - i, max(0, j - max(i, dense_layers)), sum(costs[i:j]) + (head if stage == stages - 1 else 0.0))
            for stage, (i, j) in enumerate(bounds)]


def _forward_costs(model: Model) -> tuple:
    """The split's costs: forward FLOPs per token of each layer in order, the dense layers before the MoE ones, and
    the output layer's (on the last stage)."""
    b = parameters(model)
    costs = (2.0 * b.matmul_per_dense_layer,) * b.dense_layers + (2.0 * b.matmul_per_moe_layer,) * b.moe_layers
    return costs, b.dense_layers, 2.0 * b.output_projection


def _rank_layers(costs: tuple, dense_layers: int, head: float, p: int, v: int) -> dict:
    """StageLayers' fields for one (pp, v): rank r holds virtual stages r, r + p, ...; the busiest other is the
    rank before the last with the most forward FLOPs; the middle ranks' (layers, MoE layers), each pair once."""
    layers = len(costs)
    if p * v > layers:
        share, moe_share = layers / p, (layers - dense_layers) / p
        return dict(first=share, first_moe=moe_share, last=share, last_moe=moe_share,
                    busiest_other=share if p > 1 else 0.0, busiest_other_moe=moe_share if p > 1 else 0.0,
                    middle=[share if p > 2 else 0.0], middle_moe=[moe_share if p > 2 else 0.0],
                    middle_rank=[1.0 if p > 2 else 0.0])
    held, moe_held, flops = np.zeros(p), np.zeros(p), np.zeros(p)
    for stage, (stage_layers, moe_layers, stage_flops) in enumerate(_virtual_stages(costs, dense_layers, head, p * v)):
        held[stage % p] += stage_layers
        moe_held[stage % p] += moe_layers
        flops[stage % p] += stage_flops  # the output layer's on the last rank, which the busiest other leaves out
    busiest = int(np.argmax(flops[:-1])) if p > 1 else None
    first_holding = {}  # (layers, MoE layers) -> the first middle rank holding them (the most microbatches in flight)
    for r in range(1, p - 1):
        first_holding.setdefault((float(held[r]), float(moe_held[r])), float(r))
    middle = sorted((*pair, r) for pair, r in first_holding.items()) or [(0.0, 0.0, 0.0)]
    return dict(first=held[0], first_moe=moe_held[0], last=held[-1], last_moe=moe_held[-1],
                busiest_other=0.0 if busiest is None else held[busiest],
                busiest_other_moe=0.0 if busiest is None else moe_held[busiest],
                **{name: [row[i] for row in middle] for i, name in enumerate(("middle", "middle_moe", "middle_rank"))})
