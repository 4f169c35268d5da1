"""LLM inference: prefill and decode time, KV cache, memory, concurrency (Pope et al. 2022).

Prefill processes the prompt's P tokens at once: 2·N_active FLOP per token plus causal attention
(average context P/2) — compute-bound. Decode produces one token per sequence per step: it must
read every weight (and each sequence's KV cache) once per step, so at small batch it is
memory-bound: t ≈ (weight bytes + B·context·KV bytes) / bandwidth, and it turns compute-bound once
B·2·N_active / peak exceeds that. TP divides weights, KV heads and FLOPs over t devices and adds
two all-reduces of the activations per layer. An MoE step reads only the experts its batch routes
to: E·(1 − (1 − k/E)^B) of them in expectation. Quantised weights (fp8/int8/int4) shrink the bytes
read; compute stays in the compute dtype.
Twin of: serve/ (`mlsys bench serve` prints measured vs predicted TPOT).
"""

from dataclasses import dataclass

import numpy as np

from mlsyslab.predict import collectives as coll
from mlsyslab.predict.architecture import kv_bytes_per_token, parameters
from mlsyslab.predict.assumptions import DEFAULT, Assumptions
from mlsyslab.predict.hardware import Hardware
from mlsyslab.predict.phases import decode_work, prefill_work
from mlsyslab.predict.training import matmul_efficiency
from mlsyslab.specs.schema import DTYPE_BYTES, Model


@dataclass(frozen=True)
class InferencePrediction:
    ttft_s: np.ndarray  # prefill of the batch's prompts
    itl_s: np.ndarray  # one decode step (inter-token latency) at mid-generation context
    tokens_per_s: np.ndarray  # decode throughput: batch / ITL
    kv_bytes_per_token: float  # whole model, all devices
    weight_bytes_per_gpu: float
    kv_bytes_per_gpu: np.ndarray  # for the batch at full context
    max_concurrency: np.ndarray  # sequences of prompt + output tokens that fit beside the weights
    decode_compute_bound: np.ndarray
    prefill_compute_bound: np.ndarray
    critical_batch: np.ndarray  # decode batch where compute time overtakes memory time (inf: never)
    feasible: np.ndarray
    reason_code: np.ndarray  # index into REASONS: 0 where feasible

    def reason(self, i: int = 0) -> str:
        return REASONS[int(np.asarray(self.reason_code).reshape(-1)[i])]


REASONS = (
    "",
    "TP does not divide the attention heads",
    "the weights do not fit in the usable memory of a device",
    "the batch's KV cache at full context does not fit beside the weights",
)


def weight_bytes(model: Model, weight_dtype: str) -> float:
    return parameters(model).total() * DTYPE_BYTES[weight_dtype]


def predict_inference(model: Model, hardware: Hardware, batch, prompt_tokens, output_tokens, tp=1,
                      weight_dtype: str | None = None, kv_dtype: str | None = None,
                      assumptions: Assumptions = DEFAULT) -> InferencePrediction:
    a, hw = assumptions, hardware
    weight_dtype, kv_dtype = weight_dtype or hw.dtype, kv_dtype or hw.dtype
    batch, prompt, output = (np.asarray(x, dtype=float) for x in (batch, prompt_tokens, output_tokens))
    t = np.asarray(tp, dtype=float)
    breakdown = parameters(model)
    w_bytes = DTYPE_BYTES[weight_dtype]
    kv_token = kv_bytes_per_token(model, kv_dtype)
    memory_bw = hw.hbm_bw * a.memory_bandwidth_efficiency
    peak = hw.peak_flops * matmul_efficiency(model.hidden / t, a)
    all_reduce = lambda message: 2 * model.layers * coll.hierarchical_all_reduce_s(  # noqa: E731
        message, t, np.minimum(t, hw.scale_up_domain),
        hw.scale_up_bw * a.scale_up_efficiency * a.shared_memory_bandwidth_factor,
        a.scale_up_latency_s * a.shared_memory_latency_factor, hw.scale_out_bw * a.scale_out_efficiency,
        a.scale_out_latency_s)

    # Prefill: all prompt tokens of the batch in one pass; causal attention.
    tokens = batch * prompt
    prefill_flops, prefill_bytes = prefill_work(model, batch, prompt, weight_dtype, kv_dtype, t)
    prefill_compute, prefill_memory = prefill_flops / peak, prefill_bytes / memory_bw
    # Host time per forward pass: an eager framework launches every kernel from the CPU (on a CPU, or
    # a GPU whose launches do not overlap); `mlsys calibrate` measures the time per kernel, 0 elsewhere.
    launches = a.kernel_overhead_s * a.kernels_per_layer * model.layers
    ttft = np.maximum(prefill_compute, prefill_memory) + all_reduce(tokens * model.hidden * DTYPE_BYTES[hw.dtype]) + launches

    # Decode at mid-generation context.
    context = prompt + output / 2
    decode_flops, decode_bytes = decode_work(model, batch, context, weight_dtype, kv_dtype, t)
    decode_compute, decode_memory = decode_flops / peak, decode_bytes / memory_bw
    itl = np.maximum(decode_compute, decode_memory) + all_reduce(batch * model.hidden * DTYPE_BYTES[hw.dtype]) + launches
    # Decode turns compute-bound at the batch B where B·(FLOP/seq)/peak = weights/bw + B·(KV/seq)/bw.
    sequence_flops, _ = decode_work(model, 1, context, weight_dtype, kv_dtype, t)
    margin = sequence_flops / peak - context * kv_token / t / memory_bw
    weight_time = breakdown.active() * w_bytes / t / memory_bw
    critical = np.where(margin > 0, weight_time / np.where(margin > 0, margin, 1.0), np.inf)

    capacity = hw.hbm_bytes * a.memory_usable_fraction - a.memory_reserved_bytes
    weights_per_gpu = breakdown.total() * w_bytes / t
    per_sequence = (prompt + output) * kv_token / t
    max_concurrency = np.floor(np.maximum(capacity - weights_per_gpu, 0) / per_sequence)
    kv_per_gpu = batch * per_sequence
    fits = weights_per_gpu + kv_per_gpu <= capacity
    broken = [np.asarray(model.heads % t != 0), np.asarray(weights_per_gpu > capacity), ~np.asarray(fits)]
    code = np.zeros(np.broadcast(*broken, ttft).shape, dtype=np.int8)
    for index in range(len(broken), 0, -1):
        code = np.where(broken[index - 1], index, code)
    return InferencePrediction(
        ttft_s=ttft, itl_s=itl, tokens_per_s=batch / itl, kv_bytes_per_token=kv_token,
        weight_bytes_per_gpu=weights_per_gpu, kv_bytes_per_gpu=kv_per_gpu, max_concurrency=max_concurrency,
        decode_compute_bound=decode_compute >= decode_memory, prefill_compute_bound=prefill_compute >= prefill_memory,
        critical_batch=critical, feasible=code == 0, reason_code=code,
    )
