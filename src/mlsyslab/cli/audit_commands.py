"""`mlsys audit`: a Markdown report (with figures) walking every wall of a training job."""

from pathlib import Path
from typing import Annotated

import typer

from mlsyslab.cli.options import (MAX_ACCELERATORS, Dtype, HardwareName, Json, ModelName, ModelSpec,
                                  check_greater_than_zero, check_positive, check_unused, resolve_assumptions,
                                  resolve_model)
from mlsyslab.cli.render import console, emit_json, human, seconds
from mlsyslab.errors import InvalidValue


def audit_command(
    model: ModelName = None, model_spec: ModelSpec = None, hardware: HardwareName = None,
    gpus: Annotated[int, typer.Option("--gpus", "-n")] = 512,
    global_batch: Annotated[int, typer.Option("--global-batch", help="sequences per step")] = 1024,
    seq: Annotated[int, typer.Option("--seq")] = 8192,
    tokens: Annotated[float, typer.Option("--tokens", help="tokens the job trains on")] = 1e12,
    region: Annotated[str, typer.Option(help="grid region (mlsys predict ops --list-regions)")] = "United States",
    storage_gbps: Annotated[float, typer.Option("--storage-gbps", help="checkpoint write bandwidth, GB/s")] = 100.0,
    out: Annotated[Path, typer.Option("--out", help="folder for report.md and its figures")] = Path("audit"),
    serve: Annotated[bool, typer.Option("--serve", help="audit a serving deployment instead of a training job")] = False,
    tp: Annotated[int, typer.Option("--tp", help="serving: accelerators per replica")] = 1,
    replicas: Annotated[int, typer.Option("--replicas", help="serving: copies of the model")] = 1,
    batch: Annotated[int, typer.Option("--batch", help="serving: sequences per replica")] = 32,
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", help="serving")] = 1024,
    output_tokens: Annotated[int, typer.Option("--output-tokens", help="serving")] = 256,
    rate: Annotated[float, typer.Option("--rate", help="serving: requests per second")] = 5.0,
    dtype: Dtype = "bf16", json: Json = False,
):
    """Compute, memory, communication, reliability (or queueing), energy, carbon and cost of a training job
    or a serving deployment (--serve), and what binds."""
    from mlsyslab.predict.audit import audit_serving, audit_training
    from mlsyslab.specs import catalog

    spec = resolve_model(model, model_spec)
    if not hardware:
        raise InvalidValue("--hardware", hardware, "a catalog accelerator or system")
    system, chip = catalog.hardware(hardware)
    check_positive(MAX_ACCELERATORS, gpus=gpus)
    check_positive(global_batch=global_batch, seq=seq)
    check_greater_than_zero(tokens=tokens, storage_gbps=storage_gbps)
    grid = catalog.grid(region)
    if serve:
        check_unused("only without --serve (a training job's; a serving audit runs --tp × --replicas accelerators)",
                     ("--gpus", gpus, 512), ("--global-batch", global_batch, 1024), ("--seq", seq, 8192),
                     ("--tokens", tokens, 1e12), ("--storage-gbps", storage_gbps, 100.0))
        check_positive(MAX_ACCELERATORS, replicas=replicas)
        check_positive(tp=tp, batch=batch, prompt_tokens=prompt_tokens, output_tokens=output_tokens)
        check_greater_than_zero(rate=rate)
    else:
        check_unused("only with --serve (a training audit plans its own layout)", ("--tp", tp, 1),
                     ("--replicas", replicas, 1), ("--batch", batch, 32), ("--prompt-tokens", prompt_tokens, 1024),
                     ("--output-tokens", output_tokens, 256), ("--rate", rate, 5.0))
    if out.exists() and not out.is_dir():
        raise InvalidValue("--out", str(out), "a folder (this is a file)")
    try:  # the last check: it leaves the folder behind
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise InvalidValue("--out", str(out), f"a folder this process can create ({error.strerror})") from None
    if serve:
        result = audit_serving(spec, system, chip, grid, tp, batch, prompt_tokens, output_tokens, rate, replicas,
                               resolve_assumptions(None), dtype=dtype)
        gpus, global_batch, seq = tp * replicas, batch, prompt_tokens + output_tokens
    else:
        result = audit_training(spec, system, chip, grid, gpus, global_batch, seq, tokens, None, storage_gbps * 1e9,
                                resolve_assumptions(None), dtype=dtype)
    figures = _figures(out, result) if result.step_breakdown_s else []  # none when nothing fits
    report = _markdown(spec.name, system.name, gpus, global_batch, seq, tokens, result, figures)
    (out / "report.md").write_text(report)
    if json:
        return emit_json({"binding": result.binding, "layout": result.layout, "sections": result.sections,
                          "report": str(out / "report.md"), "figures": [str(out / f) for f in figures]})
    console.print(f"binding constraint: [bold]{result.binding}[/] — report written to {out / 'report.md'}")


def _markdown(model, hardware, gpus, global_batch, seq, tokens, result, figures) -> str:
    lines = [f"# Audit: {model} on {gpus} x {hardware}", "",
             f"Global batch {global_batch} x {seq} tokens, {tokens:.3g} tokens in all.", "",
             f"**Binding constraint: {result.binding}.**", ""]
    if result.layout and "dp" in result.layout:
        lay = result.layout
        lines += [f"Layout (the planner's best): DP{lay['dp']} x TP{lay['tp']} x PP{lay['pp']} x CP{lay['cp']} x EP{lay['ep']}, "
                  f"ZeRO-{lay['zero']}, micro batch {lay['micro_batch']}, {lay['schedule']}, recompute {lay['recompute']}.", ""]
    for wall, quantities in result.sections.items():
        lines += [f"## {wall}", "", "| quantity | value |", "|---|---|"]
        lines += [f"| {name} | {_format(name, value)} |" for name, value in quantities.items()]
        lines.append("")
    lines += [f"![{name}]({name})" for name in figures]
    return "\n".join(lines) + "\n"


def _format(name: str, value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items())
    if not isinstance(value, (int, float)):
        return str(value)
    if name.endswith("_bytes"):
        return human(value, "B")
    if name.endswith("_s") and not name.endswith("per_s"):
        return seconds(value)
    if name.endswith("_w"):
        return human(value, "W")
    if "fraction" in name or "share" in name or name in ("mfu", "hfu", "goodput"):
        return f"{value:.1%}"
    return f"{value:,.4g}"


def _figures(out: Path, result) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    figure, axis = plt.subplots(figsize=(6, 3))
    parts = {k: v for k, v in result.step_breakdown_s.items() if v > 0}
    axis.barh(list(parts), list(parts.values()))
    axis.set_xlabel("seconds per step")
    axis.set_title("where a step goes")
    if not result.memory_bytes:  # a serving audit: where one request's time goes
        axis.set_xlabel("seconds per request")
        axis.set_title("where a request's time goes (p99 wait included)")
    figure.tight_layout()
    figure.savefig(out / "step.png", dpi=110)
    names.append("step.png")
    plt.close(figure)
    if not result.memory_bytes:
        return names
    figure, axis = plt.subplots(figsize=(6, 3))
    memory = {k: v / 1e9 for k, v in result.memory_bytes.items() if k not in ("total", "capacity", "host_offload") and v > 0}
    axis.barh(list(memory), list(memory.values()))
    axis.axvline(result.memory_bytes["capacity"] / 1e9, color="red", linestyle="--", label="usable capacity")
    axis.set_xlabel("GB per accelerator")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / "memory.png", dpi=110)
    names.append("memory.png")
    plt.close(figure)
    return names
