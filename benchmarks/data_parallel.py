"""How fast is a training step under our DDP and ZeRO-1/2/3 (+ offload), beside PyTorch's and DeepSpeed's?

One model, one step, stage for stage, 4 local gloo ranks on the CPU (one intra-op thread each):
a 22 M-parameter Llama (`mlsyslab.nn.llama`, hidden 384, 6 layers, 6 heads / 2 KV heads, SwiGLU 1024,
vocab 16384, untied embeddings), fp32, micro batch 2 × 128 tokens per rank, AdamW (lr 1e-3, weight
decay 0.1, torch's default implementation), the same initial weights and the same random tokens for
every strategy. One step = forward + cross-entropy, backward, optimizer step, zero_grad, after a
barrier; a step's time is its slowest rank's; the result is the median over the timed steps after
warm-up (pooled over `--rounds`, each round running every strategy once, in reverse order on odd rounds).

| stage         | ours                                   | peers                                                        |
|---------------|----------------------------------------|--------------------------------------------------------------|
| ddp           | parallel.ddp.DataParallel (25 MB)      | torch DDP (25 MB buckets); DeepSpeed ZeRO-0                  |
| zero1         | ZeroDataParallel(stage=1)              | torch DDP + ZeroRedundancyOptimizer; DeepSpeed ZeRO-1        |
| zero2         | ZeroDataParallel(stage=2)              | FSDP2 fully_shard(reshard_after_forward=False); DeepSpeed ZeRO-2 |
| zero3         | ZeroDataParallel(stage=3), units=layers | FSDP2 fully_shard(reshard_after_forward=True); DeepSpeed ZeRO-3 |
| zero2+offload | ZeroDataParallel(stage=2, offload)     | FSDP2 (False) + CPUOffloadPolicy(pin_memory=False); DeepSpeed ZeRO-2 offload_optimizer |
| zero3+offload | ZeroDataParallel(stage=3, offload)     | FSDP2 (True) + CPUOffloadPolicy(pin_memory=False); DeepSpeed ZeRO-3 offload_optimizer + offload_param |

FSDP2 shards each decoder layer and then the root (the same units as our ZeRO-3). Every peer runs
with its defaults otherwise. A reference row, "local", trains the same model on every rank with no
communication at all: the compute floor under the same CPU contention. DeepSpeed runs in its own
interpreter (benchmarks/.peers/deepspeed; the script benchmarks/peers/deepspeed_llama.py holds a
plain-torch copy of the model and never imports mlsyslab); without that venv the DeepSpeed rows are
skipped and the script prints how to create it. Every strategy starts in fresh processes. The copy runs the plain
PyTorch ops, so ours and torch's run them too: the C++ kernels are switched off for the whole benchmark
(MLSYS_CPU_KERNELS=0; with them the model's own backward is faster: `nn.training_kernels`).
The mean loss of each step is recorded for every strategy: equal losses show equal work. So is the
share of the CPUs other processes used while a strategy ran ("others", from /proc/stat minus this
benchmark's own CPU time): on a shared machine, a row with a large share is not comparable.

ratio = fastest peer's step time / our step time (> 1: ours is faster). Goal (issue 3): >= 1 for every stage.
Run from the repository root: `python benchmarks/data_parallel.py` (~9 min per round);
`--only ours-zero3,fsdp2-zero3 --steps 3 --warmup 1` for a trial; `--profile ours-zero3` prints
torch.profiler's table for rank 0 over 3 steps instead of benchmarking. Writes
benchmarks/results/data_parallel.json. Nothing is asserted: it reports.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from record import ROOT, OtherProcesses, machine, save  # benchmarks/record.py

os.environ["MLSYS_CPU_KERNELS"] = "0"  # before anything loads them: every strategy on DeepSpeed's copy's ops

from mlsyslab.comm import heap
from mlsyslab.comm.launch import spawn
from mlsyslab.nn.llama import Llama, LlamaConfig
from mlsyslab.parallel.ddp import DataParallel
from mlsyslab.parallel.zero import ZeroDataParallel

RESULTS = ROOT / "benchmarks" / "results" / "data_parallel.json"
PEER_PYTHON = ROOT / "benchmarks" / ".peers" / "deepspeed" / "bin" / "python"
PEER_SCRIPT = ROOT / "benchmarks" / "peers" / "deepspeed_llama.py"
WORLD = 4
MODEL = dict(vocab=16384, hidden=384, layers=6, heads=6, kv_heads=2, head_dim=64, ffn_hidden=1024,
             rope_theta=10000.0, rms_norm_eps=1e-5, tied_embeddings=False, max_seq=2048)
SPEC = dict(config=MODEL, micro=2, seq=128, warmup=3, steps=10, lr=1e-3, weight_decay=0.1, seed=0,
            world=WORLD, threads_per_rank=1)

# name: (stage row, who, description)
STRATEGIES = {
    "local": ("reference", "none", "no communication: each rank trains alone"),
    "ours-ddp": ("ddp", "ours", "DataParallel, 25 MB buckets"),
    "torch-ddp": ("ddp", "peer", "torch DDP, 25 MB buckets"),
    "deepspeed-zero0": ("ddp", "peer", "DeepSpeed ZeRO stage 0"),
    "ours-zero1": ("zero1", "ours", "ZeroDataParallel stage 1"),
    "torch-zero1": ("zero1", "peer", "torch DDP + ZeroRedundancyOptimizer"),
    "deepspeed-zero1": ("zero1", "peer", "DeepSpeed ZeRO stage 1"),
    "ours-zero2": ("zero2", "ours", "ZeroDataParallel stage 2"),
    "fsdp2-zero2": ("zero2", "peer", "FSDP2 reshard_after_forward=False"),
    "deepspeed-zero2": ("zero2", "peer", "DeepSpeed ZeRO stage 2"),
    "ours-zero3": ("zero3", "ours", "ZeroDataParallel stage 3, units = decoder layers"),
    "fsdp2-zero3": ("zero3", "peer", "FSDP2 reshard_after_forward=True"),
    "deepspeed-zero3": ("zero3", "peer", "DeepSpeed ZeRO stage 3"),
    "ours-zero2-offload": ("zero2+offload", "ours", "ZeroDataParallel stage 2, offload=True"),
    "fsdp2-zero2-offload": ("zero2+offload", "peer", "FSDP2 reshard_after_forward=False, CPUOffloadPolicy(pin_memory=False)"),
    "deepspeed-zero2-offload": ("zero2+offload", "peer", "DeepSpeed ZeRO stage 2, offload_optimizer cpu"),
    "ours-zero3-offload": ("zero3+offload", "ours", "ZeroDataParallel stage 3, offload=True, units = decoder layers"),
    "fsdp2-zero3-offload": ("zero3+offload", "peer", "FSDP2 reshard_after_forward=True, CPUOffloadPolicy(pin_memory=False)"),
    "deepspeed-zero3-offload": ("zero3+offload", "peer", "DeepSpeed ZeRO stage 3, offload_optimizer + offload_param cpu"),
    "deepspeed-local": ("reference", "none", "the DeepSpeed script's model copy, no DeepSpeed, no communication"),
}
STAGES = ("ddp", "zero1", "zero2", "zero3", "zero2+offload", "zero3+offload")
DEEPSPEED = {"deepspeed-local": (-1, False), "deepspeed-zero0": (0, False), "deepspeed-zero1": (1, False),
             "deepspeed-zero2": (2, False), "deepspeed-zero3": (3, False), "deepspeed-zero2-offload": (2, True),
             "deepspeed-zero3-offload": (3, True)}


def batch(spec, step, rank):
    """The same random tokens for every strategy, per (step, rank); also in peers/deepspeed_llama.py."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(spec["config"]["vocab"], (spec["micro"], spec["seq"] + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def build(rank, name: str, spec: dict):
    """The model wrapped for strategy `name`: (module to call, step function) — step includes zero_grad."""
    model = Llama(LlamaConfig(**spec["config"])).initialize(generator=torch.Generator().manual_seed(spec["seed"]))

    def adamw(params):
        return torch.optim.AdamW(params, lr=spec["lr"], weight_decay=spec["weight_decay"])

    def plain(wrapped, optimizer):
        def step():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return wrapped, step

    if name == "local":
        return plain(model, adamw(model.parameters()))
    if name == "ours-ddp":
        wrapped = DataParallel(model, rank)
        return plain(wrapped, adamw(wrapped.parameters()))
    if name.startswith("ours-zero"):
        stage = int(name[len("ours-zero")])
        zero = ZeroDataParallel(model, rank, stage, adamw, offload=name.endswith("offload"),
                                units=list(model.layers) if stage == 3 else None)

        def step():
            zero.step()
            zero.zero_grad()
        return zero, step
    if name in ("torch-ddp", "torch-zero1"):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
        if name == "torch-ddp":
            return plain(wrapped, adamw(wrapped.parameters()))
        optimizer = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.AdamW,
                                            lr=spec["lr"], weight_decay=spec["weight_decay"])
        return plain(wrapped, optimizer)
    if name.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        mesh = init_device_mesh("cpu", (rank.world_size,))
        options = dict(mesh=mesh, reshard_after_forward=name.startswith("fsdp2-zero3"),
                       offload_policy=CPUOffloadPolicy(pin_memory=False) if name.endswith("offload") else OffloadPolicy())
        for layer in model.layers:
            fully_shard(layer, **options)
        fully_shard(model, **options)
        return plain(model, adamw(model.parameters()))
    raise ValueError(f"strategy {name!r} is not one of {', '.join(STRATEGIES)}")


def _train(rank, name: str, spec: dict, profile: bool):
    forward, step = build(rank, name, spec)
    phases, losses = [], []
    profiler = None
    total = spec["warmup"] + spec["steps"]
    for index in range(total):
        if profile and rank.rank == 0 and index == spec["warmup"]:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False)
            profiler.__enter__()
        x, y = batch(spec, index, rank.rank)
        dist.barrier()
        t0 = time.perf_counter()
        logits = forward(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        step()
        t3 = time.perf_counter()
        phases.append((t1 - t0, t2 - t1, t3 - t2))
        losses.append(loss.item())
    table = None
    if profiler is not None:
        profiler.__exit__(None, None, None)
        table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    return {"phases": phases, "losses": losses, "threads": torch.get_num_threads(), "profile": table}


def run_ours_or_torch(name: str, spec: dict, profile: bool = False) -> list:
    return spawn(_train, spec["world"], name, spec, profile, timeout_s=900, threads_per_rank=spec["threads_per_rank"])


def run_deepspeed(name: str, spec: dict) -> list:
    stage, offload = DEEPSPEED[name]
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "out.json"
        cmd = [str(PEER_PYTHON), str(PEER_SCRIPT), "--spec", json.dumps(spec), "--stage", str(stage), "--output", str(output)]
        if offload:
            cmd.append("--offload")
        env = {**os.environ, "DS_ACCELERATOR": "cpu", **heap.environment()}  # our ranks' allocator setting
        env.pop("PYTHONPATH", None)
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=env, timeout=1800)
        if done.returncode != 0 or not output.exists():
            raise RuntimeError(f"{name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        result = json.loads(output.read_text())
    for r in result["ranks"]:
        r["deepspeed"], r["ds_config"] = result["deepspeed"], result["ds_config"]
    return result["ranks"]


def summarise(name: str, runs: list, spec: dict) -> dict:
    """runs: one list of per-rank results per round → the step time (median of per-step maxima) and phases."""
    steps, phases, losses = [], [], None
    for per_rank in runs:
        warm = spec["warmup"]
        for i in range(warm, warm + spec["steps"]):
            per_step = [r["phases"][i] for r in per_rank]
            steps.append(max(sum(p) for p in per_step))
            phases.append([statistics.mean(p[k] for p in per_step) for k in range(3)])
        losses = [statistics.mean(r["losses"][i] for r in per_rank) for i in range(len(per_rank[0]["losses"]))]
    stage, who, description = STRATEGIES[name]
    return {"name": name, "stage": stage, "who": who, "description": description,
            "step_s": statistics.median(steps), "steps_s": steps,
            "forward_s": statistics.median(p[0] for p in phases), "backward_s": statistics.median(p[1] for p in phases),
            "optimizer_s": statistics.median(p[2] for p in phases), "mean_losses": losses,
            "threads_per_rank": runs[0][0]["threads"],
            **({"deepspeed": runs[0][0]["deepspeed"], "ds_config": runs[0][0]["ds_config"]} if "deepspeed" in runs[0][0] else {})}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated strategy names (default: all)")
    parser.add_argument("--steps", type=int, default=SPEC["steps"])
    parser.add_argument("--warmup", type=int, default=SPEC["warmup"])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--profile", help="profile rank 0 of this strategy over 3 steps and print the table")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()
    spec = {**SPEC, "steps": args.steps, "warmup": args.warmup}
    if args.profile:
        spec = {**spec, "steps": 3, "warmup": 2}
        ranks = run_ours_or_torch(args.profile, spec, profile=True)
        print(ranks[0]["profile"])
        return
    names = args.only.split(",") if args.only else list(STRATEGIES)
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        parser.error(f"unknown strategy {', '.join(unknown)} (valid: {', '.join(STRATEGIES)})")
    have_deepspeed = PEER_PYTHON.exists()
    if not have_deepspeed and any(n in DEEPSPEED for n in names):
        print(f"DeepSpeed peer not found at {PEER_PYTHON.relative_to(ROOT)}; its rows are skipped. To create it:\n"
              "  python3 -m venv benchmarks/.peers/deepspeed && "
              "DS_BUILD_OPS=0 benchmarks/.peers/deepspeed/bin/pip install torch==2.13.0 deepspeed\n")
        names = [n for n in names if n not in DEEPSPEED]

    out = {**machine(torch=torch.__version__), "spec": spec, "rounds": args.rounds,
           "parameters": sum(p.numel() for p in Llama(LlamaConfig(**MODEL)).parameters())}
    runs: dict = {n: [] for n in names}
    others: dict = {n: [] for n in names}
    failures: dict = {}
    began = time.perf_counter()
    for round_index in range(args.rounds):
        for name in (names if round_index % 2 == 0 else names[::-1]):
            if name in failures:
                continue
            start, competing = time.perf_counter(), OtherProcesses()
            try:
                runs[name].append(run_deepspeed(name, spec) if name in DEEPSPEED else run_ours_or_torch(name, spec))
            except Exception as error:  # a peer that cannot run here is reported, the rest goes on
                failures[name] = str(error)
                print(f"{name}: FAILED\n{str(error)[-1500:]}", file=sys.stderr)
                continue
            wall = time.perf_counter() - start
            # CPU the rest of the machine used meanwhile: other people's work competing with this run.
            others[name].append(competing.share())
            print(f"  round {round_index + 1}: {name} done in {wall:.0f} s; other processes used {others[name][-1]:.0%} of the CPUs",
                  file=sys.stderr)
    out["wall_s"] = time.perf_counter() - began
    out["strategies"] = {n: {**summarise(n, runs[n], spec), "other_processes_cpu_share": max(others[n])}
                         for n in names if runs[n]}
    out["failures"] = failures
    out["stages"] = compare(out["strategies"])
    save(out, args.output, print_table)


def compare(strategies: dict) -> list:
    rows = []
    for stage in STAGES:
        ours = [s for s in strategies.values() if s["stage"] == stage and s["who"] == "ours"]
        peers = [s for s in strategies.values() if s["stage"] == stage and s["who"] == "peer"]
        if not ours:
            continue
        fastest = min(peers, key=lambda s: s["step_s"]) if peers else None
        rows.append({"stage": stage, "ours": ours[0]["name"], "ours_step_s": ours[0]["step_s"],
                     "fastest_peer": fastest and fastest["name"], "fastest_peer_step_s": fastest and fastest["step_s"],
                     "ratio": fastest["step_s"] / ours[0]["step_s"] if fastest else None,
                     "goal_met": fastest["step_s"] >= ours[0]["step_s"] if fastest else None,
                     "peers": {p["name"]: p["step_s"] for p in peers}})
    return rows


def print_table(out):
    spec = out["spec"]
    print(f"\n{out['date_utc']}, {out['cpus']} CPUs, {spec['world']} gloo ranks x {spec['threads_per_rank']} thread; "
          f"{out['parameters'] / 1e6:.1f} M-parameter Llama, fp32, {spec['micro']} x {spec['seq']} tokens per rank, AdamW; "
          f"median of {spec['steps']} steps x {out['rounds']} round(s) after {spec['warmup']} warm-up; load average "
          f"{out['load_avg_start'][0]:.2f} at start, {out['load_avg_end'][0]:.2f} at end; {out['wall_s']:.0f} s")
    print(f"\n{'strategy':<26}{'step':>9}{'forward':>9}{'backward':>10}{'optim':>9}  {'others':>6}  loss first -> last")
    for s in out["strategies"].values():
        losses = s["mean_losses"]
        print(f"{s['name']:<26}{s['step_s']:>8.3f}s{s['forward_s']:>8.3f}s{s['backward_s']:>9.3f}s{s['optimizer_s']:>8.3f}s"
              f"  {s['other_processes_cpu_share']:>6.0%}  {losses[0]:.4f} -> {losses[-1]:.4f}")
    for name, error in out["failures"].items():
        print(f"{name:<26}  FAILED: {error.strip().splitlines()[-1][:100]}")
    print(f"\n{'stage':<15}{'ours':>9}  {'fastest peer':<26}{'peer':>9}{'peer/ours':>11}  goal >= 1")
    for r in out["stages"]:
        if r["fastest_peer"] is None:
            print(f"{r['stage']:<15}{r['ours_step_s']:>8.3f}s  (no peer ran)")
            continue
        print(f"{r['stage']:<15}{r['ours_step_s']:>8.3f}s  {r['fastest_peer']:<26}{r['fastest_peer_step_s']:>8.3f}s"
              f"{r['ratio']:>10.2f}x  {'met' if r['goal_met'] else 'missed'}")


if __name__ == "__main__":
    main()
