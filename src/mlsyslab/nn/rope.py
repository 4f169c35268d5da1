"""Rotary position embeddings (Su et al. 2021, "RoFormer"), and the frequency scalings checkpoints ask for.

Each pair of channels (i, i + d/2) of a query or key head rotates by position·θ^(-2i/d). A model trained at one
context length and stretched to a longer one rescales those frequencies; transformers names the rule in the
config's `rope_scaling` (`rope_parameters` from transformers 5):
- "linear" (position interpolation, Chen et al. 2023): every frequency / factor;
- "llama3" (Meta's Llama 3.1 / 3.2 / 3.3): wavelengths longer than original_max_position_embeddings /
  low_freq_factor are slowed by `factor`, those shorter than original / high_freq_factor kept, and those between
  interpolated smoothly — transformers' `_compute_llama3_parameters`, the same numbers.
Neither changes the attention's scale. Other rules (yarn, dynamic NTK, longrope) are refused by name. GGUF files
carry llama3's result as a `rope_freqs` tensor of per-frequency divisors (`nn.gguf_loader` reads it back into
these parameters). Held to transformers' LlamaForCausalLM in tests/nn/test_llama.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mlsyslab.errors import InvalidValue

RULES = ("linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """A frequency scaling as the config states it (llama3's three extra fields unused by "linear")."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq: int = 8192

    def __post_init__(self):
        if self.rope_type not in RULES:
            raise InvalidValue("rope_type", self.rope_type, f"default, {', '.join(RULES)}")
        if not self.factor > 0:
            raise InvalidValue("rope_scaling.factor", self.factor, "> 0")
        if self.rope_type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise InvalidValue("rope_scaling.high_freq_factor", self.high_freq_factor,
                               f"> low_freq_factor={self.low_freq_factor} > 0")

    @classmethod
    def from_hf(cls, rope: dict) -> RopeScaling | None:
        """From transformers' `rope_scaling` / `rope_parameters` dict (None: no scaling)."""
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            return None
        if rope_type not in RULES:  # before reading fields other rules name differently
            raise InvalidValue("rope_type", rope_type, f"default, {', '.join(RULES)}")
        def field(name: str):
            if not isinstance(rope.get(name), (int, float)):
                raise InvalidValue(f"rope_scaling.{name}", rope.get(name), f"a number (rope_type {rope_type})")
            return rope[name]

        llama3 = {} if rope_type == "linear" else {
            "low_freq_factor": float(field("low_freq_factor")), "high_freq_factor": float(field("high_freq_factor")),
            "original_max_seq": int(field("original_max_position_embeddings"))}
        return cls(rope_type, float(field("factor")), **llama3)

    def to_hf(self) -> dict:
        """The `rope_scaling` transformers reads."""
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        return {"rope_type": "llama3", "factor": self.factor, "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor, "original_max_position_embeddings": self.original_max_seq}

    def divisors(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """What each frequency is divided by (llama.cpp's `rope_freqs`)."""
        if self.rope_type == "linear":
            return torch.full_like(inv_freq, self.factor)
        return inv_freq / self.scaled(inv_freq)

    def scaled(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The scaled frequencies, in transformers' operations and order (so that they round alike)."""
        if self.rope_type == "linear":
            return inv_freq / self.factor
        old, low, high = self.original_max_seq, self.low_freq_factor, self.high_freq_factor
        wavelength = 2 * math.pi / inv_freq
        slowed = torch.where(wavelength > old / low, inv_freq / self.factor, inv_freq)
        smooth = (old / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * slowed / self.factor + smooth * slowed
        between = ~(wavelength < old / high) * ~(wavelength > old / low)
        return torch.where(between, smoothed, slowed)


def base_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """θ^(-2i/d) for i < d/2, unscaled (fp32, computed as transformers does)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta ** exponents)


def rope_inverse_frequencies(config) -> torch.Tensor:
    """A `LlamaConfig`'s frequencies, scaled by its `rope_scaling`: the rotation speed of each pair of channels (fp32,
    as HF; not a buffer, so casting the model to bf16 never rounds it)."""
    inv_freq = base_frequencies(config.head_dim, config.rope_theta)
    return inv_freq if config.rope_scaling is None else config.rope_scaling.scaled(inv_freq)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos and signed sin of position·frequency, [B, T, 1, d]: frequencies repeated for both halves,
    the sin of the first half negated (so `apply_rope` needs no negation of its own)."""
    compute = torch.promote_types(dtype, torch.float32)
    angles = positions[..., None].to(compute) * inv_freq.to(compute)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), dim=-1)[..., None, :].to(dtype), torch.cat((-sin, sin), dim=-1)[..., None, :].to(dtype)


def apply_rope(x, cos, signed_sin):
    """Rotate channel i with channel i + d/2 (the "rotate half" layout HF checkpoints use):
    x·cos + (-x₂, x₁)·sin, the sign carried by `signed_sin` (bit-equal: (-a)·b = a·(-b))."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin
