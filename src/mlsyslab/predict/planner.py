"""The layout planner: every valid layout for a model, cluster and global batch, ranked.

Enumerates TP (powers of two that divide the heads and stay inside the scale-up domain), PP
(dividing the GPUs, up to the layers: the split is cost-balanced, so uneven stages are no obstacle), CP, EP
(dividing the experts and DP), DP = gpus / (TP·PP·CP), ZeRO 0-3,
micro batch, recompute, schedule (GPipe, 1F1B, interleaved with v = 2, 4) and optimizer offload as
one cartesian grid of numpy arrays, and evaluates the whole grid in one `predict_training` call —
no Python loop per configuration. Layouts that break a rule or do not fit are counted by reason
and never ranked; the feasible ones are ranked by predicted tokens per second.
"""

from dataclasses import dataclass

import numpy as np

from mlsyslab.errors import InvalidValue
from mlsyslab.predict.assumptions import DEFAULT, Assumptions
from mlsyslab.predict.hardware import Hardware
from mlsyslab.predict.layout import Layout
from mlsyslab.predict.training import REASONS, TrainingPrediction, predict_training
from mlsyslab.specs.schema import Model

MICRO_BATCHES = (1, 2, 4, 8, 16)
INTERLEAVES = (2, 4)


CHUNK = 1 << 16  # layouts per vectorised call: keeps temporaries in cache-sized arrays


@dataclass(frozen=True)
class Plan:
    layouts: Layout  # the whole grid
    tokens_per_s: np.ndarray
    feasible: np.ndarray
    reason_code: np.ndarray
    ranked: np.ndarray  # indices of feasible layouts, best first
    infeasible: dict  # reason -> count
    model: Model
    hardware: Hardware
    assumptions: Assumptions

    @property
    def evaluated(self) -> int:
        return self.layouts.size

    def top(self, k: int) -> tuple[Layout, TrainingPrediction]:
        """The k best layouts and their full predictions (breakdowns, memory, wire bytes)."""
        best = self.layouts.take(self.ranked[:k])
        return best, predict_training(self.model, self.hardware, best, assumptions=self.assumptions)


def layout_grid(model: Model, hardware: Hardware, gpus: int, global_batch: int, seq: int) -> Layout:
    """Every candidate layout as one Layout of flat arrays."""
    _check_positive(gpus=gpus, global_batch=global_batch, seq=seq)
    tps = [t for t in _powers_of_two(min(gpus, hardware.scale_up_domain)) if model.heads % t == 0]
    pps = [p for p in _divisors(gpus) if p <= model.layers]
    cps = [c for c in _powers_of_two(min(gpus, 16)) if c == 1 or seq % (2 * c) == 0]  # zig-zag: 2·cp chunks
    eps = [1] if model.moe is None else [e for e in _divisors(gpus) if model.moe.experts % e == 0]
    # (schedule, interleave) pairs; interleaving only with more than one stage (filtered below).
    schedules = [(0, 1), (1, 1)] + [(2, v) for v in INTERLEAVES]
    tp, pp, cp, ep, zero, mb, recompute, sched, offload = np.meshgrid(
        tps, pps, cps, eps, [0, 1, 2, 3], MICRO_BATCHES, [0, 1, 2], range(len(schedules)), [False, True],
        indexing="ij")
    tp, pp, cp, ep, zero, mb, recompute, sched, offload = (
        x.reshape(-1) for x in (tp, pp, cp, ep, zero, mb, recompute, sched, offload))
    schedule = np.array([s for s, _ in schedules])[sched]
    interleave = np.array([v for _, v in schedules])[sched]
    keep = (gpus % (tp * pp * cp) == 0) & ((pp > 1) | (schedule == 1))  # one stage: only 1F1B is distinct
    dp = np.where(keep, gpus // (tp * pp * cp), 1)
    keep &= (dp % ep == 0) & (global_batch % (dp * mb) == 0)
    keep &= (zero == 0) | (dp > 1)  # ZeRO over one rank shards nothing
    keep &= ~offload | (zero >= 1)  # ZeRO-Offload offloads the sharded optimizer
    pick = lambda x: x[keep]  # noqa: E731
    return Layout.of(dp=pick(dp), tp=pick(tp), pp=pick(pp), cp=pick(cp), ep=pick(ep), zero=pick(zero),
                     micro_batch=pick(mb), global_batch=global_batch, seq=seq, recompute=pick(recompute),
                     schedule=pick(schedule), interleave=pick(interleave), sequence_parallel=pick(tp) > 1,
                     offload=pick(offload))


def plan(model: Model, hardware: Hardware, gpus: int, global_batch: int, seq: int,
         assumptions: Assumptions = DEFAULT) -> Plan:
    layouts = layout_grid(model, hardware, gpus, global_batch, seq)
    if layouts.size == 0:
        raise InvalidValue("global_batch", global_batch, f"a multiple of DP x micro batch for some layout of {gpus} GPUs")
    tokens_per_s, feasible, reason_code = evaluate(model, hardware, layouts, assumptions)
    candidates = np.flatnonzero(feasible)
    ranked = candidates[np.argsort(-tokens_per_s[candidates], kind="stable")]
    codes, counts = np.unique(reason_code[~feasible], return_counts=True)
    infeasible = {REASONS[c]: int(n) for c, n in zip(codes, counts)}
    return Plan(layouts, tokens_per_s, feasible, reason_code, ranked, infeasible, model, hardware, assumptions)


def evaluate(model: Model, hardware: Hardware, layouts: Layout, assumptions: Assumptions = DEFAULT):
    """(tokens/s, feasible, reason code) of every layout, in vectorised chunks of CHUNK layouts."""
    tokens_per_s = np.empty(layouts.size)
    feasible = np.empty(layouts.size, dtype=bool)
    reason_code = np.empty(layouts.size, dtype=np.int8)
    for start in range(0, layouts.size, CHUNK):
        part = slice(start, start + CHUNK)
        prediction = predict_training(model, hardware, layouts.take(part), assumptions=assumptions)
        tokens_per_s[part], feasible[part], reason_code[part] = (
            prediction.tokens_per_s, prediction.feasible, prediction.reason_code)
    return tokens_per_s, feasible, reason_code


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(int(np.log2(max(limit, 1))) + 1)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_positive(**values):
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise InvalidValue(name, value, "a whole number >= 1")
