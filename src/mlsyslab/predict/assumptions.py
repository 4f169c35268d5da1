"""Every efficiency, overlap and overhead a prediction uses: named, documented, overridable.

One set of defaults serves every prediction (and every published run in the tests); nothing is
fitted per scenario. `Assumptions().override({"matmul_efficiency_max": 0.6})` changes one; the CLI
takes `--assume NAME=VALUE` and `--explain` prints them all with their values.
"""

import math
from dataclasses import dataclass, field, fields, replace

from mlsyslab.errors import InvalidValue


def documented(default, doc: str):
    """A dataclass field with a default and the sentence `--explain` prints for it."""
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class Assumptions:
    matmul_efficiency_max: float = documented(
        0.8, "fraction of dense peak a large matmul reaches (cuBLAS sustains ~80-90% on A100/H100 for large GEMMs)")
    matmul_half_efficiency_width: float = documented(
        250.0, "GEMM width per device (hidden/TP) at which matmul efficiency is half its maximum: "
        "efficiency = max · w/(w + w_half); narrow GEMMs fill fewer SMs (wave quantisation) and "
        "spend more of their time in prologue, epilogue and launch")
    attention_efficiency: float = documented(
        1.0, "training attention's rate relative to the layers' GEMMs, on the FLOPs counted for it (2·s·(d_qk + d_v) "
        "a token a layer forward, the causal half included, as MFU counts them): 1 takes the GEMMs' rate; a fused "
        "attention kernel runs slower per FLOP than a large GEMM (FlashAttention-2: 50-73% of an A100's peak, Dao "
        "2023; torch's causal SDPA on one Zen 3 core: 0.53-0.77 of its GEMM rate from head dim 32, 128 tokens to head "
        "dim 64, 512 tokens); `mlsys calibrate` measures it")
    output_projection_bytes_per_logit: float = documented(
        0.0, "memory bytes per logit the vocabulary projection's three products (forward and both gradients) take "
        "beyond their FLOPs at a layer GEMM's rate: their tokens x vocab fp32 logits, written once and read twice, "
        "outgrow a CPU's caches, and the time lost scales with the logits, not the width (on one Zen 3 core 2-5 ns a "
        "logit at widths 64-512 with 49,152 words); 0 on GPUs, whose GEMMs hide their output under the FLOPs; "
        "`mlsys calibrate` measures it")
    memory_bandwidth_efficiency: float = documented(
        0.8, "fraction of peak HBM bandwidth a memory-bound kernel (elementwise, softmax, decode GEMV) reaches")
    elementwise_bytes_per_token_per_hidden: float = documented(
        60.0, "HBM bytes moved by a layer's non-matmul kernels (norms, residuals, activations, dropout, "
        "rotary) per token per hidden unit, forward; backward moves twice as much. Korthikanti et al. "
        "count 34 bytes of stored activations per token per hidden unit; each is written then read")
    flash_attention: bool = documented(
        True, "attention never materialises the s x s scores in HBM (FlashAttention, Dao et al. 2022); "
        "when false the scores, softmax and dropout mask cost 5·a·s bytes per token per layer, read "
        "and written (Korthikanti et al. 2022)")
    eager_activations: bool = documented(
        False, "count the activations a layer stores as mlsyslab's nn/ saves them under eager PyTorch "
        "(predict.memory.eager_activation_bytes_per_layer: norms their input and fp32 rstd, SwiGLU gate and up, attention "
        "its log-sum-exp, an MoE layer its routing indices and each copy's input and output), at the training dtype; "
        "false: Korthikanti et al. 2022's 16-bit count for Megatron's fused kernels. The trainer's twin sets it")
    loss_bytes_per_logit: float = documented(
        16.0, "HBM bytes the loss moves per logit, forward and backward (fp32 logits written, softmax read and "
        "written, gradient written): memory-bound on GPUs; on a CPU the exponentials cost more, and "
        "`mlsys calibrate` measures the equivalent")
    kernel_overhead_s: float = documented(
        0.0, "host time per kernel a framework launches that the device cannot hide (eager PyTorch on a CPU "
        "pays ~10 µs; on GPUs launches overlap with running kernels, so 0 there); `mlsys calibrate` measures it")
    kernels_per_layer: float = documented(
        30.0, "kernels one transformer layer launches in a forward pass (norms, projections, rotary, attention, "
        "MLP, residuals); backward launches twice as many")
    scale_up_efficiency: float = documented(0.8, "fraction of scale-up (NVLink, ICI) bandwidth a collective reaches")
    scale_out_efficiency: float = documented(0.8, "fraction of scale-out NIC bandwidth a collective reaches")
    scale_up_latency_s: float = documented(5e-6, "alpha per collective step inside a scale-up domain")
    scale_out_latency_s: float = documented(15e-6, "alpha per collective step across nodes")
    tensor_parallel_overlap: float = documented(0.0, "fraction of tensor-parallel communication hidden behind compute")
    sequence_parallel_regather_overlap: float = documented(
        1.0, "fraction of sequence parallelism's backward re-gathers (an all-gather of s·b·h per column-parallel entry, "
        "so that only the shard is kept for backward: Korthikanti et al. 2022 §4.2.2) hidden behind the input "
        "gradient's GEMM: Megatron overlaps them; ours runs each before its GEMMs, so `mlsys calibrate` sets 0")
    shared_memory_latency_factor: float = documented(
        1.0, "the α of the collectives our ranks run through shared memory inside a scale-up domain, as a multiple of "
        "the link's: on one x86 host TP's all-reduces, and DDP's and ZeRO's collectives when data parallelism is all "
        "the ranks do, take shared memory while the rest take gloo, and `mlsys calibrate` measures both; 1 where "
        "every collective takes the same transport (NCCL over NVLink)")
    shared_memory_bandwidth_factor: float = documented(
        1.0, "the β of the collectives our ranks run through shared memory inside a scale-up domain, as a multiple of "
        "the link's (see shared_memory_latency_factor)")
    shared_memory_shard_bandwidth_factor: float = documented(
        1.0, "the β of ZeRO's all-gathers and reduce-scatters through shared memory, as a multiple of the shared-memory "
        "all-reduce's: an all-gather and a reduce-scatter of a message move an all-reduce's ring bytes between them, "
        "but the all-reduce adds into its own tensor where they copy out of the slots, and `mlsys calibrate` times "
        "both; 1 where every collective takes the same transport")
    data_parallel_overlap: float = documented(
        0.7, "fraction of data-parallel gradient reduction (and ZeRO-3 gathers) hidden behind the backward pass")
    pipeline_p2p_overlap: float = documented(0.0, "fraction of pipeline send/recv time hidden behind compute")
    expert_all_to_all_overlap: float = documented(0.0, "fraction of MoE dispatch/combine hidden behind compute")
    context_parallel_overlap: float = documented(1.0, "fraction of ring-attention K/V transfer that can hide behind attention compute")
    optimizer_bytes_per_parameter: float = documented(
        36.0, "HBM bytes a fused mixed-precision Adam step reads and writes per local parameter "
        "(fp32 master, m, v read+write = 24; gradient read 4; bf16 weight write 2; plus slack); `mlsys calibrate` "
        "measures our trainers' (torch's fused AdamW in fp32: ~17 at a copy's bandwidth on one Zen 3 core, where "
        "the op-by-op step took 40-63)")
    gradient_accumulation_bytes_per_parameter: float = documented(
        0.0, "memory bytes per parameter a rank moves every microbatch handing its weight gradients on, beyond the "
        "products that compute them: eager PyTorch adds each new gradient into the one accumulated (AccumulateGrad's "
        "`grad += new`, 12 bytes in fp32) or copies it into a communication bucket (DDP on its last microbatch, "
        "ZeRO-2/3 on every one); 0 where the weight-gradient GEMM accumulates in place (Megatron's gradient "
        "accumulation fusion); `mlsys calibrate` measures the add at the copy bandwidth")
    gradient_reduce_bytes: float = documented(2.0, "bytes per gradient element on the wire (bf16/fp16 reduction)")
    cpu_adam_parameters_per_s: float = documented(1.0e9, "parameters per second a node's CPUs update with Adam under offload")
    memory_usable_fraction: float = documented(
        0.92, "fraction of accelerator memory the framework can allocate (context, fragmentation)")
    memory_reserved_bytes: float = documented(2.0e9, "fixed bytes per device for the runtime context and workspaces")

    def override(self, values: dict) -> "Assumptions":
        known = {f.name: f for f in fields(self)}
        parsed = {}
        for name, value in values.items():
            if name not in known:
                raise InvalidValue("assume", name, ", ".join(sorted(known)), reason="unknown assumption")
            kind = type(known[name].default)
            try:
                parsed[name] = _parse_bool(value) if kind is bool else float(value)
            except ValueError:
                raise InvalidValue(f"assume.{name}", value, f"a {kind.__name__}") from None
            if kind is float:
                _check(name, value, parsed[name])
        return replace(self, **parsed)

    def explain(self) -> dict:
        """{name: {"value": ..., "doc": ...}} for every assumption."""
        return {f.name: {"value": getattr(self, f.name), "doc": f.metadata["doc"]} for f in fields(self)}


def _check(name: str, text, value: float) -> None:
    """Finite and >= 0; a fraction (an overlap, the usable memory) at most 1; an efficiency > 0 (time divides by it;
    calibrated ones may pass 1, relative to a fitted peak)."""
    if not (math.isfinite(value) and value >= 0):
        raise InvalidValue(f"assume.{name}", text, "a finite value >= 0")
    if name.endswith(("_overlap", "_fraction")) and value > 1:
        raise InvalidValue(f"assume.{name}", text, "a fraction, 0..1")
    if name.endswith(("_efficiency", "_efficiency_max")) and value == 0:  # not the half-efficiency width: 0 is flat
        raise InvalidValue(f"assume.{name}", text, "a value > 0 (times are divided by it)")


def _parse_bool(value) -> bool:
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


DEFAULT = Assumptions()
