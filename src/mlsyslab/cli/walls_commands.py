"""`mlsys predict data|scaling|quantize|moe-imbalance|wafer` and `mlsys explain`: faces over the data,
algorithm and wafer walls and the differential explainer (predict.data_pipeline, predict.algorithm,
predict.wafer, predict.explain)."""

import math
from functools import partial
from typing import Annotated, Optional

import numpy as np
import typer

from mlsyslab.cli.options import (Assume, Dtype, Explain, HardwareName, Json, ModelName, ModelSpec,
                                  check_greater_than_zero, check_model_shape, check_positive, check_range, check_unused, resolve,
                                  resolve_hardware, resolve_model)
from mlsyslab.cli.render import assumptions_table, console, count, emit_json, human, seconds, table
from mlsyslab.errors import InvalidValue
from mlsyslab.predict import algorithm, data_pipeline, explain, wafer
from mlsyslab.predict.hardware import Hardware
from mlsyslab.predict.layout import RECOMPUTE, Layout
from mlsyslab.predict.planner import plan
from mlsyslab.predict.training import validate_layout
from mlsyslab.specs import catalog
from mlsyslab.specs.schema import DTYPES
from mlsyslab.specs.units import parse_quantity

Opt = lambda kind, name, help: Annotated[kind, typer.Option(name, help=help)]  # noqa: E731
first = lambda a: np.asarray(a).reshape(-1)[0].item()  # noqa: E731


def _local_assumptions(default, pairs):
    """A module's own assumptions (DataPipelineAssumptions, WaferAssumptions) with --assume NAME=VALUE."""
    bad = [pair for pair in pairs or [] if "=" not in pair]
    if bad:
        raise InvalidValue("--assume", bad[0], "NAME=VALUE, e.g. compute_efficiency=0.4")
    return default.override({k.strip(): v.strip() for k, v in (pair.split("=", 1) for pair in pairs or [])})


def _quantity(flag: str, text: str, kind: str) -> float:
    value = parse_quantity(text, kind, flag)
    if not (math.isfinite(value) and value > 0):  # NaN too
        raise InvalidValue(flag, text, f"a finite positive quantity in {kind}")
    return value


def _finish(report: dict, json: bool, explain_flag: bool, assumptions, render) -> None:
    report["assumptions"] = {k: v["value"] for k, v in assumptions.explain().items()}
    if json:
        return emit_json(report)
    render(report)
    if explain_flag:
        console.print(assumptions_table(assumptions.explain()))


# ------------------------------------------------------------------------------------------ data


def predict_data(
    hardware: HardwareName = None,
    batch: Opt(int, "--batch", "samples per step per accelerator") = 256,
    flops_per_sample: Opt(float, "--flops-per-sample", "forward FLOP per sample, 2 per MAC (ResNet-50 at 224²: 8.2e9)") = 8.2e9,
    training: Annotated[bool, typer.Option("--training/--inference", help="3 passes (forward + backward) or 1")] = True,
    step_ms: Opt(Optional[float], "--step-ms", "the accelerator's step time, instead of FLOPs / (peak · efficiency)") = None,
    workers: Opt(int, "--workers", "loader worker processes per accelerator (0: the training process loads)") = 16,
    worker_rate: Opt(float, "--worker-rate", "samples/s one worker decodes and augments") = 150.0,
    cpu_cores: Opt(Optional[int], "--cpu-cores", "cores per accelerator (caps the useful workers)") = None,
    sample_size: Opt(str, "--sample-size", "encoded bytes read per sample") = "110 kB",
    storage_bw: Opt(str, "--storage-bw", "storage read bandwidth per accelerator") = "2 GB/s",
    decoded_size: Opt(str, "--decoded-size", "bytes per decoded sample sent to the accelerator (224x224x3 uint8)") = "150528 B",
    h2d_bw: Opt(Optional[str], "--h2d-bw", "host-to-device bandwidth (default: the system's PCIe)") = None,
    dtype: Dtype = "bf16", assume: Assume = None, json: Json = False, explain_flag: Explain = False,
):
    """Can storage and the CPUs feed the accelerator? Utilisation and the binding stage of an input pipeline."""
    a = _local_assumptions(data_pipeline.DEFAULT, assume)
    check_positive(batch=batch)
    check_range("--workers", workers, 0)
    check_greater_than_zero(flops_per_sample=flops_per_sample, worker_rate=worker_rate, step_ms=step_ms,
                            cpu_cores=cpu_cores)
    hw = resolve_hardware(hardware, None, dtype)[0] if hardware or step_ms is None else None
    step_s = step_ms / 1e3 if step_ms is not None else float(
        data_pipeline.accelerator_step_s(flops_per_sample, batch, hw.peak_flops, training, a))
    h2d = _quantity("--h2d-bw", h2d_bw, "bytes/s") if h2d_bw else (hw.pcie_bw if hw and hw.pcie_bw else 32e9)
    r = data_pipeline.predict_data_pipeline(
        batch, step_s, workers, worker_rate, _quantity("--sample-size", sample_size, "bytes"),
        _quantity("--storage-bw", storage_bw, "bytes/s"), _quantity("--decoded-size", decoded_size, "bytes"), h2d,
        np.inf if cpu_cores is None else cpu_cores, a)
    report = {
        "hardware": hw.name if hw else None, "batch": batch, "training": training, "workers": workers,
        "worker_samples_per_s": worker_rate, "step_s": step_s,
        "stage_samples_per_s": {k: first(v) for k, v in r.stage_samples_per_s.items()},
        "samples_per_s": first(r.samples_per_s), "batch_s": first(r.batch_s), "utilisation": first(r.utilisation),
        "binding": str(first(r.binding)), "workers_needed": first(r.workers_needed),
    }
    _finish(report, json, explain_flag, a, _print_data)


def _print_data(report: dict) -> None:
    rows = [(stage, human(rate, "samples/s"), seconds(report["batch"] / rate))
            for stage, rate in report["stage_samples_per_s"].items()]
    console.print(table(f"input pipeline, batch {report['batch']} ({'training' if report['training'] else 'inference'}"
                        f"{' on ' + report['hardware'] if report['hardware'] else ''})", rows, ("stage", "rate", "per batch")))
    needed = report["workers_needed"]
    console.print(table("result", [
        ("accelerator step", seconds(report["step_s"])), ("wall-clock per batch", seconds(report["batch_s"])),
        ("accelerator utilisation", f"{report['utilisation']:.1%}"), ("binding stage", report["binding"]),
        ("workers to keep it busy", "—" if needed is None or not np.isfinite(needed) else f"{needed:.0f}")]))


# --------------------------------------------------------------------------------------- scaling


def predict_scaling(
    compute: Opt(Optional[float], "--compute", "training FLOP budget: the compute-optimal model and data for it") = None,
    params: Opt(Optional[float], "--params", "parameters N (with --tokens: that run's compute and loss)") = None,
    tokens: Opt(Optional[float], "--tokens", "training tokens D") = None,
    json: Json = False,
):
    """Chinchilla (Hoffmann et al. 2022): C = 6ND, D ≈ 20N, and the fitted loss L(N, D) = E + A/N^α + B/D^β."""
    if (compute is None) == (params is None):
        raise InvalidValue("--compute/--params", compute if compute is not None else params,
                           "exactly one of --compute FLOP or --params N (optionally with --tokens D)")
    if tokens is not None and params is None:
        raise InvalidValue("--tokens", tokens, "with --params")
    check_greater_than_zero(compute=compute, params=params, tokens=tokens)
    fit = algorithm.CHINCHILLA
    fits = {"rule": ("rule", fit), "fit": ("fit", fit), "refit": ("fit", algorithm.BESIROGLU_REFIT)}
    report = {"fit": {k: getattr(fit, k) for k in ("E", "A", "B", "alpha", "beta", "tokens_per_parameter")}}
    if params is not None:
        tokens = tokens if tokens is not None else fit.tokens_per_parameter * params
        compute = float(algorithm.training_compute(params, tokens))
        report["run"] = {"parameters": params, "tokens": tokens, "tokens_per_parameter": tokens / params,
                         "compute_flops": compute, "loss": float(algorithm.chinchilla_loss(params, tokens))}
    report["compute_flops"] = compute
    for name, (method, constants) in fits.items():
        point = algorithm.compute_optimal(compute, method, constants)
        report[name] = {"parameters": float(point.parameters), "tokens": float(point.tokens),
                          "tokens_per_parameter": float(point.tokens / point.parameters), "loss": float(point.loss)}
    if json:
        return emit_json(report)
    rows = [(label, count(report[m]["parameters"]), count(report[m]["tokens"]), f"{report[m]['tokens_per_parameter']:.1f}",
             f"{report[m]['loss']:.3f}") for m, label in (("rule", "D = 20N"), ("fit", "minimum of the fitted loss"),
                                                     ("refit", "minimum of the refit (Besiroglu et al. 2024)"))]
    if "run" in report:
        run = report["run"]
        rows.insert(0, ("this run", count(run["parameters"]), count(run["tokens"]), f"{run['tokens_per_parameter']:.1f}",
                        f"{run['loss']:.3f}"))
    console.print(table(f"compute {compute:.3g} FLOP (C = 6ND)", rows, ("", "parameters", "tokens", "tokens/param", "loss")))


# ---------------------------------------------------------------------------------- quantisation


def predict_quantize(
    model: ModelName = None, hardware: HardwareName = None,
    weight_dtypes: Opt(str, "--weight-dtypes", "comma-separated weight dtypes to compare with --dtype") = "int8,int4",
    batch: Opt(int, "--batch", "sequences") = 1,
    prompt_tokens: Opt(int, "--prompt-tokens", "tokens per prompt (training: prompt + output per sequence)") = 1024,
    output_tokens: Opt(int, "--output-tokens", "tokens generated per sequence") = 256,
    tp: Opt(int, "--tp", "tensor-parallel size") = 1,
    low_precision_compute: Annotated[bool, typer.Option(
        "--low-precision-compute", help="also compute at the chip's rate for the weight dtype (W8A8, FP8)")] = False,
    dtype: Dtype = "bf16", model_spec: ModelSpec = None, assume: Assume = None, json: Json = False,
    explain_flag: Explain = False,
):
    """What quantised weights buy in each phase: memory-bound decode vs compute-bound prefill and training."""
    spec, hw, assumptions = resolve(model, model_spec, hardware, None, dtype, assume)
    check_positive(batch=batch, prompt_tokens=prompt_tokens, output_tokens=output_tokens, tp=tp)
    dtypes = [d.strip() for d in weight_dtypes.split(",")]
    for d in dtypes:
        if d not in DTYPES:
            raise InvalidValue("--weight-dtypes", d, ", ".join(DTYPES))
    check_model_shape(spec, tp, prompt_tokens + output_tokens)
    system, chip = catalog.hardware(hardware)
    rows = []
    for d in dtypes:
        if low_precision_compute and d not in chip.peak_flops:
            rows.append({"weight_dtype": d, "feasible": False, "phases": None,
                         "reason": f"{chip.name} has no {d} compute rate (has: {', '.join(sorted(chip.peak_flops))})"})
            continue
        compute_hw = Hardware.of(system, chip, d) if low_precision_compute else None
        r = algorithm.quantization_effect(spec, hw, d, batch, prompt_tokens, output_tokens, tp, compute_hw, assumptions)
        feasible, fits_base, fits_quant = (bool(np.all(x)) for x in (r.feasible, r.baseline_feasible, r.quantized_feasible))
        rows.append({"weight_dtype": d, "feasible": feasible, "reason": r.reason, "phases": {p: {
            "baseline_s": first(r.baseline_s[p]) if fits_base else None,
            "quantized_s": first(r.quantized_s[p]) if fits_quant else None,
            "speedup": first(r.speedup[p]) if feasible else None,
            "bound": str(first(r.bound[p])), "baseline_bound": str(first(r.baseline_bound[p]))}
            for p in algorithm.PHASES}})
    report = {"model": spec.name, "hardware": hw.name, "dtype": dtype, "batch": batch, "prompt_tokens": prompt_tokens,
              "output_tokens": output_tokens, "tp": tp, "low_precision_compute": low_precision_compute, "rows": rows}
    _finish(report, json, explain_flag, assumptions, _print_quantize)


def _print_quantize(report: dict) -> None:
    out = table(f"{report['model']} on {report['hardware']}: weights in {report['dtype']} -> quantised "
                f"(batch {report['batch']}, {report['prompt_tokens']} + {report['output_tokens']} tokens)", [], None)
    for name in ("weights", "phase", report["dtype"], "quantised", "speedup", "bound"):
        out.add_column(name)
    for row in report["rows"]:
        if row["phases"] is None:
            out.add_row(row["weight_dtype"], "—", "—", "—", "—", f"infeasible: {row['reason']}")
            continue
        for phase, p in row["phases"].items():
            out.add_row(row["weight_dtype"], phase, seconds(p["baseline_s"]), seconds(p["quantized_s"]),
                        f"{p['speedup']:.2f}x" if row["feasible"] else "—",
                        f"{p['baseline_bound']} -> {p['bound']}" if row["feasible"] else f"infeasible: {row['reason']}")
    console.print(out)


# ---------------------------------------------------------------------------------- MoE routing


def predict_moe_imbalance(
    tokens: Opt(int, "--tokens", "tokens routed per batch (per expert-parallel group)") = 4096,
    experts: Opt(Optional[int], "--experts", "routed experts (default: the model's)") = None,
    top_k: Opt(Optional[int], "--top-k", "experts per token (default: the model's)") = None,
    capacity_factor: Opt(float, "--capacity-factor", "expert capacity as a multiple of the mean load") = 1.25,
    model: ModelName = None, model_spec: ModelSpec = None, json: Json = False,
):
    """Load imbalance of a balanced top-k router (balls into bins): busiest expert, dropped tokens."""
    if model or model_spec:
        spec = resolve_model(model, model_spec)
        if spec.moe is None:
            raise InvalidValue("--model", spec.name, "a mixture-of-experts model (or give --experts and --top-k)")
        experts, top_k = experts or spec.moe.experts, top_k or spec.moe.experts_per_token
    if experts is None or top_k is None:
        raise InvalidValue("--experts/--top-k", experts if experts is None else top_k, "both, or --model with experts")
    check_positive(tokens=tokens, experts=experts, top_k=top_k)
    check_range("--top-k", top_k, 1, experts)
    check_greater_than_zero(capacity_factor=capacity_factor)
    factors = np.array(sorted({1.0, 1.25, 1.5, 2.0, capacity_factor}))
    r = algorithm.moe_imbalance(tokens, experts, top_k, factors)
    i = int(np.searchsorted(factors, capacity_factor))
    report = {"tokens": tokens, "experts": experts, "top_k": top_k, "capacity_factor": capacity_factor,
              "mean_load": float(r.mean_load[i]), "expected_max_load": float(r.expected_max_load[i]),
              "imbalance": float(r.imbalance[i]), "capacity": float(r.capacity[i]),
              "dropped_fraction": float(r.dropped_fraction[i]), "overflow_probability": float(r.overflow_probability[i]),
              "by_capacity_factor": [{"capacity_factor": float(f), "capacity": float(c), "dropped_fraction": float(d)}
                                     for f, c, d in zip(factors, r.capacity, r.dropped_fraction)]}
    if json:
        return emit_json(report)
    console.print(table(f"{tokens} tokens, top-{top_k} of {experts} experts (balanced router)", [
        ("mean load per expert", f"{report['mean_load']:.1f}"), ("expected busiest expert", f"{report['expected_max_load']:.1f}"),
        ("imbalance (dropless slowdown)", f"{report['imbalance']:.3f}x")]))
    console.print(table("capacity and dropped tokens", [
        (f"{row['capacity_factor']:g}", f"{row['capacity']:.0f}", f"{row['dropped_fraction']:.3%}")
        for row in report["by_capacity_factor"]], ("capacity factor", "capacity", "dropped")))


# -------------------------------------------------------------------------------------------- wafer


def predict_wafer(
    model: ModelName = None, hardware: Annotated[str, typer.Option("--hardware", "-H", help="the streaming chip")] = "cs-3",
    phase: Opt(str, "--phase", "prefill, decode or training") = "prefill",
    batch: Opt(int, "--batch", "sequences per pass") = 1,
    seq: Opt(int, "--seq", "prompt (prefill), context (decode) or sequence length (training)") = 2048,
    injection_bw: Opt(Optional[str], "--injection-bw", "weight-streaming bandwidth (default: the catalog's; "
                      "wafer: MemoryX links, otherwise PCIe)") = None,
    external_memory: Opt(Optional[str], "--external-memory", "external weight store (default: the system's host memory)") = None,
    recompute: Annotated[bool, typer.Option("--recompute", help="training: keep only each layer's input, recompute the rest")] = False,
    vs_hardware: Opt(str, "--vs-hardware", "GPU system to compare with ('none' to skip)") = "h100",
    vs_gpus: Opt(Optional[int], "--vs-gpus", "training comparison: GPUs to plan on (default: one node)") = None,
    dtype: Dtype = "bf16", model_spec: ModelSpec = None, assume: Assume = None, json: Json = False,
    explain_flag: Explain = False,
):
    """Weight streaming (Cerebras MemoryX): the injection wall, the SRAM cap on tokens, and a GPU layout that fits."""
    spec = resolve_model(model, model_spec)
    a = _local_assumptions(wafer.DEFAULT, assume)
    if phase not in wafer.PHASES:
        raise InvalidValue("--phase", phase, ", ".join(wafer.PHASES))
    check_positive(batch=batch, seq=seq, vs_gpus=vs_gpus)
    check_model_shape(spec, tokens=seq, tokens_field="--seq")
    if phase != "training":
        check_unused("only with --phase training", ("--recompute", recompute, False), ("--vs-gpus", vs_gpus, None))
    if vs_hardware == "none":
        check_unused("only with a GPU system to compare with (--vs-hardware)", ("--vs-gpus", vs_gpus, None))
    hw, _ = resolve_hardware(hardware, None, dtype)
    system, chip = catalog.hardware(hardware)
    on_chip = chip.sram_bytes if chip.kind == "wafer" or not chip.hbm_bytes else chip.hbm_bytes
    inject = _quantity("--injection-bw", injection_bw, "bytes/s") if injection_bw else (
        chip.hbm_bw if chip.kind == "wafer" else system.pcie_bw)
    external = _quantity("--external-memory", external_memory, "bytes") if external_memory else system.host_memory_bytes
    r = wafer.predict_weight_streaming(spec, hw.peak_flops, inject, on_chip, external, phase, batch, seq, dtype, recompute, a)
    feasible = bool(first(r.feasible))
    report = {
        "model": spec.name, "hardware": hw.name, "phase": phase, "batch": batch, "seq": seq, "dtype": dtype,
        "injection_bw": inject, "on_chip_bytes": on_chip, "external_bytes": external, "recompute": recompute,
        "feasible": feasible, "reason": r.reason(0), "layer_weight_bytes": r.layer_weight_bytes,
        "injection_s_per_layer": first(r.injection_s), "compute_s_per_layer": first(r.compute_s),
        "step_s": first(r.step_s) if feasible else None, "tokens_per_s": first(r.tokens_per_s) if feasible else None,
        "bound": str(first(r.bound)), "critical_tokens": first(r.critical_tokens),
        "on_chip_needed_bytes": first(r.sram_needed_bytes), "on_chip_usable_bytes": r.sram_usable_bytes,
        "max_tokens_per_pass": first(r.max_tokens), "weights_fit_on_chip": bool(r.weights_fit_on_chip),
        "comparison": None if vs_hardware.lower() == "none" else _gpu_comparison(
            spec, vs_hardware, phase, batch, seq, dtype, vs_gpus, first(r.step_s) if feasible else None),
    }
    _finish(report, json, explain_flag, a, _print_wafer)


def _gpu_comparison(spec, name, phase, batch, seq, dtype, gpus, wafer_s):
    gpu, _ = resolve_hardware(name, None, dtype)
    if phase == "training":
        gpus = gpus or gpu.accelerators_per_node
        try:
            result = plan(spec, gpu, gpus, batch, seq)
        except InvalidValue:  # no layout of that many GPUs splits the batch: say so of the options the user gave
            raise InvalidValue("--vs-gpus", gpus, f"a GPU count for which some layout of {spec.name} splits the --batch "
                               f"of {batch} sequences evenly") from None
        if not len(result.ranked):
            return {"hardware": gpu.name, "gpus": gpus, "feasible": False, "time_s": None, "wafer_speedup": None,
                    "reason": "no layout fits: " + "; ".join(f"{k} ({n})" for k, n in result.infeasible.items())}
        best = result.layouts.row(int(result.ranked[0]))
        time_s = batch * seq / float(result.tokens_per_s[result.ranked[0]])
        return {"hardware": gpu.name, "gpus": gpus, "feasible": True, "layout": best, "time_s": time_s,
                "wafer_speedup": time_s / wafer_s if wafer_s else None, "reason": ""}
    g = wafer.gpu_counterpart(spec, gpu, phase, batch, seq)
    layouts = [{"tp": int(t), "feasible": bool(f), "time_s": float(s) if f else None, "reason": why}
               for t, f, s, why in zip(g.tp, g.feasible, g.time_s, g.reasons)]
    best = g.best()
    if best is None:
        return {"hardware": gpu.name, "feasible": False, "layouts": layouts, "time_s": None, "wafer_speedup": None,
                "reason": f"no tensor-parallel width up to {int(g.tp[-1])} fits: {g.reasons[-1]}"}
    time_s = float(g.time_s[best])
    return {"hardware": gpu.name, "feasible": True, "gpus": int(g.tp[best]), "layouts": layouts, "time_s": time_s,
            "wafer_speedup": time_s / wafer_s if wafer_s else None, "reason": ""}


def _print_wafer(report: dict) -> None:
    verdict = "[green]fits[/]" if report["feasible"] else f"[red]infeasible: {report['reason']}[/]"
    console.print(f"[bold]{report['model']}[/] {report['phase']} on {report['hardware']} (weight streaming at "
                  f"{human(report['injection_bw'], 'B/s')}), batch {report['batch']} x {report['seq']} tokens — {verdict}")
    rows = [("weights per layer", human(report["layer_weight_bytes"], "B")),
            ("injection per layer", seconds(report["injection_s_per_layer"])),
            ("compute per layer (forward)", seconds(report["compute_s_per_layer"])),
            ("bound", report["bound"]), ("tokens per pass where compute catches up", count(report["critical_tokens"])),
            ("tokens per pass that fit on chip", count(report["max_tokens_per_pass"])),
            ("on-chip memory needed / usable", f"{human(report['on_chip_needed_bytes'], 'B')} / {human(report['on_chip_usable_bytes'], 'B')}")]
    if report["feasible"]:
        rows += [("step", seconds(report["step_s"])), ("tokens/s", human(report["tokens_per_s"], ""))]
    console.print(table("weight streaming", rows))
    c = report["comparison"]
    if c:
        for layout in c.get("layouts", []):
            console.print(f"  {c['hardware']} TP{layout['tp']}: " + (seconds(layout["time_s"]) if layout["feasible"]
                                                                     else f"infeasible ({layout['reason']})"))
        if c["feasible"]:
            speed = c["wafer_speedup"]
            console.print(f"  best feasible {c['hardware']} layout ({c.get('gpus')} GPUs): {seconds(c['time_s'])}" + (
                "" if not speed else f"; the wafer is {speed:.2f}x faster" if speed >= 1 else f"; the wafer is {1 / speed:.2f}x slower"))
        else:
            console.print(f"  [red]{c['hardware']}: {c['reason']}[/]")


# ------------------------------------------------------------------------------------------ explain

WORKLOADS = ("decode", "training")


def explain_command(
    model: ModelName = None, hardware: HardwareName = None,
    vs_model: Opt(Optional[str], "--vs-model", "scenario B's model (default: --model)") = None,
    vs_hardware: Opt(Optional[str], "--vs-hardware", "scenario B's hardware (default: --hardware)") = None,
    workload: Opt(str, "--workload", "decode (objective: ITL) or training (objective: step time)") = "decode",
    batch: Opt(int, "--batch", "decode: concurrent sequences") = 1,
    vs_batch: Opt(Optional[int], "--vs-batch", "scenario B's decode batch") = None,
    tp: Opt(int, "--tp", "tensor-parallel size") = 1,
    vs_tp: Opt(Optional[int], "--vs-tp", "scenario B's tensor-parallel size") = None,
    prompt_tokens: Opt(int, "--prompt-tokens", "decode: tokens per prompt") = 1024,
    output_tokens: Opt(int, "--output-tokens", "decode: tokens generated") = 256,
    weight_dtype: Opt(Optional[str], "--weight-dtype", "decode: weight dtype (default --dtype)") = None,
    vs_weight_dtype: Opt(Optional[str], "--vs-weight-dtype", "scenario B's weight dtype") = None,
    gpus: Opt(int, "--gpus", "training: accelerators (both scenarios)") = 8,
    pp: Opt(int, "--pp", "training: pipeline stages") = 1,
    zero: Opt(int, "--zero", "training: ZeRO stage 0-3") = 1,
    micro_batch: Opt(int, "--micro-batch", "training: sequences per microbatch") = 1,
    global_batch: Opt(Optional[int], "--global-batch", "training: sequences per step (default: 4 per pipeline)") = None,
    seq: Opt(int, "--seq", "training: tokens per sequence") = 4096,
    recompute: Opt(str, "--recompute", "training: none, selective, full") = "selective",
    dtype: Dtype = "bf16", model_spec: ModelSpec = None, assume: Assume = None, json: Json = False,
):
    """Compare two scenarios: the binding wall of each, the regime shift, and the change attributed to each input."""
    spec_a, hw_a, assumptions = resolve(model, model_spec, hardware, None, dtype, assume)
    spec_b = resolve_model(vs_model, None) if vs_model else spec_a
    hw_b = resolve_hardware(vs_hardware, None, dtype)[0] if vs_hardware else hw_a
    if workload not in WORKLOADS:
        raise InvalidValue("--workload", workload, ", ".join(WORKLOADS))
    if workload == "decode":
        check_unused("only with --workload training", ("--gpus", gpus, 8), ("--pp", pp, 1), ("--zero", zero, 1),
                     ("--micro-batch", micro_batch, 1), ("--global-batch", global_batch, None), ("--seq", seq, 4096),
                     ("--recompute", recompute, "selective"))
    else:
        check_unused("only with --workload decode", ("--batch", batch, 1), ("--vs-batch", vs_batch, None),
                     ("--prompt-tokens", prompt_tokens, 1024), ("--output-tokens", output_tokens, 256),
                     ("--weight-dtype", weight_dtype, None), ("--vs-weight-dtype", vs_weight_dtype, None))
    check_positive(batch=batch, vs_batch=vs_batch, tp=tp, vs_tp=vs_tp, prompt_tokens=prompt_tokens,
                   output_tokens=output_tokens, gpus=gpus, pp=pp, micro_batch=micro_batch, global_batch=global_batch, seq=seq)
    for flag, value in (("--weight-dtype", weight_dtype), ("--vs-weight-dtype", vs_weight_dtype)):
        if value is not None and value not in DTYPES:
            raise InvalidValue(flag, value, ", ".join(DTYPES))
    sides = ((spec_a, hw_a, tp, batch, weight_dtype), (spec_b, hw_b, vs_tp or tp, vs_batch or batch, vs_weight_dtype or weight_dtype))
    for flag, (spec, _, t, _, _) in zip(("--tp", "--vs-tp"), sides):
        check_model_shape(spec, t, prompt_tokens + output_tokens if workload == "decode" else 0, tp_field=flag)
    if workload == "decode":
        a, b = (explain.decode_inputs(s, h, bt, prompt_tokens, output_tokens, t, w) for s, h, t, bt, w in sides)
        objective, unit = partial(explain.decode_objective, assumptions=assumptions), "itl_s"
    else:
        check_range("--zero", zero, 0, 3)
        if recompute not in RECOMPUTE:
            raise InvalidValue("--recompute", recompute, ", ".join(RECOMPUTE))
        a, b = (explain.training_inputs(s, h, _layout(s, gpus, t, pp, zero, micro_batch, global_batch, seq, recompute))
                for s, h, t, _, _ in sides)
        objective, unit = partial(explain.training_objective, assumptions=assumptions), "step_s"
    e = explain.explain(objective, a, b)
    report = {
        "workload": workload, "objective": unit,
        "a": _side(spec_a.name, hw_a.name, e.a), "b": _side(spec_b.name, hw_b.name, e.b),
        "change_s": None if np.isnan(e.change) else e.change, "ratio": None if np.isnan(e.ratio) else e.ratio,
        "speedup": None if np.isnan(e.ratio) else 1 / e.ratio, "regime_shift": e.regime_shift,
        "changed": {name: {"a": _show(a[name]), "b": _show(b[name])} for name in e.changed},
        "attributions_s": e.attributions, "factors": e.factors,
        "infeasible_mixtures": [{"from_b": list(subset), "reason": why} for subset, why in e.infeasible_mixtures],
        "assumptions": {k: v["value"] for k, v in assumptions.explain().items()},
    }
    if json:
        return emit_json(report)
    _print_explain(report)


def _layout(spec, gpus, tp, pp, zero, micro_batch, global_batch, seq, recompute) -> dict:
    if gpus % (tp * pp):
        raise InvalidValue("--gpus", gpus, f"a multiple of tp·pp = {tp * pp}")
    dp = gpus // (tp * pp)
    layout = Layout.of(dp=dp, tp=tp, pp=pp, zero=zero if dp > 1 else 0, micro_batch=micro_batch,
                       global_batch=global_batch or dp * micro_batch * 4 * pp, seq=seq, recompute=recompute,
                       sequence_parallel=tp > 1)
    validate_layout(spec, layout)
    return layout.row(0)


def _side(model_name: str, hardware_name: str, outcome) -> dict:
    return {"model": model_name, "hardware": hardware_name, "feasible": outcome.feasible, "reason": outcome.reason,
            "value_s": outcome.value if outcome.feasible else None, "binding": outcome.binding,
            "walls_s": outcome.walls if outcome.feasible else None}


def _show(value):
    return getattr(value, "name", value)


def _print_explain(report: dict) -> None:
    for key in ("a", "b"):
        s = report[key]
        state = (f"{seconds(s['value_s'])}, bound by {s['binding']}" if s["feasible"]
                 else f"[red]infeasible ({s['binding']}): {s['reason']}[/]")
        console.print(f"{key.upper()}: {s['model']} on {s['hardware']} — {report['objective']} {state}")
    if report["regime_shift"]:
        console.print(f"regime shift: {report['regime_shift']}")
    if report["ratio"] is None:
        console.print("[red]no attribution: a scenario that cannot run has no objective to explain[/]")
        return
    console.print(f"change {seconds(abs(report['change_s']))} ({'slower' if report['change_s'] > 0 else 'faster'}); "
                  f"B/A = {report['ratio']:.3f} (speedup {report['speedup']:.2f}x)")
    out = table("attribution (Shapley over the inputs that changed)", [], None)
    for name in ("input", "A", "B", "share of the change", "factor"):
        out.add_column(name)
    for name, share in sorted(report["attributions_s"].items(), key=lambda kv: -abs(kv[1])):
        c = report["changed"][name]
        show = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
        out.add_row(name, show(c["a"]), show(c["b"]), f"{share * 1e3:+.4g} ms",
                    f"x{report['factors'][name]:.3f}" if report["factors"] else "—")
    console.print(out)
    for mixture in report["infeasible_mixtures"]:
        console.print(f"  note: with {', '.join(mixture['from_b'])} from B the scenario could not run ({mixture['reason']})")
