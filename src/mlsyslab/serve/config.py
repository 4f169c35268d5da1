"""The serving engine's memory and batching knobs, checked when made. Plain data without torch: the server's HTTP
process builds it from the command line and hands it to the engine's process (`serve.engine_process`)."""

from __future__ import annotations

from dataclasses import dataclass

from mlsyslab.errors import InvalidValue
from mlsyslab.measure.host import cpu_has_bf16_dot


def default_fp32_steps_from() -> int:
    """Steps of this many tokens or more run 16-bit CPU weights on an fp32 copy, by default: 16 where the CPU has no
    bf16 dot product (its fp32 GEMM is the faster there), else 0, never (`Engine.wide_steps_from`)."""
    return 0 if cpu_has_bf16_dot() else 16


def compute_dtype(hardware: str, dtype: str) -> str:
    """The dtype whose peak the engine's products run at on `hardware` with `dtype` weights: what its twins resolve the
    hardware for (the weights' bytes stay `dtype`'s).

    On this machine (local), where the CPU has no bf16 dot product the engine multiplies bf16 weights in fp32 (its
    streamed kernel widens them; steps from 16 tokens take an fp32 copy: `Engine.wide_steps_from`), so the peak is the
    fp32 one: the spec's bf16 peak is torch's own bf16 matmul, 3.2 GFLOP/s against 128 in fp32 on two Zen 3 cores, at
    which the twin predicted a 94 ms bf16 step where 11.4 ms were measured (2026-11-28)."""
    widens = hardware == "local" and dtype == "bf16" and default_fp32_steps_from() > 0
    return "fp32" if widens else dtype


@dataclass(frozen=True)
class EngineConfig:
    """Memory and batching knobs. Defaults suit SmolLM2-135M on a 2-core CPU."""

    kv_cache_bytes: int = 1_000_000_000
    block_size: int = 16
    max_batched_tokens: int = 2048  # chunked-prefill budget (docs/serving.md: oneDNN's bf16 GEMMs cost 30% less
    # per row from ~1,500 rows than at 1,024 here; 16 in flight gained 8% and its TTFT, 32 broke even)
    max_running: int = 64
    max_waiting: int = 256
    prefix_cache: bool = True
    packed_linears: bool = True  # oneDNN-prepacked weights on CPU (nn.packed_linear); off: F.linear
    fused_decode: bool = True  # decode-only steps run every layer in one C++ call where it applies (nn.fused_decode)
    fp32_steps_from: int | None = None  # 16-bit CPU weights: steps of this many tokens or more run on an fp32
    # copy of them (None: `default_fp32_steps_from()`, 0: never); see `Engine.wide_steps_from`
    decode_steps: int = 8  # decodes may run up to this many steps in one call while nobody waits
    # (multi-step decoding; 1: off); see `steps_ahead`
    decode_ahead_s: float = 0.1  # ... and only as many as take about this long (what an arrival may wait)
    speculative_tokens: int = 0  # n-gram draft tokens a decode may verify per step (`serve.speculative`; 0: off)
    speculative_max_rows: int = 8  # ... while the step has at most this many rows with them (see `drafts`)
    ngram_max: int = 3  # ... looked up after the longest of the request's last ngram_max..ngram_min tokens found
    ngram_min: int = 2  # earlier in its prompt and output

    def __post_init__(self):
        if self.decode_steps < 1:
            raise InvalidValue("decode_steps", self.decode_steps, ">= 1 (1: one step per call)")
        if not self.decode_ahead_s >= 0:
            raise InvalidValue("decode_ahead_s", self.decode_ahead_s, ">= 0 seconds")
        if self.speculative_tokens < 0:
            raise InvalidValue("speculative_tokens", self.speculative_tokens, ">= 0 (0: off)")
        if self.speculative_max_rows < 1:
            raise InvalidValue("speculative_max_rows", self.speculative_max_rows, ">= 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidValue("ngram_min..ngram_max", f"{self.ngram_min}..{self.ngram_max}", "1 <= ngram_min <= ngram_max")
