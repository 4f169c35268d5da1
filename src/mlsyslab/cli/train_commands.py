"""`mlsys train`: validate, tokenise the corpus, launch the ranks under torchrun's agent, print predicted vs measured."""

import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from mlsyslab.comm import fork_server
from mlsyslab.cli.options import (HardwareSpec, Json, ModelName, ModelSpec, check_output_file, check_positive,
                                  resolve_assumptions, resolve_hardware, resolve_model)
from mlsyslab.cli.render import console, emit_json, human, seconds, table
from mlsyslab.errors import InvalidValue

CACHE = Path.home() / ".cache" / "mlsyslab"
RANK_IMPORTS = ("mlsyslab.train.worker",)


def train_command(
    model: ModelName = None, model_spec: ModelSpec = None,
    strategy: Annotated[str, typer.Option(help="ddp, zero1, zero2 or zero3")] = "ddp",
    nproc: Annotated[int, typer.Option("--nproc", help="ranks on this node")] = 2,
    steps: Annotated[int, typer.Option(help="optimizer steps")] = 20,
    seq: Annotated[int, typer.Option(help="tokens per sequence")] = 128,
    global_batch: Annotated[int, typer.Option("--global-batch", help="sequences per step, all ranks")] = 8,
    micro_batch: Annotated[Optional[int], typer.Option("--micro-batch", help="sequences per microbatch per rank")] = None,
    lr: Annotated[float, typer.Option(help="AdamW learning rate (the peak, after any warmup)")] = 3e-4,
    lr_schedule: Annotated[str, typer.Option("--lr-schedule", help="constant, or cosine: decay to --min-lr-ratio · lr "
                                             "at the last step")] = "constant",
    warmup_steps: Annotated[int, typer.Option("--warmup-steps", help="linear warmup to --lr over these steps")] = 0,
    min_lr_ratio: Annotated[float, typer.Option("--min-lr-ratio", help="cosine's floor, a fraction of --lr")] = 0.1,
    clip_grad_norm: Annotated[float, typer.Option("--clip-grad-norm", help="clip the gradient to this global L2 norm "
                                                  "before each update (0: off; not under --schedule pipedream)")] = 0.0,
    bf16: Annotated[bool, typer.Option("--bf16", help="bf16 compute and communication: fp32 master weights "
                                                      "under ZeRO, bf16 weights under DDP")] = False,
    offload: Annotated[bool, typer.Option("--offload", help="optimizer state and step on the CPU (ZeRO)")] = False,
    checkpoint_dir: Annotated[Optional[Path], typer.Option("--checkpoint-dir", help="where checkpoints go")] = None,
    checkpoint_every: Annotated[int, typer.Option("--checkpoint-every", help="steps between checkpoints (0: at the end)")] = 0,
    resume: Annotated[bool, typer.Option("--resume", help="continue from the newest checkpoint in --checkpoint-dir")] = False,
    hardware: Annotated[Optional[str], typer.Option("--hardware", "-H", help="predict the step time for this hardware (local: after mlsys calibrate)")] = None,
    hardware_spec: HardwareSpec = None,
    nnodes: Annotated[int, typer.Option(help="torchrun: nodes")] = 1,
    node_rank: Annotated[int, typer.Option("--node-rank", help="torchrun: this node's rank")] = 0,
    master_addr: Annotated[Optional[str], typer.Option("--master-addr", help="torchrun: rendezvous host (multi-node)")] = None,
    master_port: Annotated[Optional[int], typer.Option("--master-port", help="torchrun: rendezvous port")] = None,
    seed: Annotated[int, typer.Option(help="weights and data order")] = 0,
    tp: Annotated[int, typer.Option("--tp", help="tensor-parallel ranks (Megatron column/row split)")] = 1,
    pp: Annotated[int, typer.Option("--pp", help="pipeline stages")] = 1,
    cp: Annotated[int, typer.Option("--cp", help="context-parallel ranks (ring attention)")] = 1,
    ep: Annotated[int, typer.Option("--ep", help="expert-parallel ranks, inside --dp (MoE models)")] = 1,
    dp: Annotated[Optional[int], typer.Option("--dp", help="data-parallel ranks (default: nproc / (tp·pp·cp))")] = None,
    schedule: Annotated[str, typer.Option(help="pipeline schedule: gpipe, 1f1b, interleaved or pipedream (a pipeline alone, untied embeddings)")] = "1f1b",
    microbatches: Annotated[Optional[int], typer.Option("--microbatches", help="microbatches per step per data-parallel rank (sets --micro-batch)")] = None,
    interleave: Annotated[int, typer.Option(help="model chunks per pipeline rank (--schedule interleaved)")] = 1,
    sequence_parallel: Annotated[bool, typer.Option("--sequence-parallel", help="under --tp: norms and residuals on "
                                                    "1/tp of the sequence, reduce-scatter + all-gather for all-reduce")] = False,
    timeline: Annotated[Optional[Path], typer.Option(help="under --pp: draw the last step's executed timeline here "
                                                     "(.png chart, or .json Chrome / Perfetto trace)")] = None,
    json: Json = False,
):
    """Train the nn/ Llama on a real corpus with DDP or ZeRO, or on a DP × PP × CP × TP mesh; end with
    predicted vs measured bytes, bubble and time."""
    _check_launch(nproc, nnodes, node_rank, master_port)
    check_positive(tp=tp, pp=pp, cp=cp, ep=ep, dp=dp, steps=steps, seq=seq, global_batch=global_batch,
                   micro_batch=micro_batch, microbatches=microbatches)  # before the layout's arithmetic divides by them
    fork_server.start(RANK_IMPORTS)  # the ranks' server imports torch beside this process, which does next
    from mlsyslab.train.trainer import TrainConfig
    from mlsyslab.verify.training import compare_mesh_training, compare_training

    if micro_batch is not None and microbatches is not None:
        raise InvalidValue("--microbatches", microbatches, "omitted with --micro-batch (each sets the other)")
    if timeline is not None:
        check_output_file("--timeline", timeline, (".png", ".json"))
    spec = resolve_model(model, model_spec)
    config = TrainConfig(model=spec.model_dump(), strategy=strategy, nproc=nproc * nnodes, steps=steps, seq=seq,
                         global_batch=global_batch, micro_batch=1, lr=lr, lr_schedule=lr_schedule,
                         warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio, clip_grad_norm=clip_grad_norm,
                         bf16=bf16, offload=offload, seed=seed,
                         checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None,
                         checkpoint_every=checkpoint_every, resume=resume, tp=tp, pp=pp, cp=cp, ep=ep, dp=dp,
                         schedule=schedule, interleave=interleave, timeline=str(timeline.resolve()) if timeline else None,
                         sequence_parallel=sequence_parallel)
    config.micro_batch = micro_batch if micro_batch is not None else _micro_batch(config, microbatches)
    config.validate()
    hw, measured = resolve_hardware(hardware, hardware_spec, "bf16" if bf16 else "fp32") if (hardware or hardware_spec) else (None, {})
    assumptions = resolve_assumptions(None, measured)
    from mlsyslab.train.corpus import corpus_tokens, tokenizer_vocab

    vocab = tokenizer_vocab()
    if spec.vocab < vocab:
        raise InvalidValue("model.vocab", spec.vocab, f">= {vocab}, the vocabulary of the SmolLM2 tokenizer the corpus uses")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from mlsyslab.comm.launch import torchrun
    from mlsyslab.train import worker

    tokens = corpus_tokens(CACHE / "corpus").numpy()
    try:
        results = torchrun(worker.main, (config, tokens, json), nproc, nnodes, node_rank, master_addr, master_port,
                           preload=RANK_IMPORTS)
    except SignalException as stop:
        name = signal.Signals(stop.sigval).name
        print(f"error: stopped by {name}: the ranks were stopped"
              + (f"; resume from the last checkpoint with --checkpoint-dir {checkpoint_dir} --resume"
                 if checkpoint_dir else ""), file=sys.stderr)
        raise typer.Exit(128 + stop.sigval)
    except ChildFailedError as failure:
        print(f"{failure}\nerror: training failed (the first rank's error is above)", file=sys.stderr)
        raise typer.Exit(1)
    if node_rank > 0:  # global rank 0, on node 0, measured the run and writes the report there
        print(f"node {node_rank} of {nnodes}: its ranks finished; node 0 prints the report", file=sys.stderr)
        return
    result = results[0]
    if resume and result["first_step"] == 0:
        print(f"note: no checkpoint in {checkpoint_dir}: started from step 0", file=sys.stderr)
    compare = compare_mesh_training if config.on_mesh else compare_training
    comparison = compare(config, result, hw, assumptions) if result["losses"] else None  # nothing ran: nothing measured
    report = {"config": config.__dict__, "result": result, "predicted_vs_measured": comparison}
    if json:
        return emit_json(report)
    _print(config, result, comparison)


def _check_launch(nproc: int, nnodes: int, node_rank: int, master_port: int | None) -> None:
    """torchrun's options, named before anything starts (torchrun itself would wait for the missing nodes)."""
    if nproc < 1:
        raise InvalidValue("nproc", nproc, "an integer >= 1 (ranks on this node)")
    if nnodes < 1:
        raise InvalidValue("nnodes", nnodes, "an integer >= 1")
    if not 0 <= node_rank < nnodes:
        raise InvalidValue("node_rank", node_rank, f"0..{nnodes - 1} (one of the --nnodes {nnodes} nodes)")
    if master_port is not None and not 1 <= master_port <= 65535:
        raise InvalidValue("master_port", master_port, "a TCP port, 1..65535")


def _micro_batch(config, microbatches: int | None) -> int:
    """Sequences per microbatch: from --microbatches when given (it must divide the data-parallel share)."""
    from mlsyslab.train.trainer import default_micro_batch

    share = config.global_batch // max(1, config.data_parallel)
    if microbatches is None:
        return default_micro_batch(config.global_batch, config.data_parallel, config.pp)
    if microbatches < 1 or share % microbatches:
        raise InvalidValue("microbatches", microbatches, f"a divisor of the {share} sequences per data-parallel rank")
    return share // microbatches


def _print(config, result, comparison) -> None:
    losses, norms = result["losses"], result.get("grad_norms")
    how = (f"dp{config.data_parallel}·pp{config.pp}·cp{config.cp}·tp{config.tp}" + (" (sp)" if config.sequence_parallel else "")
           + (f" (ep{config.ep} inside dp)" if config.ep > 1 else "")
           + (f" {config.schedule}" if config.pp > 1 else "") if config.on_mesh else config.strategy)
    console.print(f"[bold]{config.model['name']}[/] ({result['parameters']:,} parameters on rank 0), {how}"
                  f"{' + offload' if config.offload else ''}{' bf16' if config.bf16 else ''} on {config.nproc} ranks: "
                  f"steps {result['first_step'] + 1}-{config.steps}, loss {losses[0]:.4f} → {losses[-1]:.4f}, "
                  + (f"gradient norm {norms[0]:.4g} → {norms[-1]:.4g} (clipped to {config.clip_grad_norm:g}), "
                     if norms else "")
                  + f"{result['tokens_per_s']:,.0f} tokens/s" if losses else
                  f"nothing to do: the newest checkpoint in {config.checkpoint_dir} is at step {result['first_step']}"
                  + (" (no step ran: no timeline written)" if config.timeline else ""))
    if comparison is None:
        return
    fmt = lambda v: "—" if v is None else human(v, "B")  # noqa: E731
    ratio = lambda v: "—" if v is None else f"{v:.3f}"  # noqa: E731
    if "memory_bytes" in comparison:
        count = comparison.get("parameters")  # on a mesh: what rank 0 holds after TP, PP and EP
        rows = [("parameters (count)", f"{count['predicted']:,.0f}", f"{count['measured']:,}", ratio(count["ratio"]))] \
            if count else []
        console.print(table("bytes per rank (rank 0)", rows + [(k, fmt(v["predicted"]), fmt(v["measured"]),
                                                                ratio(v["ratio"]))
                                                               for k, v in comparison["memory_bytes"].items()],
                            ("category", "predicted", "measured", "measured / predicted")))
    heaviest = comparison.get("heaviest_rank")
    if heaviest and config.pp > 1:  # the stage the planner's memory per accelerator prices
        count = heaviest["parameters"]
        console.print(table(f"model states on the heaviest rank (rank {heaviest['rank']}, stage {heaviest['stage']})",
                            [("parameters (count)", f"{count['predicted']:,.0f}", f"{count['measured']:,}",
                              ratio(count["ratio"]))]
                            + [(k, fmt(v["predicted"]), fmt(v["measured"]), ratio(v["ratio"]))
                               for k, v in heaviest["memory_bytes"].items()],
                            ("category", "predicted", "measured", "measured / predicted")))
    console.print(table("bytes on the wire per step (rank 0)", [(k, fmt(v["predicted"]), fmt(v["measured"]), ratio(v["ratio"]))
                                                                for k, v in comparison["wire_bytes_per_step"].items()],
                        ("op", "predicted", "measured", "measured / predicted")))
    if comparison.get("bubble", {}).get("predicted") is not None:
        bubble = comparison["bubble"]
        share = lambda v: "—" if v is None else f"{v:.1%}"  # noqa: E731
        layers = comparison["stage_layers"]
        on_split, replayed = comparison["bubble_on_split"], comparison["bubble_replayed"]
        console.print(table("pipeline", [("bubble: analytic vs executed timeline", share(bubble["predicted"]),
                                          share(bubble["measured"]), ratio(bubble["ratio"])),
                                         ("bubble: the split's stage costs, simulated", share(on_split["predicted"]),
                                          share(on_split["measured"]), ratio(on_split["ratio"])),
                                         ("bubble: the executed actions' own times, replayed",
                                          share(replayed["predicted"]), share(replayed["measured"]),
                                          ratio(replayed["ratio"])),
                                         ("decoder layers on rank 0 (cost-balanced split)", f"{layers['predicted']:g}",
                                          str(layers["measured"]), ratio(layers["ratio"]))]
                                        + ([(f"activations on the stage holding the most ({most['stage']})",
                                             fmt(most["predicted"]), fmt(most["measured"]), ratio(most["ratio"]))]
                                           if (most := comparison.get("heaviest_activations")) else []),
                            ("", "predicted", "measured", "measured / predicted")))
        if config.timeline:
            console.print(f"the last step's executed timeline: {config.timeline}")
    step = comparison["step_s"]
    console.print(table("step time", [("median step", seconds(step["predicted"]) if step["predicted"] else "— (pass --hardware local)",
                                       seconds(step["measured"]), ratio(step["ratio"]))],
                        ("", "predicted", "measured", "measured / predicted")))
