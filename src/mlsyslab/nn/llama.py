"""The Llama decoder: one model definition shared by training, serving and RLHF.

Architecture (Touvron et al. 2023, "LLaMA"; GQA from Ainslie et al. 2023): token embedding, then
`layers` pre-norm blocks of grouped-query attention with rotary position embeddings (Su et al.
2021, base `rope_theta`, frequencies scaled as `rope_scaling` asks: `nn.rope`; biases on the Q, K and V
projections with `qkv_bias`, as Qwen2 has them: Bai et al. 2023, "Qwen Technical Report"; an RMSNorm over each
query and key head before the rotation with `qk_norm`, as Qwen3: Yang et al. 2025, "Qwen3 Technical Report",
after Dehghani et al. 2023's QK-norm) and a SwiGLU MLP (Shazeer 2020) — or, with `experts` > 0, a mixture of
SwiGLU experts from layer `dense_layers` on (`nn.moe`, as Mixtral / DeepSeek-MoE) — RMSNorm (Zhang &
Sennrich 2019) before each and at the end, and an output head that may share the embedding matrix.
Parameter names equal Hugging Face's `LlamaForCausalLM` with the `model.` prefix dropped, so an HF
state dict loads with a rename (`nn.hf_loader`).

Two paths share every layer, differing only in how attention sees keys and values:
- training: `model(input_ids) -> logits`, causal attention over the batch, no cache;
- serving: `model.forward_packed(input_ids, positions, attention, logits_rows)`: the tokens of
  many sequences packed into one row, attention supplied by the caller (the paged KV cache in
  `nn.paged_attention`, which writes and reads K/V through block tables), logits only for the rows
  that are sampled.

The serving copy (`nn.packed_linear.packed_for_inference`) fuses q/k/v and gate/up into one
prepacked matrix each (`fused_qkv`, `fused_gate_up`); the training model never sets them.

Cost per token: 2 × (parameters without the embedding) FLOP forward plus attention 4·layers·heads·
head_dim·context; the twin is `predict.architecture`. Held equal to HF transformers in
tests/nn/test_llama.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Protocol

import torch
from torch import nn

from mlsyslab.errors import InvalidValue
from mlsyslab.nn import training_kernels
from mlsyslab.nn.rope import RopeScaling, rope_cos_sin, rope_inverse_frequencies


# model_type -> the config.json fields that name the Hugging Face model of each family this decoder is
HF_FAMILIES = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False},
    "phi3": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "use_sliding_window": False},
}


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-architecture decoder; every field as the model's config file states it."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn_hidden: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # None: the frequencies as θ gives them
    qkv_bias: bool = False  # biases on the Q, K and V projections (Qwen2), none on the others
    qk_norm: bool = False  # an RMSNorm over each query and key head, before rope (Qwen3)
    rms_norm_eps: float = 1e-5
    tied_embeddings: bool = True
    max_seq: int = 2048
    experts: int = 0  # 0: dense MLPs; else each layer from `dense_layers` on has an MoE MLP of this many experts
    experts_per_token: int = 2
    expert_ffn_hidden: int = 0  # 0: ffn_hidden
    dense_layers: int = 0
    capacity_factor: float = 1.25  # expert capacity, in multiples of a balanced share of routed tokens

    def __post_init__(self):
        for name in ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "ffn_hidden", "max_seq"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidValue(name, value, "an integer >= 1")
        if self.heads % self.kv_heads:
            raise InvalidValue("kv_heads", self.kv_heads, f"a divisor of heads={self.heads}")
        if self.head_dim % 2:
            raise InvalidValue("head_dim", self.head_dim, "an even number (rotary embeddings rotate pairs)")
        if not self.rope_theta > 0:
            raise InvalidValue("rope_theta", self.rope_theta, "> 0")
        if not self.rms_norm_eps > 0:
            raise InvalidValue("rms_norm_eps", self.rms_norm_eps, "> 0")
        if self.experts:
            if not 1 <= self.experts_per_token <= self.experts:
                raise InvalidValue("experts_per_token", self.experts_per_token, f"1..experts={self.experts}")
            if not 0 <= self.dense_layers <= self.layers:
                raise InvalidValue("dense_layers", self.dense_layers, f"0..layers={self.layers}")
            if not self.capacity_factor > 0:
                raise InvalidValue("capacity_factor", self.capacity_factor, "> 0")

    @classmethod
    def from_spec(cls, spec, rope_theta: float = 10000.0, rms_norm_eps: float = 1e-5) -> LlamaConfig:
        """From a catalog `specs.schema.Model`; the catalog does not record theta or eps, so pass them."""
        unsupported = {
            "norm": spec.norm != "rmsnorm", "gated_mlp": not spec.gated_mlp, "linear_bias": spec.linear_bias,
            "learned_positions": spec.learned_positions,
            "mla": spec.mla is not None,
            "moe": spec.moe is not None and (spec.moe.shared_experts > 0 or spec.moe.router_bias),
        }
        for field, present in unsupported.items():
            if present:
                raise InvalidValue(field, getattr(spec, field), "the Llama architecture (rmsnorm, gated MLP, no biases "
                                   "but on Q/K/V, rotary positions, no latent attention; experts without shared "
                                   "experts or router bias)", f"model {spec.name}")
        moe = {} if spec.moe is None else dict(
            experts=spec.moe.experts, experts_per_token=spec.moe.experts_per_token,
            expert_ffn_hidden=spec.moe.expert_ffn_hidden, dense_layers=spec.moe.dense_layers)
        return cls(vocab=spec.vocab, hidden=spec.hidden, layers=spec.layers, heads=spec.heads,
                   kv_heads=spec.num_kv_heads, head_dim=spec.attention_head_dim, ffn_hidden=spec.ffn_hidden,
                   rope_theta=rope_theta, rms_norm_eps=rms_norm_eps, tied_embeddings=spec.tied_embeddings,
                   max_seq=spec.max_seq, qkv_bias=spec.qkv_bias, qk_norm=spec.qk_norm, **moe)

    def to_spec(self, name: str, parameters: int, source: str):
        """This architecture as a catalog `specs.schema.Model`, for predict's twins of what nn/ runs."""
        from mlsyslab.specs.schema import MixtureOfExperts, Model

        moe = None if not self.experts else MixtureOfExperts(
            experts=self.experts, experts_per_token=self.experts_per_token, expert_ffn_hidden=self.expert_hidden,
            dense_layers=self.dense_layers)
        return Model(name=name, source=source, family=self.family, hidden=self.hidden, layers=self.layers,
                     qkv_bias=self.qkv_bias, qk_norm=self.qk_norm,
                     heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim, ffn_hidden=self.ffn_hidden,
                     vocab=self.vocab, tied_embeddings=self.tied_embeddings, max_seq=self.max_seq,
                     published_params=parameters, moe=moe)

    @property
    def family(self) -> str:
        """The Hugging Face family this shape is written as: Qwen3 with head norms, Qwen2 with q/k/v biases."""
        return "qwen3" if self.qk_norm else "qwen2" if self.qkv_bias else "llama"

    @property
    def expert_hidden(self) -> int:
        return self.expert_ffn_hidden or self.ffn_hidden

    @classmethod
    def from_hf(cls, hf) -> LlamaConfig:
        """From a transformers `LlamaConfig` (or its config.json as a dict), or a Mistral, Phi-3, Qwen2 or Qwen3 one.
        Mistral's and Phi-3's are the same architecture (Phi-3's checkpoints fuse q|k|v and gate|up into one matrix
        each: `nn.hf_loader` splits them) with a sliding window (each token attends to the last `sliding_window`
        positions, itself included): with contexts no longer than the window that is plain causal attention, so a
        window under the model's context caps max_seq at it (Mistral 7B v0.1: 4,096 of 32,768), and none (v0.2 on)
        changes nothing. Qwen2's adds biases to Q, K and V, Qwen3's an RMSNorm over each query and key head; their
        window, where `use_sliding_window` turns it on (for the layers from `max_window_layers`: off in every Qwen2,
        Qwen2.5 and Qwen3 release), caps max_seq likewise."""
        get = hf.get if isinstance(hf, dict) else (lambda key, default=None: getattr(hf, key, default))
        model_type = get("model_type")
        if model_type not in (None, "llama", "mistral", "phi3", "qwen2", "qwen3"):
            raise InvalidValue("model_type", model_type, "llama, mistral, phi3, qwen2 or qwen3")
        max_seq = get("max_position_embeddings", 2048)
        window = get("sliding_window") if model_type in ("mistral", "phi3") or get("use_sliding_window") else None
        rope = get("rope_parameters") or get("rope_scaling") or {}
        rotated = rope.get("partial_rotary_factor", get("partial_rotary_factor", 1.0))
        if rotated != 1.0:  # Phi-4-mini rotates 3/4 of each head
            raise InvalidValue("partial_rotary_factor", rotated, "1.0 (rotary embeddings over the whole head)")
        for flag in ("attention_bias", "mlp_bias"):
            if get(flag):
                raise InvalidValue(flag, True, "False (Llama without biases)")
        act = get("hidden_act", "silu")
        if act != "silu":
            raise InvalidValue("hidden_act", act, "silu")
        missing = [key for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "intermediate_size") if get(key) is None]
        if missing:
            raise InvalidValue(missing[0], None, f"set in the model's config.json (missing: {', '.join(missing)})")
        heads = get("num_attention_heads")
        return cls(vocab=get("vocab_size"), hidden=get("hidden_size"), layers=get("num_hidden_layers"), heads=heads,
                   kv_heads=get("num_key_value_heads") or heads,
                   head_dim=get("head_dim") or get("hidden_size") // heads, ffn_hidden=get("intermediate_size"),
                   rope_theta=float(rope.get("rope_theta", get("rope_theta", 10000.0))),
                   rope_scaling=RopeScaling.from_hf(rope),
                   rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
                   tied_embeddings=bool(get("tie_word_embeddings", False)),
                   max_seq=max_seq if window is None else min(max_seq, window), qkv_bias=model_type == "qwen2",
                   qk_norm=model_type == "qwen3")

    def to_hf(self) -> dict:
        """The config.json Hugging Face's LlamaForCausalLM reads for this shape (Qwen2ForCausalLM's with `qkv_bias`:
        Llama's `attention_bias` would put a bias on the output projection too; Qwen3ForCausalLM's with `qk_norm`)."""
        if self.experts:
            raise InvalidValue("experts", self.experts, "0: HF's LlamaForCausalLM is dense")
        if self.qkv_bias and self.qk_norm:
            raise InvalidValue("qk_norm", True, "False beside qkv_bias: no Hugging Face model has both")
        return {
            **HF_FAMILIES[self.family], "vocab_size": self.vocab,
            "hidden_size": self.hidden, "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim, "intermediate_size": self.ffn_hidden,
            "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_norm_eps, "hidden_act": "silu",
            "tie_word_embeddings": self.tied_embeddings, "max_position_embeddings": self.max_seq,
            **({} if self.rope_scaling is None else {"rope_scaling": self.rope_scaling.to_hf()}),
        }

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements one token stores across all layers (times the dtype's bytes: KV bytes per token)."""
        return 2 * self.layers * self.kv_heads * self.head_dim


class Attend(Protocol):
    """How a layer's attention sees K/V: q [B, T, heads, d], k/v [B, T, kv_heads, d] -> [B, T, heads, d]."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class Llama(nn.Module):
    """Llama decoder. `model(input_ids)` trains; `model.forward_packed(...)` serves from a KV cache."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        # the weight given, so that no normal_ runs: on the meta device (the loaders build there) normal_
        # imports torch._dynamo, 1.2-1.8 s of `mlsys serve`'s start; randn draws the same values
        self.embed_tokens = nn.Embedding(config.vocab, config.hidden, _weight=torch.randn(config.vocab, config.hidden))
        self.layers = nn.ModuleList(DecoderLayer(config, index) for index in range(config.layers))
        self.norm = RMSNorm(config.hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)
        if config.tied_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.no_grad()
    def initialize(self, std: float = 0.02, generator: torch.Generator | None = None) -> Llama:
        """Random weights as HF initialises Llama: N(0, std) for every matrix, ones for the norms."""
        for name, parameter in self.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64) * std)
        return self

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Training path: input_ids [B, T] -> logits [B, T, vocab]; causal, no cache."""
        if input_ids.shape[-1] > self.config.max_seq:
            raise InvalidValue("sequence length", input_ids.shape[-1], f"<= max_seq={self.config.max_seq}")
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
        hidden = self.hidden_states(input_ids, positions, causal_attention)
        return self.lm_head(hidden)

    def forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attend,
                       logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Serving path: the tokens of many sequences packed in one row.

        input_ids and positions are [T]; `attention` stores each layer's new K/V and attends over
        each token's own sequence (see `nn.paged_attention.PagedAttention`); returns logits
        [len(logits_rows), vocab] (all T rows when None).
        """
        hidden = self.hidden_states(input_ids[None], positions[None], attention)[0]
        if logits_rows is not None:
            hidden = hidden[logits_rows]
        return self.lm_head(hidden)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attend) -> torch.Tensor:
        """input_ids, positions [B, T] -> final-normed hidden states [B, T, hidden]."""
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(rope_inverse_frequencies(self.config).to(x.device), positions, x.dtype)
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, lambda q, k, v, index=index: attention(index, q, k, v))
        return self.norm(x)


class DecoderLayer(nn.Module):
    """x + attention(norm(x)), then + mlp(norm(x)); names as in HF (`self_attn`, `mlp`, two norms)."""

    def __init__(self, config: LlamaConfig, index: int = 0):
        super().__init__()
        self.self_attn = Attention(config)
        if config.experts and index >= config.dense_layers:
            from mlsyslab.nn.moe import MixtureOfExperts  # nn.moe builds its experts from this file's SwiGLU

            self.mlp = MixtureOfExperts(config.hidden, config.expert_hidden, config.experts, config.experts_per_token,
                                        config.capacity_factor)
        else:
            self.mlp = SwiGLU(config.hidden, config.ffn_hidden)
        self.input_layernorm = RMSNorm(config.hidden, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden, config.rms_norm_eps)

    def forward(self, x, cos, sin, attend: Callable) -> torch.Tensor:
        x = self.self_attn(self.input_layernorm(x), cos, sin, attend, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class Attention(nn.Module):
    """Grouped-query attention: `heads` query heads share `kv_heads` K/V heads; rotary on Q and K."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.heads, config.kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden, config.heads * config.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden, config.kv_heads * config.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden, config.kv_heads * config.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.heads * config.head_dim, config.hidden, bias=False)
        self.q_norm, self.k_norm = (RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
                                    for _ in range(2))
        self.fused_qkv = None  # the serving copy's one matrix for q, k and v (nn.packed_linear)
        self.rope = training_kernels.rope  # the serving copy's is one in-place pass (nn.cpu_kernels.rope)

    def forward(self, x, cos, sin, attend: Callable, residual: torch.Tensor) -> torch.Tensor:
        """residual + o_proj(attention(x))."""
        q, k, v = self.fused_qkv(x) if self.fused_qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        batch, tokens = q.shape[:2]  # under sequence parallelism q spans more tokens than x
        q, k = q.view(batch, tokens, self.heads, self.head_dim), k.view(batch, tokens, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        v = v.view(batch, tokens, self.kv_heads, self.head_dim)
        return add_projection(residual, self.o_proj, attend(q, k, v).reshape(batch, tokens, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn_hidden, bias=False)
        self.up_proj = nn.Linear(hidden, ffn_hidden, bias=False)
        self.down_proj = nn.Linear(ffn_hidden, hidden, bias=False)
        self.fused_gate_up = None  # the serving copy's one matrix for gate and up (nn.packed_linear)
        self.silu_and_mul = training_kernels.silu_and_mul  # the serving copy's: nn.cpu_kernels.silu_and_mul

    def forward(self, x, residual: torch.Tensor | None = None):
        """down(silu(gate(x)) * up(x)), plus `residual` when given."""
        gate, up = self.fused_gate_up(x) if self.fused_gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        hidden = self.silu_and_mul(gate, up)
        return self.down_proj(hidden) if residual is None else add_projection(residual, self.down_proj, hidden)


def release_unheld(parts, held: nn.Module) -> None:
    """Move each module of `parts` none of whose parameters `held` holds to the meta device: shapes kept, no bytes
    (what a pipeline rank does not run, a serving engine's source matrices once its copies hold them)."""
    kept = {id(p) for p in held.parameters()}
    for part in parts:
        if not any(id(p) in kept for p in part.parameters()):
            part.to("meta")


def add_projection(residual: torch.Tensor, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """residual + linear(x). The serving copy's `PackedLinear` adds inside its matmul (`add_to`): at
    decode batch sizes every kernel saved counts (docs/serving.md); in fp32 it rounds as a separate add."""
    add_to = getattr(linear, "add_to", None)
    return add_to(x, residual) if add_to is not None else residual + linear(x)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight, accumulated in fp32 whatever x's dtype and rounded once, at the end.

    For 16-bit x, HF rounds the normalised x to 16 bits before multiplying by the weight; rounding once is closer to
    the exact value (tests/nn/test_llama.py). On a CPU forward and backward are one C++ pass each, the serving copy's
    forward kernel with gradients or without (`nn.training_kernels`); elsewhere one `F.rms_norm` call."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        return training_kernels.rms_norm(x, self.weight, self.eps)


def causal_attention(layer: int, q, k, v) -> torch.Tensor:
    """The training path's attention: every token sees itself and the tokens before it in its row
    (`nn.training_kernels.causal_attention`)."""
    return training_kernels.causal_attention(q, k, v)
