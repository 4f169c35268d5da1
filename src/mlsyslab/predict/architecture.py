"""Parameters, FLOPs and KV-cache bytes of a decoder-only transformer, from its config alone.

Counts follow the layer definitions of the reference implementations (Llama, GPT-2/OPT, Mixtral,
DeepSeek-V3 MLA, Qwen). FLOPs: a matmul of an (n x k) by a (k x m) matrix costs 2nkm; the forward
pass of a token costs 2 FLOP per matmul weight it touches (Kaplan et al. 2020, arXiv 2001.08361),
plus attention over the context: 2·s·(d_qk + d_v) per head per layer. Attention FLOPs are counted
over the full s x s score matrix (the Megatron / PaLM convention behind every published MFU;
causal kernels skip about half). Backward = 2 x forward.
"""

from dataclasses import dataclass

import numpy as np

from mlsyslab.specs.schema import DTYPE_BYTES, Model


@dataclass(frozen=True)
class ParameterBreakdown:
    """Parameter counts by role; per-layer entries are for one layer of that kind."""

    embedding: int  # token embedding + learned positions
    unembedding: int  # output projection parameters; 0 when tied to the embedding
    output_projection: int  # vocab x hidden: the logits matmul, tied or not
    attention: int  # per layer, including Q/K norms and biases
    head_norms: int  # per layer, the Q/K head norms' weights (in `attention`; one head's width each, whole on every TP rank)
    dense_mlp: int  # per dense layer
    routed_experts: int  # per MoE layer, all routed experts
    routed_expert: int  # one routed expert
    shared_experts: int  # per MoE layer
    router: int  # per MoE layer
    layer_norms: int  # per layer
    final_norm: int
    dense_layers: int
    moe_layers: int
    experts_per_token: int
    extra: int  # outside the stack (e.g. DeepSeek-V3's multi-token-prediction module)

    @property
    def layers(self) -> int:
        return self.dense_layers + self.moe_layers

    @property
    def per_layer_dense(self) -> int:
        return self.attention + self.dense_mlp + self.layer_norms

    @property
    def per_layer_moe(self) -> int:
        return self.attention + self.routed_experts + self.shared_experts + self.router + self.layer_norms

    @property
    def matmul_per_dense_layer(self) -> int:
        """The matrix weights a token meets in a dense layer (its forward FLOPs are twice this)."""
        return self.attention + self.dense_mlp

    @property
    def matmul_per_moe_layer(self) -> int:
        """The matrix weights a token meets in an MoE layer: the router, shared experts and top-k routed experts."""
        return self.attention + self.shared_experts + self.router + self.experts_per_token * self.routed_expert

    def total(self) -> int:
        stack = self.dense_layers * self.per_layer_dense + self.moe_layers * self.per_layer_moe
        return self.embedding + self.unembedding + stack + self.final_norm + self.extra

    def active(self) -> int:
        """Parameters one token touches: only `experts_per_token` routed experts per MoE layer."""
        idle = self.moe_layers * (self.routed_experts - self.experts_per_token * self.routed_expert)
        return self.total() - idle

    def matmul_active(self) -> int:
        """Weights a token multiplies by in the forward pass: no embedding lookup or norms, plus the logits."""
        norms = self.layers * self.layer_norms + self.final_norm
        lookups = self.embedding + self.unembedding + norms + self.extra
        return self.active() - lookups + self.output_projection


def parameters(model: Model) -> ParameterBreakdown:
    """Count every weight of `model` by role."""
    h = model.hidden
    norm = 2 * h if model.norm == "layernorm" else h
    attention = _attention_parameters(model)
    dense_mlp = _mlp_parameters(h, model.ffn_hidden, model.gated_mlp, model.linear_bias)
    embedding = (model.vocab + model.learned_positions) * h
    moe = model.moe
    if moe is None:
        expert = routed = shared = router = 0
        dense_layers, moe_layers, top_k = model.layers, 0, 0
    else:
        expert = _mlp_parameters(h, moe.expert_ffn_hidden, model.gated_mlp, model.linear_bias)
        routed, shared = moe.experts * expert, moe.shared_experts * expert
        router = h * moe.experts + (moe.experts if moe.router_bias else 0)
        dense_layers, moe_layers, top_k = moe.dense_layers, model.layers - moe.dense_layers, moe.experts_per_token
    return ParameterBreakdown(
        embedding=embedding,
        unembedding=0 if model.tied_embeddings else model.vocab * h,
        output_projection=model.vocab * h,
        attention=attention,
        head_norms=_head_norm_parameters(model),
        dense_mlp=dense_mlp,
        routed_experts=routed,
        routed_expert=expert,
        shared_experts=shared,
        router=router,
        layer_norms=2 * norm,
        final_norm=norm,
        dense_layers=dense_layers,
        moe_layers=moe_layers,
        experts_per_token=top_k,
        extra=model.extra_params,
    )


def _attention_parameters(model: Model) -> int:
    h, heads = model.hidden, model.heads
    if model.mla is not None:
        m = model.mla
        qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            query = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * qk_dim
        else:
            query = h * heads * qk_dim
        key_value = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        key_value += m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        return query + key_value + heads * m.v_head_dim * h
    hd, kv = model.attention_head_dim, model.num_kv_heads
    q_width, kv_width = heads * hd, kv * hd
    weights = h * q_width + 2 * h * kv_width + q_width * h
    bias = 0
    if model.linear_bias:
        bias = q_width + 2 * kv_width + h
    elif model.qkv_bias:
        bias = q_width + 2 * kv_width
    return weights + bias + _head_norm_parameters(model)


def _head_norm_parameters(model: Model) -> int:
    """Qwen3's query and key head norms: one head's width each (none under MLA)."""
    return 2 * model.attention_head_dim if model.qk_norm and model.mla is None else 0


def _mlp_parameters(hidden: int, ffn: int, gated: bool, bias: bool) -> int:
    matrices = 3 if gated else 2
    return matrices * hidden * ffn + ((matrices - 1) * ffn + hidden if bias else 0)


def attention_dims(model: Model) -> tuple[int, int]:
    """(d_qk, d_v) summed over query heads: the widths of the score and value matmuls."""
    if model.mla is not None:
        m = model.mla
        return model.heads * (m.qk_nope_head_dim + m.qk_rope_head_dim), model.heads * m.v_head_dim
    width = model.heads * model.attention_head_dim
    return width, width


def forward_flops_per_token(model: Model, context):
    """Forward FLOPs for one token attending over `context` tokens (broadcasts over arrays).

    2 x matmul weights touched + 2·context·(d_qk + d_v) per layer for scores and weighted values.
    """
    d_qk, d_v = attention_dims(model)
    weights = parameters(model).matmul_active()
    return 2.0 * weights + 2.0 * np.asarray(context, dtype=float) * (d_qk + d_v) * model.layers


def training_flops_per_token(model: Model, seq):
    """Model FLOPs per trained token: forward + backward (2x forward) = 3x forward."""
    return 3.0 * forward_flops_per_token(model, seq)


def kv_bytes_per_token(model: Model, dtype: str = "bf16"):
    """KV-cache bytes one token occupies: 2·layers·kv_heads·head_dim·bytes (MLA: the latent + RoPE key)."""
    width = DTYPE_BYTES[dtype]
    if model.mla is not None:
        return model.layers * (model.mla.kv_lora_rank + model.mla.qk_rope_head_dim) * width
    return 2 * model.layers * model.num_kv_heads * model.attention_head_dim * width
