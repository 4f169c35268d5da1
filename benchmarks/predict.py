"""How fast is `mlsyslab.predict`, and how does its planner compare with a per-configuration search?

The predictor claims to be instant to start and to evaluate whole design spaces in one numpy call.
This script measures, in one run:

1. `import mlsyslab.predict` in a fresh interpreter (median of 7)             target < 0.3 s
2. `mlsys plan --model llama-3-70b --hardware h100 --gpus 512 --global-batch 1024 --seq 8192 --json`
   end to end, as a subprocess (median of 5)                                  target < 1 s
3. one `predict_training` call over >= 1,000,000 layouts: the planner's grid for Llama-3-70B on
   512 H100s, swept over global batch and sequence length (best of 3)         target >= 1,000,000 configs/s
4. the peer, MLSys·im 0.3.0 (in its own venv, benchmarks/.peers/mlsysim): `import mlsysim` (median
   of 5) and its design-space search `mlsysim.engine.dse.DSE` over tp x pp x interleave x micro batch
   x global batch x ZeRO x recompute for Llama-3.1-70B on its 512-H100 cluster, each configuration
   evaluated by `DistributedModel.solve`; and how many of the configurations it ranks do not fit.

It prints a table and writes benchmarks/results/predict.json. Nothing is asserted: it reports.
Run from the repository root: `python benchmarks/predict.py`. The peer is never imported here; it
runs in a subprocess of its own interpreter (the script PEER_DSE below does not import mlsyslab).
"""

import json
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
from record import ROOT, machine, save  # benchmarks/record.py

RESULTS = ROOT / "benchmarks" / "results" / "predict.json"
PEER_PYTHON = ROOT / "benchmarks" / ".peers" / "mlsysim" / "bin" / "python"
PLAN_ARGS = ["plan", "--model", "llama-3-70b", "--hardware", "h100", "--gpus", "512", "--global-batch", "1024",
             "--seq", "8192", "--json"]
GLOBAL_BATCHES = (128, 256, 512, 1024, 2048, 4096, 8192)
SEQS = (2048, 4096, 8192, 16384, 32768)
IMPORT_TIMER = "import time; t=time.perf_counter(); import {module}; print(time.perf_counter()-t)"

# Run by the peer's interpreter (`python -I -c`): times `import mlsysim`, then its DSE over a grid of
# training layouts of Llama-3.1-70B on 512 H100s, and prints one JSON object. DSE drops a candidate
# when the evaluator raises, or when the result has `.feasibility.status != "PASS"`; a
# DistributedResult has no `.feasibility` (whether it fits is `node_profile.feasible`), so the
# evaluator records fit itself to count how many ranked configurations do not fit.
PEER_DSE = r'''
import json, time, warnings
warnings.simplefilter("ignore")  # "batch_size < dp_size" warnings
t0 = time.perf_counter()
import mlsysim
from mlsysim.engine.dse import DSE
from mlsysim.engine.solvers.distributed import DistributedModel, ParallelismOptimizer
import_s = time.perf_counter() - t0

MODEL = mlsysim.Models.Language.Llama3_70B          # Llama-3.1-70B: 80 layers, hidden 8192, 64 heads
FLEET = mlsysim.Systems.Clusters.Training_512_H100  # 64 x DGX H100 (8 x H100 80 GB), InfiniBand HDR
GPUS, SEQ = FLEET.total_accelerators, 8192
SPACE = {"tp": [1, 2, 4, 8], "pp": [1, 2, 4, 8, 16], "v_stages": [1, 2, 4], "micro_batch": [1, 2, 4, 8],
         "global_batch": [512, 1024, 2048, 4096], "zero": [0, 1, 2, 3], "recompute": [False, True]}
calls, records = 0, []

def evaluate(p):
    global calls
    dp = GPUS // (p["tp"] * p["pp"])
    if p["global_batch"] % (dp * p["micro_batch"]) or (p["pp"] == 1 and p["v_stages"] > 1):
        raise ValueError("not a layout")  # DSE skips it; not counted as an evaluation
    calls += 1
    r = DistributedModel().solve(
        MODEL, FLEET, batch_size=p["global_batch"], seq_len=SEQ, precision="bf16",
        tp_size=p["tp"], pp_size=p["pp"], v_stages=p["v_stages"],
        microbatch_count=p["global_batch"] // (dp * p["micro_batch"]), zero_stage=p["zero"],
        activation_recomputation=p["recompute"], overlap_comm=True)
    records.append((r.effective_throughput.m_as("1/s") * SEQ, bool(r.node_profile.feasible), p))
    return r

evaluate(dict(tp=8, pp=4, v_stages=1, micro_batch=1, global_batch=1024, zero=1, recompute=True))  # warm-up
calls, records = 0, []
t0 = time.perf_counter()
best = DSE(space=SPACE, objective="maximize: effective_throughput").search(evaluate)
dse_s = time.perf_counter() - t0

ranked = sorted(records, key=lambda r: -r[0])  # DSE's own order: the objective alone, stable
first_fit = next(i for i, r in enumerate(ranked) if r[1])
t0 = time.perf_counter()
opt = ParallelismOptimizer().solve(MODEL, FLEET, batch_size=1024, seq_len=SEQ, precision="bf16")
opt_s = time.perf_counter() - t0
grid = 1
for values in SPACE.values():
    grid *= len(values)
top = best["best_result"].node_profile
print(json.dumps({
    "import_s": import_s, "grid_points": grid, "evaluations": calls, "dse_s": dse_s,
    "best": best["best_params"], "best_tokens_per_s": best["best_objective"] * SEQ, "best_fits": bool(top.feasible),
    "best_memory_per_gpu_gb": top.memory_footprint.m_as("GB"),
    "top5_not_fitting": sum(not c["result"].node_profile.feasible for c in best["top_candidates"]),
    "ranked_not_fitting": sum(not r[1] for r in ranked),
    "first_fitting_rank": first_fit + 1, "first_fitting": ranked[first_fit][2],
    "first_fitting_tokens_per_s": ranked[first_fit][0],
    "parallelism_optimizer": {"seconds": opt_s, "best": opt.best_config, "mfu": opt.best_mfu,
                              "candidates_kept": opt.total_searched},
}))
'''


def timed_run(cmd: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return time.perf_counter() - start, done.stdout


def import_seconds(python: str, module: str, repeats: int, isolated: bool = False) -> list[float]:
    """`import module` timed inside fresh interpreters (the interpreter's own start-up excluded)."""
    cmd = [python, *(["-I"] if isolated else []), "-c", IMPORT_TIMER.format(module=module)]
    return [float(timed_run(cmd)[1]) for _ in range(repeats)]


def mlsys_command() -> list[str]:
    """The `mlsys` console script installed beside this interpreter (else on PATH, else -m)."""
    beside = Path(sysconfig.get_path("scripts")) / "mlsys"
    found = str(beside) if beside.exists() else shutil.which("mlsys")
    return [found] if found else [sys.executable, "-m", "mlsyslab"]


def sweep_layouts(model, hardware):
    """The planner's grid for every (global batch, seq) pair, concatenated into one Layout."""
    from mlsyslab.predict.layout import Layout
    from mlsyslab.predict.planner import layout_grid

    grids = [layout_grid(model, hardware, 512, gb, seq) for gb in GLOBAL_BATCHES for seq in SEQS]
    return Layout(*(np.concatenate([getattr(g, f.name) for g in grids]) for f in fields(Layout)))


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def main():
    out = machine(numpy=np.__version__)

    # 1. Import time of the package in a fresh interpreter.
    times = import_seconds(sys.executable, "mlsyslab.predict", 7)
    out["import"] = {"median_s": statistics.median(times), "runs_s": times}

    # 2. The planner end to end from the command line: start-up, 31k layouts, ranking, JSON.
    cmd = mlsys_command() + PLAN_ARGS
    runs = [timed_run(cmd) for _ in range(5)]
    plan = json.loads(runs[-1][1])
    out["plan_cli"] = {"command": " ".join(["mlsys", *PLAN_ARGS]), "executable": cmd[0],
                       "median_s": statistics.median(t for t, _ in runs), "runs_s": [t for t, _ in runs],
                       "evaluated": plan["evaluated"], "feasible": plan["feasible"], "infeasible": plan["infeasible"]}

    # 3. One vectorised call over >= 1M layouts.
    from mlsyslab.predict.hardware import Hardware
    from mlsyslab.predict.training import predict_training
    from mlsyslab.specs import catalog

    model, hardware = catalog.model("llama-3-70b"), Hardware.of(*catalog.hardware("h100"))
    start = time.perf_counter()
    layouts = sweep_layouts(model, hardware)
    build_s = time.perf_counter() - start
    rss_before = peak_rss_mb()
    calls = []
    for _ in range(3):
        start = time.perf_counter()
        prediction = predict_training(model, hardware, layouts)
        calls.append(time.perf_counter() - start)
    best = min(calls)
    from mlsyslab.predict.planner import CHUNK, evaluate

    chunked = []
    for _ in range(3):  # the path `plan` uses: the same arrays in chunks of CHUNK layouts
        start = time.perf_counter()
        evaluate(model, hardware, layouts)
        chunked.append(time.perf_counter() - start)
    out["vectorised_chunked"] = {"chunk": CHUNK, "calls_s": chunked, "best_s": min(chunked),
                                 "configs_per_s": layouts.size / min(chunked), "first_call_configs_per_s": layouts.size / chunked[0]}
    out["vectorised"] = {
        "configurations": layouts.size, "global_batches": GLOBAL_BATCHES, "seqs": SEQS, "build_s": build_s,
        "calls_s": calls, "best_s": best, "configs_per_s": layouts.size / best,
        "feasible": int(prediction.feasible.sum()), "peak_rss_mb_before": rss_before, "peak_rss_mb_after": peak_rss_mb(),
    }
    del prediction, layouts

    # 3b. The serving design-space search (predict.search): a 253,440-point space, best of 3.
    from mlsyslab.predict.search import Constraint, Objective, search, serving_evaluator

    space = {"model": ["llama-3-8b", "llama-3-70b"], "hardware": ["h100", "a100", "mi300x", "h200", "l40s"],
             "weight_dtype": ["bf16", "fp8", "int4"], "tp": [1, 2, 4, 8], "batch": [2**i for i in range(11)],
             "prompt_tokens": list(range(256, 8193, 256)), "output_tokens": [64, 128, 256, 512, 1024, 2048]}
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        found = search(space, serving_evaluator(), [Constraint.parse("itl_s<=0.05")],
                       [Objective.parse("tokens_per_s_per_gpu:max"), Objective.parse("ttft_s:min")])
        runs.append(time.perf_counter() - start)
    out["search"] = {"points": found.evaluated, "ranked": int(len(found.ranked)), "calls_s": runs,
                     "points_per_s": found.evaluated / min(runs), "first_call_points_per_s": found.evaluated / runs[0]}

    # 4. The peer: its import, and its DSE over a comparable space.
    if PEER_PYTHON.exists():
        times = import_seconds(str(PEER_PYTHON), "mlsysim", 5, isolated=True)
        _, stdout = timed_run([str(PEER_PYTHON), "-I", "-c", PEER_DSE])
        dse = json.loads(stdout)
        dse["configs_per_s"] = dse["evaluations"] / dse["dse_s"]
        out["peer"] = {"name": "mlsysim 0.3.0", "import_median_s": statistics.median(times), "import_runs_s": times,
                       "dse": dse}
        out["ratios"] = {"configs_per_s_ours_over_theirs": out["vectorised"]["configs_per_s"] / dse["configs_per_s"],
                         "search_points_per_s_ours_over_theirs": out["search"]["points_per_s"] / dse["configs_per_s"],
                         "import_theirs_over_ours": out["peer"]["import_median_s"] / out["import"]["median_s"]}
    else:
        out["peer"] = None
        print(f"peer not found at {PEER_PYTHON.relative_to(ROOT)}; to create it:\n"
              "  python3 -m venv benchmarks/.peers/mlsysim && benchmarks/.peers/mlsysim/bin/pip install mlsysim==0.3.0\n")

    save(out, RESULTS, print_table)


def print_table(out):
    v, p = out["vectorised"], out["plan_cli"]
    rows = [
        ("import mlsyslab.predict (median of 7)", f"{out['import']['median_s']:.3f} s", "< 0.3 s"),
        ("mlsys plan ... --json, end to end (median of 5)", f"{p['median_s']:.3f} s", "< 1 s"),
        ("  layouts evaluated / feasible (ranked)", f"{p['evaluated']:,} / {p['feasible']:,}", ""),
        (f"predict_training, one call over {v['configurations']:,} layouts (best of 3)", f"{v['best_s']:.3f} s", ""),
        ("  configurations per second", f"{v['configs_per_s']:,.0f}", ">= 1,000,000"),
        ("  all three calls", ", ".join(f"{t:.2f}" for t in v["calls_s"]) + " s", ""),
        ("  peak RSS of this process", f"{v['peak_rss_mb_after']:,.0f} MB", ""),
        (f"planner's chunked evaluate ({out['vectorised_chunked']['chunk']:,} per call), first / best of 3",
         f"{out['vectorised_chunked']['first_call_configs_per_s']:,.0f} / {out['vectorised_chunked']['configs_per_s']:,.0f} per s",
         ">= 1,000,000"),
        (f"serving design-space search, {out['search']['points']:,} points, first / best of 3",
         f"{out['search']['first_call_points_per_s']:,.0f} / {out['search']['points_per_s']:,.0f} per s", ">= 1,000,000"),
    ]
    if out["peer"]:
        d = out["peer"]["dse"]
        rows += [
            ("mlsysim: import mlsysim (median of 5)", f"{out['peer']['import_median_s']:.3f} s", ""),
            (f"mlsysim: DSE, {d['evaluations']:,} evaluations ({d['grid_points']:,} grid points)",
             f"{d['dse_s']:.2f} s", ""),
            ("  configurations per second", f"{d['configs_per_s']:,.0f}", ""),
            ("  ranked configurations that do not fit", f"{d['ranked_not_fitting']:,} of {d['evaluations']:,}", ""),
            ("  its top 5 that do not fit", f"{d['top5_not_fitting']} of 5", ""),
            ("  rank of its first configuration that fits", f"{d['first_fitting_rank']}", ""),
            ("ratio: our configs/s / theirs", f"{out['ratios']['configs_per_s_ours_over_theirs']:,.0f}x", ""),
            ("ratio: our search points/s / their DSE configs/s", f"{out['ratios']['search_points_per_s_ours_over_theirs']:,.0f}x", ""),
            ("ratio: their import / ours", f"{out['ratios']['import_theirs_over_ours']:.1f}x", ""),
        ]
    width = max(len(r[0]) for r in rows)
    print(f"{out['date_utc']}, {out['cpus']} CPUs, load average {out['load_avg_start'][0]:.2f} at start, "
          f"{out['load_avg_end'][0]:.2f} at end")
    print(f"{'measure':<{width}}  {'result':>16}  target")
    for name, value, target in rows:
        print(f"{name:<{width}}  {value:>16}  {target}")


if __name__ == "__main__":
    main()
