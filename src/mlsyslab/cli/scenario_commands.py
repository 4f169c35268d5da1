"""`mlsys predict fleet|ops|kv-paging|speculative|reasoning`, `mlsys sensitivity`, `mlsys search`."""

import math
from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer

from mlsyslab.cli.options import (MAX_ACCELERATORS, MAX_COUNT, Dtype, HardwareName, HardwareSpec, Json, ModelName,
                                  ModelSpec, check_greater_than_zero, check_model_shape, check_output_file, check_positive,
                                  check_range, resolve)
from mlsyslab.cli.render import console, emit_json, human, seconds, table
from mlsyslab.errors import InvalidValue
from mlsyslab.predict.architecture import parameters
from mlsyslab.specs.schema import DTYPE_BYTES

Floats = Annotated[float, typer.Option]


def fleet_command(
    gpus: Annotated[int, typer.Option("--gpus", "-n", help="accelerators in the job")] = 1024,
    params: Annotated[float, typer.Option("--params", help="model parameters (or use --model)")] = 0.0,
    model: ModelName = None, model_spec: ModelSpec = None,
    storage_gbps: Annotated[float, typer.Option("--storage-gbps", help="checkpoint write bandwidth, GB/s (aggregate)")] = 100.0,
    gpu_mttf_h: Annotated[float, typer.Option("--gpu-mttf-h", help="mean time to failure of one GPU, hours")] = 50_000.0,
    restart_s: Annotated[float, typer.Option("--restart-s", help="time to detect, reschedule and reload after a failure")] = 600.0,
    interval_s: Annotated[Optional[float], typer.Option("--interval-s", help="checkpoint interval (default: Young-Daly)")] = None,
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node")] = 8,
    json: Json = False,
):
    """Cluster MTBF, checkpoint size and time, the Young–Daly interval and goodput."""
    from mlsyslab.cli.options import resolve_model
    from mlsyslab.predict.fleet import FailureRates, predict_fleet

    check_positive(MAX_ACCELERATORS, gpus=gpus, gpus_per_node=gpus_per_node)
    check_greater_than_zero(storage_gbps=storage_gbps, gpu_mttf_h=gpu_mttf_h)
    check_range("--restart-s", restart_s, 0)
    check_greater_than_zero(interval_s=interval_s)
    if (model or model_spec) and params:
        raise InvalidValue("--params", params, "omitted with --model or --model-spec (the model gives the count)")
    if model or model_spec:
        params = parameters(resolve_model(model, model_spec)).total()
    if not (math.isfinite(params) and params > 0):  # NaN too
        raise InvalidValue("--params", params, "a finite number > 0, or --model NAME")
    f = predict_fleet(gpus, params, storage_gbps * 1e9, gpus_per_node, restart_s, interval_s, FailureRates(gpu_mttf_h=gpu_mttf_h))
    report = {"gpus": gpus, "parameters": params, "mtbf_h": float(f.mtbf_s) / 3600, "failures_per_day": float(f.failures_per_day),
              "checkpoint_bytes": float(f.checkpoint_bytes), "checkpoint_s": float(f.checkpoint_s),
              "young_daly_interval_s": float(f.optimal_interval_s), "interval_s": float(f.interval_s),
              "goodput": float(f.goodput), "lost_per_failure_s": float(f.lost_per_failure_s),
              "checkpoint_overhead_fraction": float(f.checkpoint_s / f.interval_s),
              "failure_loss_fraction": float(f.lost_per_failure_s / f.mtbf_s)}
    if json:
        return emit_json(report)
    console.print(table(f"{gpus} GPUs, {human(params, '')} parameters", [
        ("cluster MTBF", f"{report['mtbf_h']:.1f} h ({report['failures_per_day']:.2f} failures/day)"),
        ("checkpoint", f"{human(report['checkpoint_bytes'], 'B')} in {seconds(report['checkpoint_s'])}"),
        ("Young–Daly interval", seconds(report["young_daly_interval_s"])),
        ("time lost to checkpoints", f"{report['checkpoint_overhead_fraction']:.2%}"),
        ("time lost to failures", f"{report['failure_loss_fraction']:.2%}"), ("goodput", f"{report['goodput']:.2%}")]))
    if report["checkpoint_overhead_fraction"] >= 1 or report["failure_loss_fraction"] >= 1:
        console.print("no progress: " + ("a checkpoint takes longer than the interval between them"
                                         if report["checkpoint_overhead_fraction"] >= 1 else
                                         "failures come faster than the job gets back to where it was")
                      + " (Young–Daly's first-order interval assumes a checkpoint far shorter than the MTBF)")


def ops_command(
    gpus: Annotated[int, typer.Option("--gpus", "-n")] = 256, hardware: HardwareName = "h100",
    days: Annotated[float, typer.Option(help="how long the job runs")] = 30.0,
    region: Annotated[str, typer.Option(help="grid region (see --list-regions)")] = "United States",
    utilisation: Annotated[float, typer.Option(help="average busy fraction of the accelerators")] = 0.8,
    tokens_per_s: Annotated[Optional[float], typer.Option("--tokens-per-s", help="throughput, for $ per million tokens")] = None,
    list_regions: Annotated[bool, typer.Option("--list-regions")] = False,
    json: Json = False,
):
    """Power, energy, operational and embodied carbon, water and cost of a cluster over a period."""
    from dataclasses import replace

    from mlsyslab.predict.operations import OperationsAssumptions, cost_per_million_tokens, predict_operations
    from mlsyslab.specs import catalog

    if list_regions:
        rows = [(g.name, f"{g.grid_gco2_per_kwh:g}", f"{g.pue:g}", f"{g.water_l_per_kwh:g}", g.source) for g in catalog.grids()]
        if json:
            return emit_json({"regions": [g.model_dump() for g in catalog.grids()]})
        return console.print(table("grids", rows, ("region", "gCO2/kWh", "PUE", "water L/kWh", "source")))
    check_positive(MAX_ACCELERATORS, gpus=gpus)
    check_greater_than_zero(days=days, tokens_per_s=tokens_per_s)
    check_range("--utilisation", utilisation, 0, 1)
    system, chip = catalog.hardware(hardware)
    grid = catalog.grid(region)
    assumptions = replace(OperationsAssumptions(), utilisation=utilisation)
    o = predict_operations(gpus, chip.tdp_w, system.power_overhead_w, system.accelerators_per_node, days * 86400,
                           grid.grid_gco2_per_kwh, grid.pue, grid.water_l_per_kwh, chip.price_usd or 0.0, assumptions)
    report = {"gpus": gpus, "hardware": system.name, "region": grid.name, "days": days,
              "it_power_w": float(o.it_power_w), "facility_power_w": float(o.facility_power_w),
              "energy_kwh": float(o.energy_kwh), "operational_co2_t": float(o.operational_co2_kg) / 1000,
              "embodied_co2_t": float(o.embodied_co2_kg) / 1000, "water_m3": float(o.water_l) / 1000,
              "cost_usd": float(o.cost_usd), "cost_per_gpu_hour_usd": float(o.cost_per_accelerator_hour_usd),
              "grid_gco2_per_kwh": grid.grid_gco2_per_kwh, "pue": grid.pue, "assumptions": assumptions.__dict__}
    if tokens_per_s:
        report["cost_per_million_tokens_usd"] = float(cost_per_million_tokens(o.cost_usd / (days * 24), tokens_per_s))
    if json:
        return emit_json(report)
    console.print(table(f"{gpus} x {system.name} for {days:g} days in {grid.name}", [
        ("power (IT / facility)", f"{human(report['it_power_w'], 'W')} / {human(report['facility_power_w'], 'W')}"),
        ("energy", f"{report['energy_kwh'] / 1000:,.1f} MWh"),
        ("carbon: operational / embodied", f"{report['operational_co2_t']:,.1f} t / {report['embodied_co2_t']:,.1f} t CO2e"),
        ("water", f"{report['water_m3']:,.0f} m³"), ("cost", f"${report['cost_usd']:,.0f} (${report['cost_per_gpu_hour_usd']:.2f}/GPU-hour)")]
        + ([("cost per million tokens", f"${report['cost_per_million_tokens_usd']:.3f}")] if tokens_per_s else [])))


def kv_paging_command(
    model: ModelName = None, hardware: HardwareName = None, model_spec: ModelSpec = None, hardware_spec: HardwareSpec = None,
    max_length: Annotated[int, typer.Option("--max-length", help="the longest request (static batching reserves it)")] = 2048,
    mean_length: Annotated[Optional[float], typer.Option("--mean-length", help="mean request length (uniform 1..max if unset)")] = None,
    block_tokens: Annotated[int, typer.Option("--block-tokens", help="tokens per KV block")] = 16,
    tp: Annotated[int, typer.Option("--tp")] = 1, dtype: Dtype = "bf16", json: Json = False,
):
    """Sequences that fit and memory wasted: static (reserve the maximum) vs paged KV allocation."""
    from mlsyslab.predict.architecture import kv_bytes_per_token
    from mlsyslab.predict.serving import kv_allocation

    spec, hw, assumptions = resolve(model, model_spec, hardware, hardware_spec, dtype, None)
    check_positive(max_length=max_length, block_tokens=block_tokens, tp=tp)
    check_model_shape(spec, tp, max_length, "--max-length")
    rng = np.random.default_rng(0)
    if mean_length is None:
        lengths = rng.integers(1, max_length + 1, 100_000)
    else:
        if not 1 <= mean_length <= max_length:
            raise InvalidValue("--mean-length", mean_length, f"1..{max_length}")
        lengths = np.clip(rng.exponential(mean_length, 100_000), 1, max_length)
    budget = hw.hbm_bytes * assumptions.memory_usable_fraction - assumptions.memory_reserved_bytes
    budget -= parameters(spec).total() * 2 / tp
    if budget <= 0:
        raise InvalidValue("--model", spec.name, f"a model whose weights fit on {hw.name} with TP={tp}")
    a = kv_allocation(lengths, max_length, block_tokens, kv_bytes_per_token(spec, dtype) / tp, budget)
    report = {"model": spec.name, "hardware": hw.name, "kv_budget_bytes": budget, "static_capacity": int(a.static_capacity),
              "paged_capacity": int(a.paged_capacity), "static_fragmentation": float(a.static_fragmentation),
              "paged_fragmentation": float(a.paged_fragmentation), "mean_length": float(lengths.mean())}
    if json:
        return emit_json(report)
    console.print(table(f"{spec.name} on {hw.name}: KV for requests of mean {report['mean_length']:.0f} tokens (max {max_length})", [
        ("static batching", report["static_capacity"], f"{report['static_fragmentation']:.1%} wasted"),
        (f"paged ({block_tokens}-token blocks)", report["paged_capacity"], f"{report['paged_fragmentation']:.1%} wasted")],
        ("allocation", "sequences that fit", "reserved but unused")))


def speculative_command(
    acceptance: Annotated[float, typer.Option(help="probability the target accepts a draft token")] = 0.75,
    draft_tokens: Annotated[int, typer.Option("--draft-tokens", help="tokens the draft proposes per step")] = 4,
    draft_cost: Annotated[float, typer.Option("--draft-cost", help="a draft step's cost relative to the target's")] = 0.05,
    json: Json = False,
):
    """Expected speedup of speculative decoding (Leviathan et al. 2023)."""
    from mlsyslab.predict.serving import speculative_speedup

    check_range("--acceptance", acceptance, 0, 1)
    check_positive(draft_tokens=draft_tokens)
    check_range("--draft-cost", draft_cost, 0)
    speedup = float(speculative_speedup(acceptance, draft_tokens, draft_cost))
    tokens = float(speculative_speedup(acceptance, draft_tokens, 0.0))
    report = {"acceptance": acceptance, "draft_tokens": draft_tokens, "draft_cost": draft_cost,
              "tokens_per_verify_step": tokens, "speedup": speedup}
    if json:
        return emit_json(report)
    console.print(f"{tokens:.2f} tokens per verification step; speedup {speedup:.2f}x")


def reasoning_command(
    model: ModelName = None, hardware: HardwareName = None, model_spec: ModelSpec = None, hardware_spec: HardwareSpec = None,
    steps: Annotated[int, typer.Option(help="reasoning steps: the generation is this many times longer")] = 8,
    tp: Annotated[int, typer.Option("--tp")] = 1, batch: Annotated[int, typer.Option("--batch")] = 32,
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens")] = 1024,
    output_tokens: Annotated[int, typer.Option("--output-tokens", help="tokens of one step's answer")] = 256,
    baseline_usd_per_year: Annotated[Optional[float], typer.Option("--baseline-usd-per-year")] = None,
    dtype: Dtype = "bf16", json: Json = False,
):
    """How much K reasoning steps multiply the cost of serving a request."""
    from mlsyslab.predict.inference import predict_inference
    from mlsyslab.predict.serving import reasoning_cost_multiplier

    spec, hw, assumptions = resolve(model, model_spec, hardware, hardware_spec, dtype, None)
    check_positive(steps=steps, tp=tp, batch=batch, prompt_tokens=prompt_tokens, output_tokens=output_tokens)
    check_model_shape(spec, tp, prompt_tokens + output_tokens * steps, "--prompt-tokens + --output-tokens × --steps")
    check_range("--baseline-usd-per-year", baseline_usd_per_year, 0)
    long = predict_inference(spec, hw, batch, prompt_tokens, output_tokens * steps, tp, assumptions=assumptions)
    short = predict_inference(spec, hw, batch, prompt_tokens, output_tokens, tp, assumptions=assumptions)
    _require_fit(spec, hw, tp, short, long)
    # GPU-seconds per batch of requests: one prefill, then each generated token costs one decode step.
    short_s = float(short.ttft_s + output_tokens * short.itl_s)
    long_s = float(long.ttft_s + steps * output_tokens * long.itl_s)
    multiplier = long_s / short_s
    report = {"model": spec.name, "hardware": hw.name, "steps": steps, "request_s_one_step": short_s,
              "request_s_k_steps": long_s, "cost_multiplier": multiplier,
              "decode_only_bound": float(reasoning_cost_multiplier(0.0, 1.0, steps))}
    if baseline_usd_per_year is not None:
        report["usd_per_year"] = baseline_usd_per_year * multiplier
    if json:
        return emit_json(report)
    console.print(f"{steps} reasoning steps cost {multiplier:.2f}x one step ({seconds(short_s)} → {seconds(long_s)} per batch)"
                  + (f": ${baseline_usd_per_year:,.0f} → ${report['usd_per_year']:,.0f} per year" if baseline_usd_per_year else ""))


def sensitivity_command(
    model: ModelName = None, hardware: HardwareName = None, model_spec: ModelSpec = None, hardware_spec: HardwareSpec = None,
    batch: Annotated[int, typer.Option("--batch")] = 1, prompt_tokens: Annotated[int, typer.Option("--prompt-tokens")] = 2048,
    output_tokens: Annotated[int, typer.Option("--output-tokens")] = 256, tp: Annotated[int, typer.Option("--tp")] = 1,
    objective: Annotated[str, typer.Option(help="itl_s or ttft_s")] = "itl_s",
    slo_s: Annotated[Optional[float], typer.Option("--slo-s", help="also the least of each resource meeting this SLO")] = None,
    dtype: Dtype = "bf16", json: Json = False,
):
    """Elasticities d log T / d log x of a serving prediction, ranked; an error if the scenario does not fit."""
    from mlsyslab.predict.sensitivity import HARDWARE_INPUTS, inference_elasticities, inverse_roofline

    spec, hw, assumptions = resolve(model, model_spec, hardware, hardware_spec, dtype, None)
    check_positive(batch=batch, prompt_tokens=prompt_tokens, output_tokens=output_tokens, tp=tp)
    check_model_shape(spec, tp, prompt_tokens + output_tokens)
    elasticity = inference_elasticities(spec, hw, batch, prompt_tokens, output_tokens, tp, objective, assumptions=assumptions)
    report = {"model": spec.name, "hardware": hw.name, "objective": objective, "elasticities": elasticity}
    if slo_s is not None:
        report["inverse_roofline"] = {r: inverse_roofline(spec, hw, r, slo_s, batch, prompt_tokens, output_tokens, tp,
                                                          objective, assumptions=assumptions)
                                      for r in HARDWARE_INPUTS if r in ("hbm_bw", "peak_flops")}
    if json:
        return emit_json(report)
    console.print(table(f"d log {objective} / d log x for {spec.name} on {hw.name}",
                        [(k, f"{v:+.3f}") for k, v in elasticity.items()], ("input", "elasticity")))
    for resource, answer in report.get("inverse_roofline", {}).items():
        if not answer["feasible"]:
            console.print(f"{resource}: {answer['reason']}")
        elif not answer["binding"]:
            console.print(f"{resource}: not binding (1/1000 of today's already meets the SLO)")
        else:
            unit = "B/s" if resource == "hbm_bw" else "FLOP/s"
            console.print(f"{resource}: at least {human(answer['minimum'], unit)} ({answer['ratio_to_current']:.2f}x today's)")


def search_command(
    model: Annotated[list[str], typer.Option("--model", "-m", help="models to try (repeatable)")],
    hardware: Annotated[list[str], typer.Option("--hardware", "-H", help="hardware to try (repeatable)")],
    tp: Annotated[str, typer.Option(help="comma-separated TP sizes")] = "1,2,4,8",
    batch: Annotated[str, typer.Option(help="comma-separated batch sizes")] = "1,2,4,8,16,32,64,128,256",
    prompt_tokens: Annotated[str, typer.Option("--prompt-tokens")] = "1024",
    output_tokens: Annotated[str, typer.Option("--output-tokens")] = "256",
    weight_dtype: Annotated[str, typer.Option("--weight-dtype", help="comma-separated weight dtypes")] = "bf16",
    constraint: Annotated[Optional[list[str]], typer.Option(help="METRIC<=VALUE (repeatable), e.g. itl_s<=0.05")] = None,
    objective: Annotated[Optional[list[str]], typer.Option(help="METRIC:max|min (repeatable); the first ranks")] = None,
    top: Annotated[int, typer.Option(help="rows to show")] = 10,
    csv: Annotated[Optional[Path], typer.Option("--csv", help="write every point to this CSV file")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="write the Pareto frontier of the first two objectives (PNG)")] = None,
    json: Json = False,
):
    """Search serving deployments: every combination evaluated at once, infeasible ones filtered with reasons."""
    from mlsyslab.predict.search import Constraint, Objective, search, serving_evaluator
    from mlsyslab.specs import catalog

    for name in model:
        catalog.model(name)
    for name in hardware:
        catalog.hardware(name)
    check_positive(top=top)
    for option, path, suffix in (("--csv", csv, ".csv"), ("--plot", plot, ".png")):
        if path is not None:
            check_output_file(option, path, (suffix,))
    axes = {"model": list(model), "hardware": list(hardware), "weight_dtype": _names(weight_dtype, "--weight-dtype"),
            "tp": _counts(tp, "--tp"), "batch": _counts(batch, "--batch"),
            "prompt_tokens": _counts(prompt_tokens, "--prompt-tokens"),
            "output_tokens": _counts(output_tokens, "--output-tokens")}
    for value in axes["weight_dtype"]:
        if value not in DTYPE_BYTES:
            raise InvalidValue("--weight-dtype", value, ", ".join(DTYPE_BYTES))
    objectives = [Objective.parse(o) for o in (objective or ["tokens_per_s_per_gpu:max"])]
    result = search(axes, serving_evaluator(), [Constraint.parse(c) for c in constraint or []], objectives)
    best = [result.row(int(i)) for i in result.ranked[:top]]
    report = {"evaluated": result.evaluated, "ranked": int(len(result.ranked)), "rejected": result.rejected,
              "best": best, "pareto": [result.row(int(i)) for i in result.pareto]}
    if csv is not None:
        _write_csv(csv, result)
    if plot is not None:
        _plot(plot, result, objectives)
    if json:
        return emit_json(report)
    console.print(f"{result.evaluated:,} deployments evaluated, {len(result.ranked):,} feasible and within the constraints")
    if best:
        columns = ["model", "hardware", "weight_dtype", "tp", "batch", "prompt_tokens", "output_tokens", *[o.metric for o in objectives]]
        console.print(table(f"best by {objectives[0].metric}", [tuple(_cell(r[c]) for c in columns) for r in best], tuple(columns)))
    if result.rejected:
        console.print(table("rejected", sorted(result.rejected.items(), key=lambda kv: -kv[1]), ("reason", "points")))


def _names(text: str, field: str) -> list[str]:
    """Comma-separated names, none empty."""
    names = [v.strip() for v in text.split(",")]
    if not all(names):
        raise InvalidValue(field, text, "comma-separated values with none empty, e.g. bf16,int8")
    return names


def _counts(text: str, field: str) -> list[int]:
    """Comma-separated counts, each 1..MAX_COUNT."""
    try:
        values = [int(v) for v in _names(text, field)]
    except ValueError:
        raise InvalidValue(field, text, "comma-separated whole numbers, e.g. 1,2,4") from None
    for value in values:
        check_range(field, value, 1, MAX_COUNT)
    return values


def _cell(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _write_csv(path: Path, result) -> None:
    import csv

    rows = [result.row(i) for i in range(result.evaluated)]
    with open(path, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _plot(path: Path, result, objectives) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_metric = objectives[0].metric
    y_metric = objectives[1].metric if len(objectives) > 1 else "itl_s"
    ranked = result.ranked
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.scatter(result.points[x_metric][ranked], result.points[y_metric][ranked], s=4, alpha=0.3, label="feasible")
    axis.plot(result.points[x_metric][result.pareto], result.points[y_metric][result.pareto], "r.-", label="Pareto frontier")
    axis.set_xlabel(x_metric)
    axis.set_ylabel(y_metric)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def prune_command(
    model: ModelName = None, hardware: HardwareName = None, model_spec: ModelSpec = None, hardware_spec: HardwareSpec = None,
    density: Annotated[float, typer.Option(help="fraction of weights kept")] = 0.5,
    structured: Annotated[bool, typer.Option("--structured", help="2:4 structured sparsity (density 0.5)")] = False,
    batch: Annotated[int, typer.Option("--batch")] = 1, tp: Annotated[int, typer.Option("--tp")] = 1,
    dtype: Dtype = "bf16", json: Json = False,
):
    """Speedup from pruning, by phase: memory-bound decode vs compute-bound prefill and training."""
    from mlsyslab.predict.algorithm import pruning_effect
    from mlsyslab.predict.inference import predict_inference

    spec, hw, assumptions = resolve(model, model_spec, hardware, hardware_spec, dtype, None)
    check_positive(batch=batch, tp=tp)
    check_model_shape(spec, tp)
    _require_fit(spec, hw, tp, predict_inference(spec, hw, batch, 1, 1, tp, assumptions=assumptions))  # unpruned
    effect = pruning_effect(spec, hw, density, structured, batch=batch, tp=tp, assumptions=assumptions)
    report = {"model": spec.name, "hardware": hw.name, "density": density, "structured": structured,
              "weight_bytes_fraction": effect.weight_bytes_fraction, "flops_fraction": effect.flops_fraction,
              "speedup": {k: float(v) for k, v in effect.speedup.items()}}
    if json:
        return emit_json(report)
    console.print(table(f"{spec.name} on {hw.name}, density {density:g}{' (2:4)' if structured else ''}",
                        [(phase, f"{value:.2f}x") for phase, value in report["speedup"].items()], ("phase", "speedup")))


def _require_fit(spec, hw, tp: int, *predictions) -> None:
    """A scenario's numbers mean nothing for a deployment that does not fit: refuse it, saying why."""
    for r in predictions:
        if not bool(np.all(r.feasible)):
            raise InvalidValue("scenario", f"{spec.name} on {hw.name} TP{tp}", "a deployment that fits", reason=r.reason(0))


def queue_command(
    rate: Annotated[float, typer.Option(help="arrivals per second")] = 10.0,
    service_s: Annotated[float, typer.Option("--service-s", help="mean service time per request")] = 2.0,
    servers: Annotated[int, typer.Option(help="requests served at once (replicas x batch slots)")] = 32,
    quantile: Annotated[float, typer.Option(help="latency quantile")] = 0.99,
    json: Json = False,
):
    """M/M/c queueing (Erlang C): the chance of waiting, the mean and tail latency."""
    from mlsyslab.predict.fleet import erlang_c, queue_wait_s
    from mlsyslab.predict.serving import p99_latency_s

    check_greater_than_zero(rate=rate, service_s=service_s)
    check_positive(100_000, servers=servers)  # Erlang C's recursion runs once per server
    check_range("--quantile", quantile, 0, 1)
    load = rate * service_s
    report = {"utilisation": load / servers, "stable": load < servers,
              "probability_of_waiting": float(erlang_c(servers, load)) if load < servers else 1.0,
              "mean_wait_s": float(queue_wait_s(rate, service_s, servers)),
              "latency_quantile_s": float(p99_latency_s(rate, service_s, servers, quantile)), "quantile": quantile}
    if json:
        return emit_json(report)
    if not report["stable"]:
        return console.print(f"[red]unstable: {load:.1f} requests in service on average exceed {servers} servers[/]")
    console.print(table(f"M/M/{servers} at {rate:g} requests/s, {service_s:g} s each", [
        ("utilisation", f"{report['utilisation']:.1%}"), ("P(wait)", f"{report['probability_of_waiting']:.1%}"),
        ("mean wait", seconds(report["mean_wait_s"])), (f"p{quantile * 100:g} latency", seconds(report["latency_quantile_s"]))]))


def prefix_cache_command(
    model: ModelName = None, hardware: HardwareName = None, model_spec: ModelSpec = None, hardware_spec: HardwareSpec = None,
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens")] = 2048,
    shared_fraction: Annotated[float, typer.Option("--shared-fraction", help="fraction of the prompt that is a shared prefix")] = 0.5,
    hit_rate: Annotated[float, typer.Option("--hit-rate", help="fraction of requests finding it cached")] = 0.9,
    batch: Annotated[int, typer.Option("--batch")] = 1, tp: Annotated[int, typer.Option("--tp")] = 1,
    dtype: Dtype = "bf16", json: Json = False,
):
    """Prefill tokens and TTFT saved by a prefix cache."""
    from mlsyslab.predict.inference import predict_inference
    from mlsyslab.predict.serving import prefix_cache_prefill_fraction

    spec, hw, assumptions = resolve(model, model_spec, hardware, hardware_spec, dtype, None)
    check_positive(prompt_tokens=prompt_tokens, batch=batch, tp=tp)
    check_model_shape(spec, tp, prompt_tokens, "--prompt-tokens")
    check_range("--shared-fraction", shared_fraction, 0, 1)
    check_range("--hit-rate", hit_rate, 0, 1)
    remaining = float(prefix_cache_prefill_fraction(shared_fraction, hit_rate))
    cold = predict_inference(spec, hw, batch, prompt_tokens, 1, tp, assumptions=assumptions)
    _require_fit(spec, hw, tp, cold)
    warm = predict_inference(spec, hw, batch, max(1.0, prompt_tokens * remaining), 1, tp, assumptions=assumptions)
    report = {"prefill_fraction": remaining, "ttft_cold_s": float(cold.ttft_s), "ttft_warm_s": float(warm.ttft_s),
              "ttft_ratio": float(cold.ttft_s / warm.ttft_s)}
    if json:
        return emit_json(report)
    console.print(f"prefill {remaining:.0%} of the prompt: TTFT {seconds(report['ttft_cold_s'])} → "
                  f"{seconds(report['ttft_warm_s'])} ({report['ttft_ratio']:.2f}x)")


def disaggregate_command(
    model: ModelName = None, hardware: HardwareName = None, model_spec: ModelSpec = None, hardware_spec: HardwareSpec = None,
    rate: Annotated[float, typer.Option(help="requests per second")] = 20.0,
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens")] = 2048,
    output_tokens: Annotated[int, typer.Option("--output-tokens")] = 256,
    decode_batch: Annotated[int, typer.Option("--decode-batch", help="sequences per decode GPU")] = 64,
    link_gbps: Annotated[float, typer.Option("--link-gbps", help="prefill → decode link, GB/s")] = 50.0,
    tp: Annotated[int, typer.Option("--tp")] = 1, dtype: Dtype = "bf16", json: Json = False,
):
    """Size separate prefill and decode pools for a request rate, and the KV hand-off between them."""
    from mlsyslab.predict.architecture import kv_bytes_per_token
    from mlsyslab.predict.inference import predict_inference
    from mlsyslab.predict.serving import disaggregated_pools

    spec, hw, assumptions = resolve(model, model_spec, hardware, hardware_spec, dtype, None)
    check_greater_than_zero(rate=rate, link_gbps=link_gbps)
    check_positive(prompt_tokens=prompt_tokens, output_tokens=output_tokens, decode_batch=decode_batch, tp=tp)
    check_model_shape(spec, tp, prompt_tokens + output_tokens)
    prefill = predict_inference(spec, hw, 1, prompt_tokens, 1, tp, assumptions=assumptions)
    decode = predict_inference(spec, hw, decode_batch, prompt_tokens, output_tokens, tp, assumptions=assumptions)
    _require_fit(spec, hw, tp, prefill, decode)
    pools = disaggregated_pools(rate, prompt_tokens, output_tokens, prompt_tokens / float(prefill.ttft_s) / tp,
                                float(decode.tokens_per_s) / tp, kv_bytes_per_token(spec, dtype), link_gbps * 1e9)
    report = {"prefill_gpus": int(pools.prefill_gpus), "decode_gpus": int(pools.decode_gpus),
              "kv_transfer_s": float(pools.kv_transfer_s), "ttft_s": float(prefill.ttft_s), "itl_s": float(decode.itl_s)}
    if json:
        return emit_json(report)
    console.print(f"{report['prefill_gpus']} prefill GPUs + {report['decode_gpus']} decode GPUs for {rate:g} requests/s; "
                  f"KV hand-off {seconds(report['kv_transfer_s'])} per request")
