"""`mlsys calibrate`: measure this machine and save it as the hardware `local`."""

from typing import Annotated

import typer

from mlsyslab.cli.options import Json, check_positive
from mlsyslab.cli.render import console, emit_json, human, seconds, table
from mlsyslab.comm import fork_server


def calibrate_command(
    nproc: Annotated[int, typer.Option("--nproc", help="ranks the jobs will run (they share this machine's cores)")] = 2,
    threads: Annotated[int, typer.Option("--threads", help="torch threads per rank, as the jobs will run them "
                                         "(training ranks under torchrun: 1; `mlsys serve`'s engine: every core)")] = 1,
    json: Json = False,
):
    """Matmul FLOP/s, memory bandwidth, kernel overhead, and the all-reduce alpha-beta of gloo and of the shared memory
    TP and data parallelism alone take, for N ranks → --hardware local."""
    check_positive(64, nproc=nproc, threads=threads)  # processes and threads on this machine
    fork_server.start(("mlsyslab.measure.calibrate",))  # the ranks' server imports torch beside this process
    from mlsyslab.measure.calibrate import calibrate
    from mlsyslab.specs.catalog import LOCAL_HARDWARE

    spec = calibrate(nproc, threads=threads)
    if json:
        return emit_json({"path": str(LOCAL_HARDWARE), **spec})
    chip, fitted = spec["accelerator"], spec["assumptions"]
    console.print(table(f"this machine, per rank with {nproc} ranks x {threads} threads at once → {LOCAL_HARDWARE}", [
        ("peak matmul (fp32)", human(chip["peak_flops"]["fp32"], "FLOP/s")),
        ("peak matmul (bf16)", human(chip["peak_flops"]["bf16"], "FLOP/s")),
        ("matmul efficiency fit", f"{fitted['matmul_efficiency_max']:.2f} · w/(w + {fitted['matmul_half_efficiency_width']:.0f})"),
        ("attention (causal SDPA) over the GEMMs' rate", f"{fitted['attention_efficiency']:.2f}"),
        ("vocabulary projection beyond its FLOPs", f"{fitted['output_projection_bytes_per_logit']:.1f} bytes per logit"),
        ("loss (cross-entropy, forward + backward)", f"{fitted['loss_bytes_per_logit']:.1f} bytes per logit"),
        ("optimizer step (AdamW)", f"{fitted['optimizer_bytes_per_parameter']:.1f} bytes per parameter"),
        ("gradient accumulation, per microbatch",
         f"{fitted['gradient_accumulation_bytes_per_parameter']:.1f} bytes per parameter"),
        ("memory bandwidth (copy)", human(chip["hbm_bw"], "B/s")),
        ("kernel overhead", seconds(fitted["kernel_overhead_s"])),
        ("collective alpha", seconds(fitted["scale_up_latency_s"])),
        ("collective beta (per direction)", human(chip["scale_up_bw"], "B/s")),
        ("shared-memory all-reduce alpha, beta (TP; DP alone)",
         f"{seconds(fitted['scale_up_latency_s'] * fitted['shared_memory_latency_factor'])}, "
         f"{human(chip['scale_up_bw'] * fitted['shared_memory_bandwidth_factor'], 'B/s')}"),
        ("shared-memory all-gather + reduce-scatter beta (ZeRO alone)",
         human(chip['scale_up_bw'] * fitted['shared_memory_bandwidth_factor']
               * fitted['shared_memory_shard_bandwidth_factor'], 'B/s')),
    ]))
