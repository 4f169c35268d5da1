"""`mlsys predict train|serve` and `mlsys plan`: thin faces over mlsyslab.predict."""

from typing import Annotated, Optional

import numpy as np
import typer

from mlsyslab.cli.options import (MAX_ACCELERATORS, Assume, Dtype, Explain, HardwareName, HardwareSpec, Json, ModelName,
                                  ModelSpec, check_greater_than_zero, check_model_shape, check_positive, check_range, resolve,
                                  resolve_hardware)
from mlsyslab.cli.render import assumptions_table, console, count, emit_json, human, seconds, table
from mlsyslab.errors import InvalidValue
from mlsyslab.predict.architecture import parameters
from mlsyslab.predict.inference import predict_inference
from mlsyslab.predict.layout import RECOMPUTE, SCHEDULES, Layout
from mlsyslab.predict.phases import PHASES, phase_roofline
from mlsyslab.predict.planner import plan
from mlsyslab.predict.roofline import roofline
from mlsyslab.predict.training import TrainingPrediction, predict_training, validate_layout
from mlsyslab.specs.schema import DTYPES

Int = lambda name, help: Annotated[Optional[int], typer.Option(name, help=help)]  # noqa: E731


def predict_train(
    model: ModelName = None, hardware: HardwareName = None, gpus: Annotated[int, typer.Option("--gpus", "-n", help="accelerators in the job")] = 8,
    tp: Int("--tp", "tensor-parallel size") = 1, pp: Int("--pp", "pipeline stages") = 1,
    cp: Int("--cp", "context-parallel size") = 1, ep: Int("--ep", "expert-parallel size (divides DP)") = 1,
    dp: Int("--dp", "data-parallel size (default: gpus / (tp·pp·cp))") = None,
    zero: Int("--zero", "ZeRO stage 0-3 over DP") = 0,
    micro_batch: Int("--micro-batch", "sequences per microbatch") = 1,
    global_batch: Int("--global-batch", "sequences per step (default: 4·pp microbatches per pipeline)") = None,
    seq: Int("--seq", "tokens per sequence") = 2048,
    recompute: Annotated[str, typer.Option(help="activation recompute: none, selective, full")] = "none",
    schedule: Annotated[str, typer.Option(help="pipeline schedule: gpipe, 1f1b, interleaved, pipedream")] = "1f1b",
    interleave: Int("--interleave", "virtual stages per rank (interleaved schedule)") = 1,
    sequence_parallel: Annotated[Optional[bool], typer.Option("--sequence-parallel/--no-sequence-parallel", help="default: on when tp > 1")] = None,
    offload: Annotated[bool, typer.Option("--offload", help="optimizer state and step on the CPU")] = False,
    optimizer: Annotated[str, typer.Option(help="adam or sgd")] = "adam",
    tokens: Annotated[Optional[float], typer.Option("--tokens", help="also predict the time to train this many tokens")] = None,
    dtype: Dtype = "bf16", model_spec: ModelSpec = None, hardware_spec: HardwareSpec = None,
    assume: Assume = None, json: Json = False, explain: Explain = False,
):
    """Step time, MFU and memory per accelerator of one training layout."""
    spec, hw, assumptions = resolve(model, model_spec, hardware, hardware_spec, dtype, assume)
    check_positive(MAX_ACCELERATORS, gpus=gpus)
    check_positive(tp=tp, pp=pp, cp=cp, ep=ep, dp=dp, micro_batch=micro_batch, global_batch=global_batch, seq=seq,
                   interleave=interleave)
    check_range("--zero", zero, 0, 3)
    check_greater_than_zero(tokens=tokens)
    for field, value, valid in (("--recompute", recompute, RECOMPUTE), ("--schedule", schedule, SCHEDULES),
                                ("--optimizer", optimizer, ("adam", "sgd"))):
        if value not in valid:
            raise InvalidValue(field, value, ", ".join(valid))
    if dp is None:
        if gpus % (tp * pp * cp):
            raise InvalidValue("--gpus", gpus, f"a multiple of tp·pp·cp = {tp * pp * cp}")
        dp = gpus // (tp * pp * cp)
    if dp * tp * pp * cp != gpus:
        raise InvalidValue("--gpus", gpus, f"dp·tp·pp·cp = {dp * tp * pp * cp}")
    if schedule != "interleaved" and interleave != 1:
        raise InvalidValue("--interleave", interleave, "1 unless --schedule interleaved")
    if offload and zero == 0:
        raise InvalidValue("--offload", True, "with --zero 1, 2 or 3 (ZeRO-Offload offloads the sharded optimizer)")
    layout = Layout.of(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, micro_batch=micro_batch,
                       global_batch=global_batch or dp * micro_batch * 4 * pp, seq=seq, recompute=recompute,
                       schedule=schedule, interleave=interleave,
                       sequence_parallel=tp > 1 if sequence_parallel is None else sequence_parallel, offload=offload)
    validate_layout(spec, layout)
    result = predict_training(spec, hw, layout, optimizer, assumptions)
    report = training_report(result, 0)
    report.update(layout=layout.row(0), model=spec.name, hardware=hw.name, dtype=dtype, optimizer=optimizer,
                  assumptions={k: v["value"] for k, v in assumptions.explain().items()})
    if tokens is not None:
        report["time_to_train_s"] = tokens / report["tokens_per_s"] if report["feasible"] else None
    if json:
        return emit_json(report)
    _print_training(report, spec)
    if explain:
        console.print(assumptions_table(assumptions.explain()))


def training_report(result: TrainingPrediction, i: int) -> dict:
    """The JSON contract of one predicted layout: timings are null when it is infeasible."""
    pick = lambda a: float(np.asarray(a).reshape(-1)[i])  # noqa: E731
    feasible = bool(result.feasible.reshape(-1)[i])
    when = lambda v: v if feasible else None  # noqa: E731
    return {
        "feasible": feasible, "reason": result.reason(i),
        "step_s": when(pick(result.step_s)), "mfu": when(pick(result.mfu)), "hfu": when(pick(result.hfu)),
        "tflops_per_gpu": when(pick(result.tflops_per_gpu)), "tokens_per_s": when(pick(result.tokens_per_s)),
        "bubble_fraction": pick(result.bubble_fraction),
        "memory_per_gpu_bytes": result.memory.breakdown(i),
        "time_breakdown_s": {k: when(pick(v)) for k, v in result.time_s.items()},
        "wire_bytes_per_gpu": {k: pick(v) for k, v in result.wire_bytes.items()},
        "stage_layers": {"first": pick(result.stages.first), "last": pick(result.stages.last),
                         "busiest_other": pick(result.stages.busiest_other),
                         "slowest_is_last": bool(result.slowest_is_last.reshape(-1)[i])},
    }


def _print_training(report: dict, spec) -> None:
    mem = report["memory_per_gpu_bytes"]
    lay = report["layout"]
    verdict = "[green]fits[/]" if report["feasible"] else f"[red]infeasible: {report['reason']}[/]"
    console.print(f"[bold]{spec.name}[/] ({count(parameters(spec).total())} parameters) on {report['hardware']}: "
                  f"DP{lay['dp']} x TP{lay['tp']} x PP{lay['pp']} x CP{lay['cp']} x EP{lay['ep']}, ZeRO-{lay['zero']}, "
                  f"micro batch {lay['micro_batch']}, global batch {lay['global_batch']} x {lay['seq']} tokens — {verdict}")
    rows = [(k, human(v, "B")) for k, v in mem.items() if k not in ("capacity",)]
    rows.append(("usable capacity", human(mem["capacity"], "B")))
    console.print(table("memory per accelerator", rows))
    if report["feasible"]:
        console.print(table("step", [("step time", seconds(report["step_s"])), ("MFU", f"{report['mfu']:.1%}"),
                                     ("HFU", f"{report['hfu']:.1%}"), ("model TFLOP/s per GPU", f"{report['tflops_per_gpu']:.0f}"),
                                     ("tokens/s", human(report["tokens_per_s"], "")),
                                     ("pipeline bubble", f"{report['bubble_fraction']:.1%}")]
                            + ([("decoder layers per rank (cost-balanced)", _stage_split(report["stage_layers"]))]
                               if lay["pp"] > 1 else [])
                            + ([("time to train", seconds(report["time_to_train_s"]))] if "time_to_train_s" in report else [])))
        console.print(table("where a step goes", [(k, seconds(v), f"{v / report['step_s']:.1%}")
                                                  for k, v in report["time_breakdown_s"].items() if v > 0]))


def _stage_split(stages: dict) -> str:
    slowest = "the last" if stages["slowest_is_last"] else f"one of {stages['busiest_other']:g} layers"
    return f"first {stages['first']:g}, last {stages['last']:g} with the output layer; slowest: {slowest}"


def predict_serve(
    model: ModelName = None, hardware: HardwareName = None,
    tp: Annotated[int, typer.Option("--tp", help="tensor-parallel size")] = 1,
    batch: Annotated[int, typer.Option("--batch", help="concurrent sequences")] = 1,
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", help="tokens per prompt")] = 1024,
    output_tokens: Annotated[int, typer.Option("--output-tokens", help="tokens generated per sequence")] = 256,
    weight_dtype: Annotated[Optional[str], typer.Option("--weight-dtype", help="weights (quantised: fp8, int8, int4); default: --dtype")] = None,
    kv_dtype: Annotated[Optional[str], typer.Option("--kv-dtype", help="KV cache dtype; default: --dtype")] = None,
    dtype: Dtype = "bf16", model_spec: ModelSpec = None, hardware_spec: HardwareSpec = None,
    assume: Assume = None, json: Json = False, explain: Explain = False,
):
    """Prefill (TTFT) and decode (ITL) time, KV cache and concurrency of one serving replica."""
    from mlsyslab.serve.config import compute_dtype  # on local: our engine's products, at the peak of the dtype they run in

    spec, hw, assumptions = resolve(model, model_spec, hardware, hardware_spec, compute_dtype(hardware, dtype), assume)
    weight_dtype, kv_dtype = weight_dtype or dtype, kv_dtype or dtype
    check_positive(tp=tp, batch=batch, prompt_tokens=prompt_tokens, output_tokens=output_tokens)
    for field, value in (("--weight-dtype", weight_dtype), ("--kv-dtype", kv_dtype)):
        if value is not None and value not in DTYPES:
            raise InvalidValue(field, value, ", ".join(DTYPES))
    check_model_shape(spec, tp, prompt_tokens + output_tokens)
    r = predict_inference(spec, hw, batch, prompt_tokens, output_tokens, tp, weight_dtype, kv_dtype, assumptions)
    item = lambda a: float(np.asarray(a).reshape(-1)[0])  # noqa: E731
    report = {
        "feasible": bool(np.all(r.feasible)), "reason": r.reason(0),
        "ttft_s": item(r.ttft_s), "itl_s": item(r.itl_s), "tokens_per_s": item(r.tokens_per_s),
        "kv_bytes_per_token": r.kv_bytes_per_token, "max_concurrency": int(item(r.max_concurrency)),
        "bound": "compute" if bool(r.decode_compute_bound.reshape(-1)[0]) else "memory",
        "prefill_bound": "compute" if bool(r.prefill_compute_bound.reshape(-1)[0]) else "memory",
        "critical_batch": item(r.critical_batch), "weight_bytes_per_gpu": r.weight_bytes_per_gpu,
        "kv_bytes_per_gpu": item(r.kv_bytes_per_gpu), "model": spec.name, "hardware": hw.name,
        "tp": tp, "batch": batch, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "assumptions": {k: v["value"] for k, v in assumptions.explain().items()},
    }
    if not report["feasible"]:
        report.update(ttft_s=None, itl_s=None, tokens_per_s=None)
    report["batch_sweep"] = _batch_sweep(spec, hw, report["max_concurrency"], prompt_tokens, output_tokens, tp,
                                         weight_dtype, kv_dtype, assumptions)
    if json:
        return emit_json(report)
    verdict = "[green]fits[/]" if report["feasible"] else f"[red]infeasible: {report['reason']}[/]"
    console.print(f"[bold]{spec.name}[/] on {hw.name}, TP{tp}, batch {batch}, {prompt_tokens} + {output_tokens} tokens — {verdict}")
    rows = [("TTFT (prefill)", seconds(report["ttft_s"]), report["prefill_bound"] + "-bound"),
            ("ITL (decode step)", seconds(report["itl_s"]), report["bound"] + "-bound"),
            ("decode tokens/s", human(report["tokens_per_s"], "") if report["tokens_per_s"] else "—", ""),
            ("KV bytes per token", human(report["kv_bytes_per_token"], "B"), ""),
            ("weights per GPU", human(report["weight_bytes_per_gpu"], "B"), ""),
            ("KV cache of the batch per GPU", human(report["kv_bytes_per_gpu"], "B"), ""),
            ("max concurrent sequences", report["max_concurrency"], ""),
            ("batch where decode turns compute-bound", f"{report['critical_batch']:.0f}" if np.isfinite(report["critical_batch"]) else "never (KV reads grow as fast)", "")]
    console.print(table("serving", rows))
    if report["batch_sweep"]:
        console.print(table("decode throughput against batch", [
            (b["batch"], seconds(b["itl_s"]), human(b["tokens_per_s"], ""), b["bound"]) for b in report["batch_sweep"]],
            ("batch", "ITL", "tokens/s", "bound")))
    if explain:
        console.print(assumptions_table(assumptions.explain()))


def _batch_sweep(spec, hw, max_concurrency, prompt_tokens, output_tokens, tp, weight_dtype, kv_dtype, assumptions):
    """Decode ITL and tokens/s at batch 1, 2, 4, ... up to the most sequences that fit."""
    batches = np.array([b for b in 2 ** np.arange(20) if b <= max_concurrency] or [], dtype=float)
    if batches.size == 0:
        return []
    r = predict_inference(spec, hw, batches, prompt_tokens, output_tokens, tp, weight_dtype, kv_dtype, assumptions)
    return [{"batch": int(b), "itl_s": float(i), "tokens_per_s": float(t), "bound": "compute" if c else "memory"}
            for b, i, t, c in zip(batches, r.itl_s, r.tokens_per_s, r.decode_compute_bound)]


def plan_command(
    model: ModelName = None, hardware: HardwareName = None,
    gpus: Annotated[int, typer.Option("--gpus", "-n", help="accelerators in the job")] = 8,
    global_batch: Annotated[int, typer.Option("--global-batch", help="sequences per step")] = 512,
    seq: Annotated[int, typer.Option("--seq", help="tokens per sequence")] = 2048,
    top: Annotated[int, typer.Option("--top", help="how many plans to show")] = 10,
    dtype: Dtype = "bf16", model_spec: ModelSpec = None, hardware_spec: HardwareSpec = None,
    assume: Assume = None, json: Json = False, explain: Explain = False,
):
    """Every valid layout of a model on a cluster, ranked by predicted throughput; the rest counted by reason."""
    spec, hw, assumptions = resolve(model, model_spec, hardware, hardware_spec, dtype, assume)
    check_positive(MAX_ACCELERATORS, gpus=gpus)
    check_positive(global_batch=global_batch, seq=seq, top=top)
    result = plan(spec, hw, gpus, global_batch, seq, assumptions)
    best, prediction = result.top(top)
    plans = []
    for i in range(best.size):
        entry = training_report(prediction, i)
        entry["layout"] = best.row(i)
        plans.append(entry)
    report = {"model": spec.name, "hardware": hw.name, "gpus": gpus, "global_batch": global_batch, "seq": seq,
              "evaluated": result.evaluated, "feasible": int(len(result.ranked)), "infeasible": result.infeasible,
              "plans": plans, "assumptions": {k: v["value"] for k, v in assumptions.explain().items()}}
    if json:
        return emit_json(report)
    console.print(f"[bold]{spec.name}[/] on {gpus} x {hw.name}, global batch {global_batch} x {seq} tokens: "
                  f"{result.evaluated} layouts evaluated, {len(result.ranked)} feasible")
    out = table("best layouts (by predicted tokens/s)", [], None)
    for name in ("#", "DP·TP·PP·CP·EP", "ZeRO", "mb", "recompute", "schedule", "step", "MFU", "tokens/s", "mem/GPU"):
        out.add_column(name, no_wrap=True)
    for rank, entry in enumerate(plans, 1):
        lay = entry["layout"]
        sched = lay["schedule"] + (f" v{lay['interleave']}" if lay["schedule"] == "interleaved" else "")
        zero = f"{lay['zero']}" + (" +offload" if lay["offload"] else "")
        out.add_row(str(rank), "·".join(str(lay[k]) for k in ("dp", "tp", "pp", "cp", "ep")), zero,
                    str(lay["micro_batch"]), lay["recompute"], sched, seconds(entry["step_s"]), f"{entry['mfu']:.1%}",
                    human(entry["tokens_per_s"], ""), human(entry["memory_per_gpu_bytes"]["total"], "B"))
    console.print(out)
    if result.infeasible:
        console.print(table("not ranked (infeasible)", sorted(result.infeasible.items(), key=lambda kv: -kv[1]), ("reason", "layouts")))
    if not plans:
        console.print("[red]no layout fits: add GPUs, lower the batch or sequence, or pick a larger accelerator[/]")
    if explain:
        console.print(assumptions_table(assumptions.explain()))


def predict_roofline(
    model: ModelName = None, hardware: HardwareName = None,
    phase: Annotated[str, typer.Option(help="prefill, decode or training")] = "decode",
    batch: Annotated[int, typer.Option("--batch", help="sequences")] = 1,
    seq: Annotated[int, typer.Option("--seq", help="prompt (prefill), context (decode) or sequence length (training)")] = 2048,
    tp: Annotated[int, typer.Option("--tp", help="tensor-parallel size")] = 1,
    flops: Annotated[Optional[float], typer.Option("--flops", help="an operation's FLOP (with --bytes, instead of a model)")] = None,
    bytes_moved: Annotated[Optional[float], typer.Option("--bytes", help="the bytes it moves to and from memory")] = None,
    dtype: Dtype = "bf16", model_spec: ModelSpec = None, hardware_spec: HardwareSpec = None, json: Json = False,
):
    """Arithmetic intensity of a phase (or of any operation) against the ridge point: which bound binds."""
    if (flops is None) != (bytes_moved is None):
        raise InvalidValue("--flops" if flops is None else "--bytes", None, "both --flops and --bytes, or a --model")
    if flops is not None:
        if model or model_spec:
            raise InvalidValue("--model", model or str(model_spec), "omitted with --flops and --bytes (an operation, "
                               "not a model's phase)")
        check_greater_than_zero(flops=flops, bytes=bytes_moved)
        hw, _ = resolve_hardware(hardware, hardware_spec, dtype)
        r, label = roofline(flops, bytes_moved, hw.peak_flops, hw.hbm_bw), f"{human(flops, 'FLOP')} over {human(bytes_moved, 'B')}"
        spec_name = "operation"
    else:
        spec, hw, _ = resolve(model, model_spec, hardware, hardware_spec, dtype, None)
        if phase not in PHASES:
            raise InvalidValue("--phase", phase, ", ".join(PHASES))
        check_positive(batch=batch, seq=seq, tp=tp)
        check_model_shape(spec, tp, seq, "--seq")
        r = phase_roofline(spec, hw.peak_flops, hw.hbm_bw, phase, batch, seq, dtype, dtype, tp)
        label, spec_name = f"{phase} (batch {batch}, {seq} tokens, TP{tp})", spec.name
    report = {"model": spec_name, "hardware": hw.name, "what": label,
              "intensity_flop_per_byte": float(r.intensity), "ridge_flop_per_byte": r.ridge,
              "attainable_flops": float(r.attainable_flops), "peak_flops": hw.peak_flops, "time_s": float(r.time_s),
              "bound": str(r.bound())}
    if json:
        return emit_json(report)
    console.print(table(f"{spec_name}: {label} on {hw.name}", [
        ("arithmetic intensity", f"{report['intensity_flop_per_byte']:.1f} FLOP/B"),
        ("ridge point", f"{r.ridge:.1f} FLOP/B"),
        ("attainable", f"{human(report['attainable_flops'], 'FLOP/s')} of {human(hw.peak_flops, 'FLOP/s')}"),
        ("ideal time", seconds(report["time_s"])), ("bound", f"{report['bound']}-bound")]))
