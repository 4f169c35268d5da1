"""Pipeline schedules executed on this machine: our executor beside `torch.distributed.pipelining`, and
the bubble measured from our executed timeline beside the schedule's analytic one.

    python benchmarks/pipeline.py           # ~3 min on 2 cores; writes benchmarks/results/pipeline.json

p = 2 spawned ranks (gloo, one thread each, one core each), m = 8 microbatches of 2 sequences x 128
tokens, an 8-layer Llama (hidden 512, FFN 1536, fp32) cut into equal stages; for GPipe, 1F1B and
interleaved 1F1B (v = 2). Its vocabulary is 128 words so that the stages are equal: the analytic bubble assumes they
are, and the last stage also runs the final norm, the output layer and the loss — with 512 words the chunk holding
them took 8-10% longer than the other three under v = 2 (2026-12-02, Sapphire Rapids host: 102-107 against 93-98 ms a
forward), adding ~2 points to every interleaved bubble; with 128 they cost ~1% of a 2-layer chunk:
- ours: `parallel.pipeline.PipelineRank.step` (schedule as data, send/recv on our Wire);
- torch: `ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B` over `PipelineStage`s of the
  very same stage modules (`parallel.pipeline.StageChunk`) and weights.
Each step is forward + backward + SGD; the time is the slowest rank's, best and median of 5 steps
after 2 warm-ups, ours and torch's alternating step by step so both see the same machine ("paired": the median of
the steps' own ratios). The first
step's losses of the two must agree (a check, printed). The measured bubble is
`parallel.pipeline.executed_timeline` of the spans both ranks executed (a span starts when its input has
arrived: waiting on the neighbour is idle), median over the timed steps; the analytic one is
((p−1)/v) / (m + (p−1)/v), of equal stages; "replayed" (`parallel.pipeline.replayed_timeline`) is the schedule run
with each action taking the time it took, its input there when the action it needs ends: what the ranks' own
compute times leave. Executed above replayed is the executor's cost (transfers, late receives); replayed above
analytic, ranks that computed the same work at different speeds. Only p = 2 is measured: with more ranks than
the 2 cores, ranks would share cores and the timeline would measure the scheduler of the OS.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from record import ROOT, OtherProcesses, machine, paired_ratio, save  # benchmarks/record.py
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from mlsyslab.comm.launch import spawn
from mlsyslab.nn.llama import Llama, LlamaConfig
from mlsyslab.parallel.pipeline import PipelineRank, StageChunk, executed_timeline, replayed_timeline, split
from mlsyslab.parallel.schedules import build

RESULTS = ROOT / "benchmarks" / "results" / "pipeline.json"
CONFIG = LlamaConfig(vocab=128, hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, ffn_hidden=1536,
                     tied_embeddings=False, max_seq=128)
SCHEDULES = (("gpipe", 1, ScheduleGPipe), ("1f1b", 1, Schedule1F1B), ("interleaved", 2, ScheduleInterleaved1F1B))
LR = 1e-3


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def run_rank(rank, microbatches: int, warmups: int, steps: int, seq: int):
    ids = torch.randint(0, CONFIG.vocab, (microbatches * 2, seq + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    out = {}
    for name, chunks, torch_schedule in SCHEDULES:
        p = rank.world_size
        ours = PipelineRank(Llama(CONFIG).initialize(generator=torch.Generator().manual_seed(0)), rank,
                            build(name, p, microbatches, chunks))
        ours_optimizer = torch.optim.SGD(ours.chunks.parameters(), lr=LR)
        theirs_model = Llama(CONFIG).initialize(generator=torch.Generator().manual_seed(0))
        bounds = split(theirs_model, p * chunks)
        stage_modules = [StageChunk(theirs_model, *bounds[c * p + rank.rank]) for c in range(chunks)]
        stages = [PipelineStage(module, c * p + rank.rank, p * chunks, torch.device("cpu"), group=rank.group)
                  for c, module in enumerate(stage_modules)]
        theirs = torch_schedule(stages if chunks > 1 else stages[0], microbatches, loss_fn=loss_fn)
        theirs_optimizer = torch.optim.SGD([q for m in stage_modules for q in m.parameters()], lr=LR)

        def ours_step():
            loss, spans = ours.step(inputs, targets)
            ours_optimizer.step()
            ours_optimizer.zero_grad(set_to_none=True)
            return loss, spans

        def theirs_step():
            losses = []
            last = rank.rank == p - 1
            if rank.rank == 0:
                theirs.step(inputs, target=targets if last else None, losses=losses)
            else:
                theirs.step(target=targets if last else None, losses=losses)
            theirs_optimizer.step()
            theirs_optimizer.zero_grad(set_to_none=True)
            return float(torch.stack(losses).detach().mean()) if losses else None

        times = {"ours": [], "torch": []}
        spans_per_step = []
        first_loss = {}
        for step in range(warmups + steps):
            for who, run in (("ours", ours_step), ("torch", theirs_step)):
                dist.barrier(group=rank.group)
                began = time.perf_counter()
                result = run()
                elapsed = time.perf_counter() - began
                if step == 0:
                    first_loss[who] = result[0] if who == "ours" else result
                if step >= warmups:
                    times[who].append(elapsed)
                    if who == "ours":
                        spans_per_step.append([(a, s, e) for a, s, e in result[1]])
        out[name] = {"times": times, "spans": spans_per_step, "first_loss": first_loss}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmups", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--output", default=RESULTS)
    args = parser.parse_args()
    out = {**machine(torch=torch.__version__), "workload": vars(args) | {"output": str(args.output)}, "rows": []}
    others = OtherProcesses()
    ranks = spawn(run_rank, 2, args.microbatches, args.warmups, args.steps, args.seq, timeout_s=1800)
    share = others.share()
    for name, chunks, torch_schedule in SCHEDULES:
        slowest = {who: [max(r[name]["times"][who][i] for r in ranks) for i in range(args.steps)]
                   for who in ("ours", "torch")}
        schedule = build(name, 2, args.microbatches, chunks)
        spans = [[r[name]["spans"][i] for r in ranks] for i in range(args.steps)]
        bubbles = [executed_timeline(schedule, step).bubble for step in spans]
        replayed = [replayed_timeline(schedule, step).bubble for step in spans]
        losses = {who: next(r[name]["first_loss"][who] for r in ranks if r[name]["first_loss"][who] is not None)
                  for who in ("ours", "torch")}
        out["rows"].append({
            "schedule": name, "chunks": chunks, "torch_schedule": torch_schedule.__name__,
            "ours_best_s": min(slowest["ours"]), "ours_median_s": statistics.median(slowest["ours"]),
            "torch_best_s": min(slowest["torch"]), "torch_median_s": statistics.median(slowest["torch"]),
            "speedup_median": statistics.median(slowest["torch"]) / statistics.median(slowest["ours"]),
            "speedup_paired": paired_ratio(slowest["torch"], slowest["ours"]),
            "bubble_measured": statistics.median(bubbles), "bubble_replayed": statistics.median(replayed),
            "bubble_analytic": schedule.analytic_bubble,
            "first_loss_ours": losses["ours"], "first_loss_torch": losses["torch"], "others_cpu_share": share})
    save(out, args.output, print_table)


def print_table(out: dict) -> None:
    print(f"# pipeline, {out['date_utc']}, p=2, m={out['workload']['microbatches']}")
    print("| schedule | ours median (best) | torch median (best) | torch / ours | paired | bubble measured | replayed | "
          "analytic | first loss ours / torch |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in out["rows"]:
        print(f"| {r['schedule']} (torch {r['torch_schedule']}) | {r['ours_median_s'] * 1e3:.0f} ms "
              f"({r['ours_best_s'] * 1e3:.0f}) | {r['torch_median_s'] * 1e3:.0f} ms ({r['torch_best_s'] * 1e3:.0f}) | "
              f"{r['speedup_median']:.2f}x | {r['speedup_paired']:.2f}x | {r['bubble_measured']:.1%} | "
              f"{r['bubble_replayed']:.1%} | {r['bubble_analytic']:.1%} | "
              f"{r['first_loss_ours']:.6f} / {r['first_loss_torch']:.6f} |")


if __name__ == "__main__":
    main()
