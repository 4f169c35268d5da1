"""`mlsys calibrate`: measure this machine as N ranks see it, and save it as a hardware spec.

Run with the same number of ranks and threads the jobs will use (on a CPU the ranks share the cores:
training ranks under torchrun run one thread each; `mlsys serve`'s engine is one rank with every
core), each rank measures, at the same time as the others:
- matmul FLOP/s for a layer's three GEMMs of widths 32…1024 as a training step runs them (the forward product, the
  input gradient and the weight gradient: transposed operands run slower than the forward one at narrow widths,
  79 against 98 GFLOP/s at width 128 on one Zen 4 core) — the fastest width is the peak, and the curve fits predict's
  efficiency η(w) = η_max · w/(w + w_half) (least squares over w_half);
- attention: torch's causal SDPA, forward and backward, at ATTENTION (batch, heads, tokens, head dim), on the FLOPs
  predict counts for it (the causal half included), over the fitted GEMM rate at that width: `attention_efficiency`;
- the vocabulary projection's extra cost: the same three products over a microbatch of 512 tokens x 128 inputs x
  49,152 outputs (SmolLM2's vocabulary, which `mlsys train`'s corpus has), beyond the time a width-128 layer GEMM's rate
  gives them, as bytes per logit at the copy bandwidth: their 100 MB of logits, written and read twice, outgrow the
  caches, and what that costs scales with the logits, not the FLOPs (0.6-0.99 of the layer rate from width 64 to 512,
  but 2-5 ns a logit at each, on one Zen 3 core);
- memory bandwidth: a large tensor copy (bytes read + written per second);
- the per-kernel overhead of eager PyTorch: a tiny op's forward + backward, per op;
- the loss: cross-entropy forward + backward over the same fp32 logits, as equivalent bytes per logit;
- the memory-bound work on the parameters, as bytes per parameter at the copy bandwidth: the trainers' AdamW step
  (`nn.optimizer.adamw`, fused: ~17 on one Zen 3 core, 40-63 op by op; 36 is predict's GPU default) and a gradient's
  accumulation (`grad += new`, done on every microbatch), over PARAMETERS fp32 weights in tensors larger than the
  last-level cache;
- the collective alpha-beta: gloo all-reduce times over 4 KB…16 MB; β from the slope of
  t = 2(n−1)·α + 2(n−1)/n · M/β, α from the 4 KB time; and the same for the shared-memory all-reduce that tensor
  parallelism (and data parallelism alone) takes between ranks of one x86 host (`comm/shared_memory.py`), as the assumptions
  `shared_memory_latency_factor` and `shared_memory_bandwidth_factor` (its α and β over gloo's; 1 where it does
  not apply); and ZeRO's pair there, an all-gather and a reduce-scatter of the same sizes (an all-reduce's ring bytes
  between them), as `shared_memory_shard_bandwidth_factor`: its β over the shared-memory all-reduce's.
Every time is the median of several timings (the twin predicts a run's median step). The result is a hardware spec (accelerator + system + the fitted assumptions) at
~/.cache/mlsyslab/hardware/local.yaml, which `--hardware local` reads.
"""

import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml

from mlsyslab.comm import shared_memory
from mlsyslab.comm.launch import Rank, spawn
from mlsyslab.measure.host import machine_memory_bytes
from mlsyslab.nn.optimizer import adamw
from mlsyslab.specs.catalog import LOCAL_HARDWARE

WIDTHS = (32, 64, 128, 256, 512, 1024)
LOGITS = (512, 49_152)  # tokens, vocabulary of the logits the head and the loss are timed over
HEAD_WIDTH = 128  # the head's inputs there (one of WIDTHS: its products' time is taken beyond that width's rate)
ALL_REDUCE_BYTES = (4_096, 65_536, 1_048_576, 4_194_304, 16_777_216)
ATTENTION = (1, 8, 256, 64)  # batch, heads, tokens, head dim of the attention timed
PARAMETERS = (4, 8_388_608)  # tensors, elements each (32 MB in fp32, past a CPU's last-level cache, as a large model's
# tensors and its embedding are): the weights the optimizer and the accumulation are timed over


def calibrate(nproc: int, path: Path = LOCAL_HARDWARE, threads: int = 1) -> dict:
    """Measure with `nproc` concurrent ranks of `threads` threads, write the spec to `path`, return it."""
    measured = spawn(_measure, nproc, timeout_s=600, threads_per_rank=threads)
    spec = _spec(nproc, threads, measured)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return spec


def _measure(rank: Rank) -> dict:
    bandwidth, matmul = _copy_bandwidth(), {w: _matmul_flops(w) for w in WIDTHS}
    return {"matmul": matmul, "bf16_matmul": _matmul_flops(512, torch.bfloat16), "attention": _attention_flops(),
            "output_projection_bytes_per_logit": _output_projection_bytes_per_logit(bandwidth, matmul[HEAD_WIDTH]),
            "bandwidth": bandwidth, "loss_bytes_per_logit": _loss_bytes_per_logit(bandwidth),
            **_parameter_bytes(bandwidth),
            "kernel_s": _kernel_overhead(), "all_reduce": _all_reduce_times(rank, dist.all_reduce),
            "shared_memory_all_reduce": _shared_memory_all_reduce_times(rank),
            "shared_memory_shard": _shared_memory_shard_times(rank)}


def _typical_time(fn, repeats: int = 5, min_s: float = 0.05) -> float:
    """The median of `repeats` timings of fn (each timing loops until `min_s` passed): the twin predicts a run's median
    step, and on a shared host the fastest timing runs ~10% under the median (AVX2 host, 2026-11-28)."""
    fn()
    timings = []
    for _ in range(repeats):
        count, start = 0, time.perf_counter()
        while True:
            fn()
            count += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_s:
                break
        timings.append(elapsed / count)
    return statistics.median(timings)


def _linear_products_s(rows: int, width: int, outputs: int, dtype=torch.float32, repeats: int = 5) -> float:
    """Seconds for a linear layer's forward, input-gradient and weight-gradient products: rows x width inputs,
    `outputs` outputs."""
    x, weight, grad = (torch.randn(*shape, dtype=dtype) for shape in ((rows, width), (outputs, width), (rows, outputs)))

    def products():
        torch.mm(x, weight.t())
        torch.mm(grad, weight)
        torch.mm(grad.t(), x)

    return _typical_time(products, repeats)


def _matmul_flops(width: int, dtype=torch.float32) -> float:
    """FLOP/s of a layer's three products at `width` inputs and outputs."""
    rows = max(256, 65_536 // width)
    return 3 * 2 * rows * width * width / _linear_products_s(rows, width, width, dtype)


def _attention_flops() -> float:
    """FLOP/s of causal SDPA forward + backward at ATTENTION, on what predict counts: 3 x 2·s·(d_qk + d_v) a token."""
    batch, heads, tokens, head_dim = ATTENTION
    q, k, v = (torch.randn(batch, heads, tokens, head_dim, requires_grad=True) for _ in range(3))

    def attention():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        q.grad = k.grad = v.grad = None

    return 3 * 2 * batch * tokens * tokens * 2 * heads * head_dim / _typical_time(attention)


def _output_projection_bytes_per_logit(bandwidth: float, layer_flops: float) -> float:
    """The head's three products over LOGITS beyond their time at a HEAD_WIDTH layer GEMM's rate (`layer_flops`), as
    the bytes per logit that take as long at `bandwidth` (0 where they keep the layer rate)."""
    rows, vocab = LOGITS
    seconds = _linear_products_s(rows, HEAD_WIDTH, vocab, repeats=3)
    return max(0.0, seconds - 3 * 2 * rows * HEAD_WIDTH * vocab / layer_flops) * bandwidth / (rows * vocab)


def _copy_bandwidth(numel: int = 32_000_000) -> float:
    source, target = torch.ones(numel), torch.empty(numel)
    return 2 * 4 * numel / _typical_time(lambda: target.copy_(source), repeats=3)


def _loss_bytes_per_logit(bandwidth: float) -> float:
    """Cross-entropy forward + backward over fp32 LOGITS, as the bytes per logit that take as long."""
    rows, vocab = LOGITS
    logits = torch.randn(rows, vocab, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,))

    def loss():
        torch.nn.functional.cross_entropy(logits, targets).backward()
        logits.grad = None

    return _typical_time(loss, repeats=3) * bandwidth / (rows * vocab)


def _parameter_bytes(bandwidth: float) -> dict:
    """An AdamW step and a gradient accumulation over PARAMETERS, as bytes per parameter at `bandwidth`."""
    tensors, numel = PARAMETERS
    weights = [torch.nn.Parameter(torch.randn(numel)) for _ in range(tensors)]
    new = [torch.randn(numel) for _ in range(tensors)]
    for weight in weights:
        weight.grad = torch.randn(numel)
    optimizer = adamw(weights)

    def accumulate():
        for weight, gradient in zip(weights, new):
            weight.grad += gradient

    per_parameter = bandwidth / (tensors * numel)
    return {"optimizer_bytes_per_parameter": _typical_time(optimizer.step, repeats=3) * per_parameter,
            "gradient_accumulation_bytes_per_parameter": _typical_time(accumulate, repeats=3) * per_parameter}


def _kernel_overhead() -> float:
    """Seconds per eager kernel: forward + backward of a 1-element op chain, per op."""
    x = torch.ones(1, requires_grad=True)
    ops = 20

    def chain():
        y = x
        for _ in range(ops):
            y = y * 1.0001
        y.backward()

    return _typical_time(chain) / (3 * ops)  # each op: forward, its backward, the gradient accumulation


def _all_reduce_times(rank: Rank, all_reduce) -> dict:
    times = {}
    for size in ALL_REDUCE_BYTES:
        tensor = torch.ones(size // 4)
        samples = []
        for _ in range(7):
            dist.barrier()
            start = time.perf_counter()
            all_reduce(tensor)
            samples.append(time.perf_counter() - start)
        times[size] = statistics.median(samples[2:])
    return times


def _shared_memory_all_reduce_times(rank: Rank) -> dict | None:
    """`_all_reduce_times` through the shared-memory all-reduce TP (and data parallelism alone) uses here, or None where
    it does not apply."""
    reducer = shared_memory.for_group(rank)
    return None if reducer is None else _all_reduce_times(rank, reducer.all_reduce)


def _shared_memory_shard_times(rank: Rank) -> dict | None:
    """`_all_reduce_times` of ZeRO's pair through shared memory: an all-gather and a reduce-scatter of the message (an
    all-reduce's ring bytes between them), or None where the shared-memory collectives do not apply."""
    reducer, n = shared_memory.for_group(rank), rank.world_size
    if reducer is None:
        return None
    shards = {}

    def gather_and_scatter(tensor: torch.Tensor) -> None:
        whole = tensor[:tensor.numel() // n * n]
        shard = shards.setdefault(whole.numel(), torch.empty(whole.numel() // n))
        reducer.all_gather(whole, shard)
        reducer.reduce_scatter(shard, whole)

    return _all_reduce_times(rank, gather_and_scatter)


def _alpha_beta(measured: list, key: str, n: int) -> tuple[float, float, np.ndarray]:
    """α, β of the ring all-reduce model fitted to the slowest rank's times under `key`, and those times."""
    sizes = np.array(ALL_REDUCE_BYTES, float)
    seconds = np.array([max(m[key][s] for m in measured) for s in ALL_REDUCE_BYTES])
    _, slope = _fit_line(sizes, seconds)
    beta = 2 * (n - 1) / n / max(slope, 1e-15)
    # α from the smallest message, where the bandwidth term is negligible (a regression's intercept is
    # noisy and can come out negative).
    alpha = max(seconds[0] - 2 * (n - 1) / n * sizes[0] / beta, 1e-7) / (2 * (n - 1))
    return alpha, beta, seconds


def _spec(nproc: int, threads: int, measured: list) -> dict:
    flops = {w: statistics.median(m["matmul"][w] for m in measured) for w in WIDTHS}
    peak = max(flops.values())
    eta_max, w_half = _fit_efficiency(np.array(WIDTHS, float), np.array([flops[w] for w in WIDTHS]) / peak)
    bandwidth = statistics.median(m["bandwidth"] for m in measured)
    kernel = statistics.median(m["kernel_s"] for m in measured)
    n = max(nproc, 2)
    alpha, beta, seconds = _alpha_beta(measured, "all_reduce", n)
    shared = all(m["shared_memory_all_reduce"] is not None for m in measured)
    shm_alpha, shm_beta, shm_seconds = _alpha_beta(measured, "shared_memory_all_reduce", n) if shared else (alpha, beta, None)
    _, shard_beta, shard_seconds = _alpha_beta(measured, "shared_memory_shard", n) if shared else (alpha, shm_beta, None)
    memory = machine_memory_bytes()
    accelerator = {
        "name": "local", "aliases": ["this-machine"], "vendor": "this machine", "kind": "cpu",
        "launch_year": time.gmtime().tm_year,
        "peak_flops": {"fp32": float(peak), "bf16": float(statistics.median(m["bf16_matmul"] for m in measured))},
        "hbm_bytes": float(memory / nproc), "hbm_bw": float(bandwidth), "sram_bytes": 1e6, "scale_up_bw": float(beta),
        "tdp_w": 1.0, "source": f"mlsys calibrate --nproc {nproc} --threads {threads}, "
                                f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "notes": f"per rank, measured while all ranks ran at once with {threads} thread(s) each",
    }
    system = {"name": "local", "accelerators_per_node": nproc, "scale_up_domain": nproc, "scale_up_name": "gloo (loopback)",
              "scale_out_bw": float(beta), "pcie_bw": float(bandwidth), "topology": "single-node",
              "source": accelerator["source"]}
    attention_width = ATTENTION[1] * ATTENTION[3]
    gemm_rate = peak * eta_max * attention_width / (attention_width + w_half)  # the fitted rate at that width
    assumptions = {"matmul_efficiency_max": float(eta_max), "matmul_half_efficiency_width": float(w_half),
                   "attention_efficiency": float(statistics.median(m["attention"] for m in measured) / gemm_rate),
                   "memory_bandwidth_efficiency": 1.0, "scale_up_efficiency": 1.0, "scale_out_efficiency": 1.0,
                   "scale_up_latency_s": float(alpha), "scale_out_latency_s": float(alpha),
                   "kernel_overhead_s": float(kernel), "data_parallel_overlap": 0.0,
                   "sequence_parallel_regather_overlap": 0.0, "eager_activations": True,  # as nn/ saves them
                   "shared_memory_latency_factor": float(shm_alpha / alpha),
                   "shared_memory_bandwidth_factor": float(shm_beta / beta),
                   "shared_memory_shard_bandwidth_factor": float(shard_beta / shm_beta),
                   "output_projection_bytes_per_logit": float(statistics.median(
                       m["output_projection_bytes_per_logit"] for m in measured)),
                   **{name: float(statistics.median(m[name] for m in measured)) for name in (
                       "loss_bytes_per_logit", "optimizer_bytes_per_parameter",
                       "gradient_accumulation_bytes_per_parameter")}}
    return {"accelerator": accelerator, "system": system, "assumptions": assumptions,
            "measured": {"matmul_flops_by_width": {int(w): float(f) for w, f in flops.items()},
                         "all_reduce_s_by_bytes": {int(s): float(t) for s, t in zip(ALL_REDUCE_BYTES, seconds)},
                         **({"shared_memory_all_reduce_s_by_bytes": {int(s): float(t) for s, t in
                                                                     zip(ALL_REDUCE_BYTES, shm_seconds)},
                             "shared_memory_all_gather_and_reduce_scatter_s_by_bytes": {
                                 int(s): float(t) for s, t in zip(ALL_REDUCE_BYTES, shard_seconds)}} if shared else {})}}


def _fit_efficiency(widths: np.ndarray, efficiency: np.ndarray) -> tuple[float, float]:
    """Least squares of efficiency = η_max · w/(w + w_half) over a grid of w_half (η_max closed form)."""
    best = (1.0, 0.0, float("inf"))
    for w_half in np.concatenate([[0.0], np.geomspace(1, 4096, 400)]):
        shape = widths / (widths + w_half)
        eta = float(shape @ efficiency / (shape @ shape))
        error = float(((eta * shape - efficiency) ** 2).sum())
        if error < best[2]:
            best = (eta, float(w_half), error)
    return best[0], best[1]


def _fit_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)
