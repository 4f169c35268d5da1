"""The full-stack audit of a training job: one pass over every wall, and which one binds.

Compute and communication come from predict.training (the layout given, or the planner's best),
memory from predict.memory, data as the token stream the job consumes (pre-tokenised shards), reliability from predict.fleet, energy, carbon, water and cost from
predict.operations over the time the job needs for its tokens (stretched by the goodput lost to
checkpoints and failures). The binding constraint is the largest share of the step's time — or
memory, when the job does not fit at all. A serving deployment (audit_serving) is bound by its queue
past 80% utilisation, by memory capacity past 90% use, else by what its decode step waits on.
"""

from dataclasses import dataclass

import numpy as np

from mlsyslab.predict.architecture import parameters
from mlsyslab.predict.assumptions import DEFAULT, Assumptions
from mlsyslab.predict.fleet import predict_fleet
from mlsyslab.predict.hardware import Hardware
from mlsyslab.predict.layout import Layout
from mlsyslab.predict.operations import OperationsAssumptions, cost_per_million_tokens, predict_operations
from mlsyslab.predict.planner import plan
from mlsyslab.predict.training import predict_training
from mlsyslab.specs.schema import Accelerator, Grid, Model, System

COMMUNICATION = ("tensor_parallel", "expert_parallel", "context_parallel", "pipeline_p2p", "data_parallel")


@dataclass(frozen=True)
class Audit:
    sections: dict  # wall -> {quantity: value}
    binding: str  # the wall that binds
    layout: dict
    step_breakdown_s: dict
    memory_bytes: dict


def audit_training(model: Model, system: System, chip: Accelerator, grid: Grid, gpus: int, global_batch: int, seq: int,
                   tokens: float, layout: Layout | None = None, storage_write_bw: float = 100e9,
                   assumptions: Assumptions = DEFAULT, operations: OperationsAssumptions = OperationsAssumptions(),
                   dtype: str = "bf16", bytes_per_token: float = 4.0) -> Audit:
    hardware = Hardware.of(system, chip, dtype)
    if layout is None:
        found = plan(model, hardware, gpus, global_batch, seq, assumptions)
        if len(found.ranked) == 0:
            return _infeasible(found.infeasible)
        layout = found.layouts.take(found.ranked[:1])
    prediction = predict_training(model, hardware, layout, assumptions=assumptions)
    memory = prediction.memory.breakdown(0)
    if not bool(prediction.feasible.reshape(-1)[0]):
        return _infeasible({prediction.reason(0): 1}, memory)
    step = float(prediction.step_s.reshape(-1)[0])
    breakdown = {k: float(np.asarray(v).reshape(-1)[0]) for k, v in prediction.time_s.items()}
    fleet = predict_fleet(gpus, parameters(model).total(), storage_write_bw, system.accelerators_per_node)
    tokens_per_s = float(prediction.tokens_per_s.reshape(-1)[0])
    if float(fleet.goodput) == 0:  # checkpoints or failures take all the time: the job never finishes
        reason = (f"reliability: goodput 0 (a checkpoint takes {float(fleet.checkpoint_s):.0f} s, the interval "
                  f"{float(fleet.interval_s):.0f} s, the cluster's MTBF {float(fleet.mtbf_s):.0f} s)")
        return _infeasible({reason: 1}, memory, "reliability (no progress)")
    wall_s = tokens / tokens_per_s / float(fleet.goodput)
    ops = predict_operations(gpus, chip.tdp_w, system.power_overhead_w, system.accelerators_per_node, wall_s,
                             grid.grid_gco2_per_kwh, grid.pue, grid.water_l_per_kwh, chip.price_usd or 0.0, operations)
    communication = sum(breakdown[k] for k in COMMUNICATION)
    shares = {"compute": breakdown["compute"] / step, "communication": communication / step,
              "pipeline bubble": breakdown["pipeline_bubble"] / step, "optimizer": breakdown["optimizer"] / step,
              "reliability": 1 - float(fleet.goodput)}
    sections = {
        "compute": {"step_s": step, "mfu": float(prediction.mfu.reshape(-1)[0]), "hfu": float(prediction.hfu.reshape(-1)[0]),
                    "share_of_step": shares["compute"], "tokens_per_s": tokens_per_s},
        "memory": {"total_bytes": memory["total"], "capacity_bytes": memory["capacity"],
                   "headroom_fraction": 1 - memory["total"] / memory["capacity"]},
        "communication": {"share_of_step": shares["communication"],
                          **{f"{k}_s": breakdown[k] for k in COMMUNICATION if breakdown[k] > 0},
                          "pipeline_bubble_fraction": float(prediction.bubble_fraction.reshape(-1)[0])},
        "data": {"tokens_per_s_needed": tokens_per_s, "storage_read_bytes_per_s": tokens_per_s * bytes_per_token,
                 "note": f"pre-tokenised shards at {bytes_per_token:g} bytes per token"},
        "reliability": {"mtbf_h": float(fleet.mtbf_s) / 3600, "checkpoint_s": float(fleet.checkpoint_s),
                        "checkpoint_interval_s": float(fleet.interval_s), "goodput": float(fleet.goodput)},
        "energy": {"facility_power_w": float(ops.facility_power_w), "energy_mwh": float(ops.energy_kwh) / 1000,
                   "wall_clock_days": wall_s / 86400},
        "carbon": {"region": grid.name, "operational_t": float(ops.operational_co2_kg) / 1000,
                   "embodied_t": float(ops.embodied_co2_kg) / 1000, "water_m3": float(ops.water_l) / 1000},
        "cost": {"total_usd": float(ops.cost_usd), "per_gpu_hour_usd": float(ops.cost_per_accelerator_hour_usd),
                 "per_million_tokens_usd": float(cost_per_million_tokens(ops.cost_usd / (wall_s / 3600), tokens_per_s))},
    }
    binding = max(shares, key=shares.get)
    return Audit(sections, binding, layout.row(0), breakdown, memory)


def _infeasible(reasons: dict, memory: dict | None = None, binding: str = "memory (nothing fits)") -> Audit:
    return Audit({"feasibility": {"feasible": False, "reasons": reasons}}, binding, {}, {}, memory or {})


def audit_serving(model: Model, system: System, chip: Accelerator, grid: Grid, tp: int, batch: int, prompt_tokens: int,
                  output_tokens: int, request_rate: float, replicas: int = 1, assumptions: Assumptions = DEFAULT,
                  operations: OperationsAssumptions = OperationsAssumptions(), dtype: str = "bf16") -> Audit:
    """One deployment: `replicas` copies of the model on `tp` accelerators each, `batch` sequences per replica."""
    from mlsyslab.predict.inference import predict_inference
    from mlsyslab.predict.serving import p99_latency_s

    hardware = Hardware.of(system, chip, dtype)
    r = predict_inference(model, hardware, batch, prompt_tokens, output_tokens, tp, assumptions=assumptions)
    if not bool(np.all(r.feasible)):
        return _infeasible({r.reason(0): 1})
    free_links = predict_inference(model, hardware.scaled(scale_up_bw=1e6, scale_out_bw=1e6), batch, prompt_tokens,
                                   output_tokens, tp, assumptions=assumptions)
    itl, ttft = float(r.itl_s), float(r.ttft_s)
    communication = 1 - float(free_links.itl_s) / itl
    service_s = ttft + output_tokens * itl  # one request, start to finish, in a full batch
    servers = replicas * batch
    gpus = replicas * tp
    tokens_per_s = replicas * float(r.tokens_per_s)
    hour = predict_operations(gpus, chip.tdp_w, system.power_overhead_w, system.accelerators_per_node, 3600.0,
                              grid.grid_gco2_per_kwh, grid.pue, grid.water_l_per_kwh, chip.price_usd or 0.0, operations)
    load = request_rate * service_s / servers
    memory_use = (r.weight_bytes_per_gpu + float(r.kv_bytes_per_gpu)) / (
        hardware.hbm_bytes * assumptions.memory_usable_fraction - assumptions.memory_reserved_bytes)
    sections = {
        "compute": {"ttft_s": ttft, "prefill_bound": "compute" if bool(r.prefill_compute_bound) else "memory",
                    "itl_s": itl, "decode_bound": "compute" if bool(r.decode_compute_bound) else "memory",
                    "tokens_per_s": tokens_per_s},
        "memory": {"weight_bytes_per_gpu": r.weight_bytes_per_gpu, "kv_bytes_per_gpu": float(r.kv_bytes_per_gpu),
                   "used_fraction": memory_use, "max_concurrency_per_replica": float(r.max_concurrency)},
        "communication": {"share_of_decode_step": communication},
        "queueing": {"utilisation": load, "p99_latency_s": float(p99_latency_s(request_rate, service_s, servers))},
        "energy": {"facility_power_w": float(hour.facility_power_w)},
        "carbon": {"region": grid.name, "operational_kg_per_hour": float(hour.operational_co2_kg)},
        "cost": {"per_hour_usd": float(hour.cost_usd),
                 "per_million_tokens_usd": float(cost_per_million_tokens(hour.cost_usd, tokens_per_s))},
    }
    # The queue binds once the servers are 80% busy (Erlang C's wait climbs steeply past it), memory
    # capacity once the KV cache and weights fill 90% of it; otherwise the larger part of a decode step.
    if load >= 0.8:
        binding = "queueing"
    elif memory_use >= 0.9:
        binding = "memory capacity"
    elif communication > 0.5:
        binding = "communication"
    else:
        binding = "compute" if bool(r.decode_compute_bound) else "memory bandwidth"
    request = {"prefill (TTFT)": ttft, "decode": output_tokens * itl,
               "p99 queue wait": max(0.0, sections["queueing"]["p99_latency_s"] - service_s)}
    return Audit(sections, binding, {"tp": tp, "replicas": replicas, "batch": batch}, request, {})
