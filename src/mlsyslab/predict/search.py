"""Design-space search: declare axes, constraints and objectives; evaluate every point by broadcasting.

A space is {axis: [values]}; its points are the cartesian product, built as flat index columns
(no Python loop per point). An evaluator maps the columns to metric arrays plus `feasible` and
`reason`; it may loop over the few values of categorical axes (a model, a chip) but broadcasts the
numeric ones. Points that cannot happen are filtered with their reasons, then the constraints
("itl_s<=0.05"); the rest are ranked by the first objective and their Pareto frontier over all
objectives is marked. Nothing infeasible is ever ranked. Results do not depend on the order of the
axes (tested). `serving_evaluator` searches inference deployments with predict.inference.
"""

import operator
import re
from dataclasses import dataclass

import numpy as np

from mlsyslab.errors import InvalidValue
from mlsyslab.predict.assumptions import DEFAULT
from mlsyslab.predict.hardware import Hardware
from mlsyslab.predict.inference import REASONS, predict_inference
from mlsyslab.predict.operations import OperationsAssumptions, cost_per_million_tokens, predict_operations
from mlsyslab.specs import catalog

OPERATORS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}


@dataclass(frozen=True)
class Constraint:
    metric: str
    op: str
    value: float

    @classmethod
    def parse(cls, text: str) -> "Constraint":
        match = re.fullmatch(r"\s*([A-Za-z_][\w]*)\s*(<=|>=|<|>)\s*([-+0-9.eE]+)\s*", text)
        if not match:
            raise InvalidValue("constraint", text, "METRIC<=VALUE (or >=, <, >), e.g. itl_s<=0.05")
        return cls(match.group(1), match.group(2), float(match.group(3)))

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.value:g}"


@dataclass(frozen=True)
class Objective:
    metric: str
    maximize: bool

    @classmethod
    def parse(cls, text: str) -> "Objective":
        name, _, direction = text.partition(":")
        if direction not in ("max", "min"):
            raise InvalidValue("objective", text, "METRIC:max or METRIC:min, e.g. tokens_per_s:max")
        return cls(name, direction == "max")


@dataclass(frozen=True)
class SearchResult:
    points: dict  # axis and metric -> array over every point
    ranked: np.ndarray  # indices of points that are feasible and meet the constraints, best first
    pareto: np.ndarray  # indices on the Pareto frontier of the objectives (a subset of ranked)
    rejected: dict  # reason -> count (infeasible or violating a constraint)
    categories: dict  # categorical axis -> its values (points hold their indices)

    @property
    def evaluated(self) -> int:
        return int(next(iter(self.points.values())).size)

    def row(self, i: int) -> dict:
        out = {k: v[i].item() if hasattr(v[i], "item") else v[i] for k, v in self.points.items()}
        for name, values in self.categories.items():
            out[name] = values[int(out[name])]
        return out


def grid(axes: dict) -> dict:
    """{axis: flat array over the cartesian product}: numeric axes hold values, categorical (string)
    axes hold the index of their value in `axes[name]` (integers group fast)."""
    if not axes:
        raise InvalidValue("axes", axes, "at least one axis with values")
    for name, values in axes.items():
        if len(values) == 0:
            raise InvalidValue(f"axis {name}", values, "at least one value")
    index = np.meshgrid(*(np.arange(len(v)) for v in axes.values()), indexing="ij")
    return {name: i.reshape(-1) if _categorical(values) else np.asarray(values, dtype=float)[i.reshape(-1)]
            for (name, values), i in zip(axes.items(), index)}


def _categorical(values) -> bool:
    return isinstance(values[0], str)


def search(axes: dict, evaluate, constraints=(), objectives=()) -> SearchResult:
    columns = grid(axes)
    categories = {name: list(values) for name, values in axes.items() if _categorical(values)}
    metrics = evaluate(columns, categories)
    points = {**columns, **metrics}
    numeric = sorted(name for name in points if name not in categories and name not in ("reason", "feasible"))
    for item in [*constraints, *objectives]:
        if item.metric not in numeric:
            raise InvalidValue("metric", item.metric, ", ".join(numeric))
    reason = np.asarray(metrics["reason"], dtype=object)
    ok = np.asarray(metrics["feasible"], dtype=bool)
    for constraint in constraints:
        meets = OPERATORS[constraint.op](np.asarray(points[constraint.metric], dtype=float), constraint.value)
        reason = np.where(ok & ~meets, f"violates {constraint}", reason)
        ok &= meets
    rejected = {str(r): int(n) for r, n in zip(*np.unique(reason[~ok], return_counts=True))}
    candidates = np.flatnonzero(ok)
    if objectives:
        keys = [_score(points, o)[candidates] for o in reversed(objectives)]
        order = np.lexsort(keys)  # by the first objective, ties by the next
        ranked = candidates[order]
        pareto = _pareto(np.stack([_score(points, o)[ranked] for o in objectives], axis=1))
        pareto = ranked[pareto]
    else:
        ranked, pareto = candidates, candidates
    return SearchResult(points, ranked, pareto, rejected, categories)


def _score(points: dict, objective: Objective) -> np.ndarray:
    """Lower is better."""
    values = np.asarray(points[objective.metric], dtype=float)
    return -values if objective.maximize else values


def _pareto(scores: np.ndarray) -> np.ndarray:
    """Positions (in `scores`' order, which is sorted by the first column) not dominated by any other."""
    if scores.shape[1] == 1:
        return np.flatnonzero(scores[:, 0] == scores[0, 0]) if len(scores) else np.zeros(0, dtype=int)
    if scores.shape[1] == 2:  # sorted by the first: on the front iff strictly better in the second than all before
        best_before = np.concatenate([[np.inf], np.minimum.accumulate(scores[:-1, 1])])
        return np.flatnonzero(scores[:, 1] < best_before)
    front: list = []
    for i in range(len(scores)):
        if front:
            kept = scores[front]
            if np.any(np.all(kept <= scores[i], axis=1) & np.any(kept < scores[i], axis=1)):
                continue
        front.append(i)
    return np.asarray(front, dtype=int)


def serving_evaluator(prompt_tokens_default: int = 1024, output_tokens_default: int = 256, assumptions=DEFAULT,
                      operations: OperationsAssumptions = OperationsAssumptions()):
    """Evaluate inference deployments. Axes: model, hardware, weight_dtype (categorical); tp, batch,
    prompt_tokens, output_tokens (numeric). Metrics: ttft_s, itl_s, tokens_per_s (one replica),
    tokens_per_s_per_gpu, gpus, max_concurrency, cost_per_million_tokens."""

    def evaluate(columns: dict, categories: dict) -> dict:
        size = next(iter(columns.values())).size
        if "model" not in categories or "hardware" not in categories:
            raise InvalidValue("axes", sorted(columns), "categorical axes 'model' and 'hardware' (and any of tp, "
                               "batch, prompt_tokens, output_tokens, weight_dtype)")
        names = [categories["model"], categories["hardware"], categories.get("weight_dtype", [""])]
        codes = [columns["model"], columns["hardware"], columns.get("weight_dtype", np.zeros(size, dtype=int))]
        numeric = {k: columns.get(k, np.full(size, default, dtype=float)) for k, default in
                   (("tp", 1.0), ("batch", 1.0), ("prompt_tokens", prompt_tokens_default),
                    ("output_tokens", output_tokens_default))}
        out = {name: np.full(size, np.nan) for name in ("ttft_s", "itl_s", "tokens_per_s", "tokens_per_s_per_gpu",
                                                         "gpus", "max_concurrency", "cost_per_million_tokens")}
        out["feasible"] = np.zeros(size, dtype=bool)
        reason_code = np.zeros(size, dtype=np.int8)
        group = np.ravel_multi_index(codes, [len(n) for n in names])
        order = np.argsort(group, kind="stable")
        starts = np.flatnonzero(np.diff(group[order], prepend=-1))
        for rows in np.split(order, starts[1:]):
            model_index, hardware_index, dtype_index = np.unravel_index(group[rows[0]], [len(n) for n in names])
            model = catalog.model(names[0][model_index])
            system, chip = catalog.hardware(names[1][hardware_index])
            dtype = names[2][dtype_index] or None
            hardware = Hardware.of(system, chip, "bf16" if "bf16" in chip.peak_flops else next(iter(chip.peak_flops)))
            tp = numeric["tp"][rows]
            r = predict_inference(model, hardware, numeric["batch"][rows], numeric["prompt_tokens"][rows],
                                  numeric["output_tokens"][rows], tp, weight_dtype=dtype, assumptions=assumptions)
            hour = predict_operations(tp, chip.tdp_w, system.power_overhead_w / system.accelerators_per_node, 1, 3600.0,
                                      0.0, 1.2, 0.0, chip.price_usd or 0.0, operations)
            values = {"ttft_s": r.ttft_s, "itl_s": r.itl_s, "tokens_per_s": r.tokens_per_s,
                      "tokens_per_s_per_gpu": r.tokens_per_s / tp, "gpus": tp, "max_concurrency": r.max_concurrency,
                      "cost_per_million_tokens": cost_per_million_tokens(hour.cost_usd, r.tokens_per_s),
                      "feasible": r.feasible}
            for name, value in values.items():
                out[name][rows] = np.broadcast_to(value, rows.shape)
            reason_code[rows] = np.broadcast_to(r.reason_code, rows.shape)
        out["reason"] = np.asarray(REASONS, dtype=object)[reason_code]
        return out

    return evaluate
