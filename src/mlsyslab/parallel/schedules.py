"""Pipeline schedules as data: for every rank, the ordered list of what it does.

An action is (kind, microbatch, chunk): kind "F" (forward) or "B" (backward) of `microbatch` through
the rank's model chunk `chunk` (virtual stage rank + chunk·p; always 0 without interleaving).
- GPipe (Huang et al. 2019): all forwards, then all backwards — m microbatches in flight.
- 1F1B (Narayanan et al. 2019, PipeDream-Flush): p − rank − 1 warm-up forwards, then one forward and
  one backward alternately, then the cool-down backwards — at most p − rank in flight.
- Interleaved 1F1B (Narayanan et al. 2021): v chunks per rank, each microbatch visits every rank v
  times; the warm-up is (p − rank − 1)·2 + (v − 1)·p forwards; microbatches go in groups of p.
- PipeDream (Narayanan et al. 2019) asynchronous 1F1B: the same order as 1F1B with no flush between
  steps; each microbatch's backward must use the weight version its forward used (weight stashing):
  `weight_versions` says which.
The same object is executed by parallel/pipeline.py, simulated here (`timeline`) to measure the bubble
and the activations in flight, and drawn (`render_png`, `chrome_trace`).
Twin: predict.pipeline (bubble (p−1)/(m+p−1), ((p−1)/v)/(m+(p−1)/v)) and predict.memory (in flight).
"""

import json
from dataclasses import dataclass

from mlsyslab.errors import InvalidValue

SCHEDULES = ("gpipe", "1f1b", "interleaved", "pipedream")


@dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    microbatch: int
    chunk: int = 0


@dataclass(frozen=True)
class Schedule:
    name: str
    stages: int  # p: ranks in the pipeline
    microbatches: int  # m
    chunks: int  # v: model chunks per rank (1 unless interleaved)
    actions: tuple  # actions[rank] = tuple of Action

    def virtual_stage(self, rank: int, chunk: int) -> int:
        return chunk * self.stages + rank

    @property
    def analytic_bubble(self) -> float:
        p, m, v = self.stages, self.microbatches, self.chunks
        return ((p - 1) / v) / (m + (p - 1) / v)


def build(name: str, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    if name not in SCHEDULES:
        raise InvalidValue("schedule", name, ", ".join(SCHEDULES))
    if stages < 1 or microbatches < 1 or chunks < 1:
        raise InvalidValue("pipeline", (stages, microbatches, chunks), "stages, microbatches and chunks >= 1")
    if name != "interleaved" and chunks != 1:
        raise InvalidValue("interleave", chunks, "1 (one model chunk per rank) unless the schedule is interleaved")
    if name == "interleaved" and microbatches % stages:
        raise InvalidValue("microbatches", microbatches, f"a multiple of the {stages} stages (interleaved 1F1B)")
    plan = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "pipedream": _one_f_one_b, "interleaved": _interleaved}[name]
    actions = tuple(tuple(plan(rank, stages, microbatches, chunks)) for rank in range(stages))
    return Schedule(name, stages, microbatches, chunks, actions)


def _gpipe(rank, p, m, v):
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def _one_f_one_b(rank, p, m, v):
    warmup = min(p - rank - 1, m)
    order = [Action("F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while forward < m:
        order += [Action("F", forward), Action("B", backward)]
        forward, backward = forward + 1, backward + 1
    order += [Action("B", i) for i in range(backward, m)]
    return order


def _interleaved(rank, p, m, v):
    """Megatron's order: forward unit k is microbatch (k // (p·v))·p + k % p of chunk (k // p) % v."""
    total = m * v

    def forward_unit(k):
        group, within = divmod(k, p * v)
        return Action("F", group * p + within % p, within // p)

    def backward_unit(k):
        group, within = divmod(k, p * v)
        return Action("B", group * p + within % p, v - 1 - within // p)

    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = [forward_unit(k) for k in range(warmup)]
    forward, backward = warmup, 0
    while forward < total:
        order += [forward_unit(forward), backward_unit(backward)]
        forward, backward = forward + 1, backward + 1
    order += [backward_unit(k) for k in range(backward, total)]
    return order


def weight_versions(schedule: Schedule) -> list[dict]:
    """PipeDream weight stashing: per rank, {microbatch: the number of updates applied before its forward}.

    Each rank updates its weights after every backward; a microbatch's backward must use the version its
    forward saw, which on rank r lags the newest by up to p − r − 1 updates.
    """
    stashed = []
    for rank_actions in schedule.actions:
        updates, versions = 0, {}
        for action in rank_actions:
            if action.kind == "F":
                versions[action.microbatch] = updates
            else:
                updates += 1
        stashed.append(versions)
    return stashed


@dataclass(frozen=True)
class Timeline:
    spans: list  # (rank, action, start, end), times from the first start
    makespan: float
    bubble: float  # idle fraction of ranks × makespan
    peak_in_flight: list  # per rank: most microbatch-chunks whose activations are held at once

    @classmethod
    def of(cls, schedule: Schedule, spans: list) -> "Timeline":
        """The timeline of `schedule`'s (rank, action, start, end) spans, simulated or executed (any clock)."""
        first = min(start for _, _, start, _ in spans)
        spans = [(rank, action, start - first, end - first) for rank, action, start, end in spans]
        return cls(spans, max(end for *_, end in spans), idle_fraction([(start, end) for *_, start, end in spans],
                                                                         schedule.stages),
                   [peak_held(actions) for actions in schedule.actions])


def timeline(schedule: Schedule, forward_s: float = 1.0, backward_s: float = 2.0, stage_costs=None,
             durations: dict | None = None) -> Timeline:
    """Simulate the schedule: each action starts when its rank is free and its input has arrived
    (a forward needs the previous virtual stage's forward; a backward the next stage's backward, or its
    own forward on the last stage). Times are per chunk: a full stage's forward_s divided by v, scaled by
    `stage_costs[virtual stage]` over their mean when given (a split whose stages do unequal work) — or, given
    `durations` {(rank, action): seconds}, each action's own (an executed step's, replayed: `pipeline.replayed_timeline`)."""
    p, v = schedule.stages, schedule.chunks
    scale = [1.0] * (p * v) if stage_costs is None else [c * len(stage_costs) / sum(stage_costs) for c in stage_costs]
    last = p * v - 1
    done: dict = {}
    clock = [0.0] * p
    position = [0] * p
    spans = []
    remaining = sum(len(a) for a in schedule.actions)
    while remaining:
        progressed = False
        for rank in range(p):
            if position[rank] == len(schedule.actions[rank]):
                continue
            action = schedule.actions[rank][position[rank]]
            stage = schedule.virtual_stage(rank, action.chunk)
            if action.kind == "F":
                needs = ("F", action.microbatch, stage - 1) if stage > 0 else None
            else:
                needs = ("B", action.microbatch, stage + 1) if stage < last else ("F", action.microbatch, stage)
            if needs is not None and needs not in done:
                continue
            start = max(clock[rank], done.get(needs, 0.0))
            end = start + (durations[(rank, action)] if durations is not None
                           else (forward_s if action.kind == "F" else backward_s) / v * scale[stage])
            done[(action.kind, action.microbatch, stage)] = end
            clock[rank] = end
            spans.append((rank, action, start, end))
            position[rank] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise InvalidValue("schedule", schedule.name, "an order without deadlock", reason="no rank can proceed")
    return Timeline.of(schedule, spans)


def idle_fraction(intervals: list, ranks: int) -> float:
    """The bubble of a timeline: 1 − busy / (ranks · (last end − first start)), over every rank's busy
    (start, end) intervals — simulated here, or executed (`pipeline.executed_timeline`)."""
    first, last = min(start for start, _ in intervals), max(end for _, end in intervals)
    return 1 - sum(end - start for start, end in intervals) / (ranks * (last - first))


def peak_held(actions, chunk_weights=None):
    """The most a rank holds at once over its `actions`: each forward holds its chunk's weight (`chunk_weights[c]`,
    e.g. the bytes its chunk saves for backward; 1 each by default: microbatch-chunks in flight) until its backward."""
    held = peak = 0
    for action in actions:
        weight = 1 if chunk_weights is None else chunk_weights[action.chunk]
        held += weight if action.kind == "F" else -weight
        peak = max(peak, held)
    return peak


def chrome_trace(result: Timeline, unit_s: float = 1e-3) -> str:
    """Chrome / Perfetto trace JSON: one row per rank, one slice per action."""
    events = [{"name": f"{a.kind}{a.microbatch}" + (f".{a.chunk}" if a.chunk else ""), "ph": "X", "pid": 0, "tid": rank,
               "ts": start / unit_s * 1e3, "dur": (end - start) / unit_s * 1e3} for rank, a, start, end in result.spans]
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})


def render_png(schedule: Schedule, result: Timeline, path: str, time_label: str = "time") -> None:
    """GPU x time chart: forwards blue, backwards green, the bubble white."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    actions_per_rank = len(result.spans) / schedule.stages
    figure, axis = plt.subplots(figsize=(min(24, max(6, 0.6 * actions_per_rank)), 0.5 * schedule.stages + 1))
    for rank, action, start, end in result.spans:
        axis.barh(rank, end - start, left=start, color="tab:blue" if action.kind == "F" else "tab:green", edgecolor="black")
        axis.text((start + end) / 2, rank, str(action.microbatch), ha="center", va="center", fontsize=7, color="white")
    axis.set_yticks(range(schedule.stages), [f"stage {r}" for r in range(schedule.stages)])
    axis.invert_yaxis()
    axis.set_xlabel(time_label)
    axis.set_title(f"{schedule.name}: p={schedule.stages}, m={schedule.microbatches}"
                   + (f", v={schedule.chunks}" if schedule.chunks > 1 else "")
                   + f" — bubble {result.bubble:.1%} (analytic {schedule.analytic_bubble:.1%})")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
