"""A decode step through every decoder layer in one C++ call (csrc/decode_layers.cpp, csrc/streamed_decode.cpp).

At decode batch sizes a decoder layer is four matmuls and about fifteen small operations; the
interpreter and dispatch around the small ones cost more than the operations themselves. Measured
here (SmolLM2-135M, 2 cores): the batch-1 fp32 step spent 21.7 ms in matmuls and 8.4 ms in
everything else, most of it Python. `FusedDecode` runs the same kernels in the same order as the
serving copy's Python layers (`nn.packed_linear.packed_for_inference`, with `nn.cpu_kernels`), the loop
over layers in C++. The kernel each weight takes (oneDNN on the prepacked weight, ATen on the plain
weight, or the streamed kernel on its tiled one) is the one `PackedLinear.kernel` picks for the step's
rows, so the logits are bit-equal to the Python path's (tests/nn/test_fused_decode.py). Two C++ steps:
- where every matrix of the step takes the streamed kernel (steps under `packed_linear.streamed_below(dtype)`
  rows wherever the C++ kernels build: every bf16 step on the pair kernel without AMX, steps under 48 rows on AMX
  tiles), `streamed_decode` runs the
  embedding lookup, the layers, the final norm, the logits and each row's argmax in one parallel region,
  the threads meeting at barriers (on Zen 3, bf16 batch 1: ~1 ms a step less than the per-op loop: 121
  fork/joins and ~600 tensor allocations gone);
- otherwise `decode_layers` calls each kernel as an ATen op, and the final norm and logits run here.

It applies to steps that only decode (one new token per sequence, or a speculative draft's consecutive positions
of one sequence as one-token rows: `PagedAttention.rows_extend_sequences`) with the paged kernel reading the
cache (`PagedAttention.in_place`); the engine (`serve.engine`) takes the Python path for every other
step — prefill chunks, where the matmuls dwarf the overhead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlsyslab.nn import cpu_kernels
from mlsyslab.nn.llama import Llama
from mlsyslab.nn.packed_linear import Kernel, PackedLinear
from mlsyslab.nn.paged_attention import DecodeSteps, PagedAttention
from mlsyslab.nn.rope import rope_cos_sin, rope_inverse_frequencies


@dataclass
class StepPlan:
    """What a step of some row count runs: each matrix's weight for its kernel, the kernel codes, the
    lm_head's weight, and whether every matrix takes the streamed kernel (then the whole step is one
    `streamed_decode` call)."""

    weights: list[torch.Tensor]
    kernels: list[int]
    head_weight: torch.Tensor
    streamed: bool


class FusedDecode:
    """Decode steps of a serving copy of a Llama, its layers in one `torch.ops.mlsyslab.decode_layers` call."""

    def __init__(self, model: Llama):
        """model: a copy from `packed_for_inference` with the C++ kernels (see `applies_to`)."""
        self.model = model
        self.norms = [norm.weight for layer in model.layers
                      for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
        self.linears: list[PackedLinear] = [linear for layer in model.layers for linear in (
            layer.self_attn.fused_qkv, layer.self_attn.o_proj, layer.mlp.fused_gate_up, layer.mlp.down_proj)]
        self.out_features = [linear.out_features for linear in self.linears]
        # Qwen2's q|k|v biases, one per layer, and Qwen3's q and k head norms, two per layer (none for Llama)
        self.qkv_biases = [layer.self_attn.fused_qkv.bias for layer in model.layers
                           if layer.self_attn.fused_qkv.bias is not None]
        self.qk_norms = [norm.weight for layer in model.layers
                         for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm) if norm is not None]
        # the rope tables of every position, once (as `rope_cos_sin` computes them each step: elementwise,
        # so a row here is bit-equal to that step's), [max_seq, head_dim] in the model's dtype
        dtype = model.norm.weight.dtype
        self.cos, self.sin = (table[:, 0] for table in rope_cos_sin(
            rope_inverse_frequencies(model.config), torch.arange(model.config.max_seq), dtype))
        self.plans: dict[int, StepPlan] = {}

    @staticmethod
    def applies_to(model: Llama) -> bool:
        """Whether `model` is a serving copy whose every layer the C++ step can run."""
        weight = model.norm.weight  # the copy's dtype (its embedding may be the 16-bit one, widened)
        return (isinstance(model.lm_head, PackedLinear) and isinstance(model.norm, cpu_kernels.KernelRMSNorm)
                and all(isinstance(layer.input_layernorm, cpu_kernels.KernelRMSNorm)
                        and isinstance(layer.self_attn.fused_qkv, PackedLinear) for layer in model.layers)
                and cpu_kernels.serves_attention(weight.device, weight.dtype, model.config.head_dim))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: PagedAttention,
                 logits_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`Llama.forward_packed` for a step of decodes only; `attention` has written nothing yet. Returns the
        logits, and each row's greedy token (first largest logit) where the step computed it (the streamed step
        notes it while the logits are in cache), else None."""
        if attention.prefills or not attention.in_place:
            raise ValueError("FusedDecode runs steps of decodes only, with the in-place paged kernel")
        model = self.model
        plan = self.plan(len(input_ids))
        config, ops = model.config, cpu_kernels.load()
        if plan.streamed:  # the embedding and rope rows are looked up in the step too
            temperature = torch.zeros(len(logits_rows))  # 0: each row's token is its largest logit
            logits, tokens = self.streamed(input_ids, positions[None], attention.k_cache, attention.v_cache,
                                           attention.slot_mapping[None], attention.decode_tables,
                                           attention.decode_lengths[None], logits_rows, temperature,
                                           torch.zeros(1, len(logits_rows), dtype=torch.float64),
                                           attention.rows_extend_sequences)
            return logits, tokens[0]
        hidden = ops.decode_layers(
            model.embed_tokens(input_ids), self.cos[positions], self.sin[positions], self.norms, plan.weights,
            plan.kernels, self.out_features, self.qkv_biases, self.qk_norms, attention.k_cache, attention.v_cache,
            attention.slot_mapping, attention.decode_tables, attention.decode_lengths, config.heads, config.rms_norm_eps)
        return model.lm_head(model.norm(hidden[logits_rows])), None

    def runs_ahead(self, rows: int) -> bool:
        """Whether steps of `rows` decodes can run several at a time (`ahead`): the streamed step only."""
        return self.plan(rows).streamed

    def ahead(self, input_ids: torch.Tensor, steps: DecodeSteps, temperature: torch.Tensor, uniform: torch.Tensor
              ) -> torch.Tensor:
        """Multi-step decoding: `len(steps.positions)` steps of the same sequences in one C++ call, each row's token
        fed back as its next input: its largest logit (first of equals) where `temperature` [rows] is 0, else the
        draw of its uniform (`uniform` [steps, rows], float64) from softmax(logits / temperature), as
        `serve.sampling.draw` makes it without top-k / top-p / min-p. Each step is the one `__call__` runs
        (bit-equal logits, tests/nn/test_fused_decode.py). -> the tokens [steps, rows]."""
        if not self.runs_ahead(len(input_ids)):
            raise ValueError(f"steps of {len(input_ids)} rows do not take the streamed step; run them one at a time")
        return self.streamed(input_ids, steps.positions, steps.k_cache, steps.v_cache, steps.slot_mapping, steps.tables,
                             steps.lengths, torch.arange(len(input_ids)), temperature, uniform)[1]

    def streamed(self, input_ids, positions, k_cache, v_cache, slots, tables, lengths, logits_rows, temperature,
                 uniform, writes_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`streamed_decode` (csrc/streamed_decode.cpp) on this model: positions, slots, lengths [steps, rows];
        `writes_first` where rows read each other's K/V (`PagedAttention.rows_extend_sequences`)."""
        model, config = self.model, self.model.config
        plan = self.plan(len(input_ids))
        return cpu_kernels.load().streamed_decode(
            model.embed_tokens.weight, input_ids, positions, self.cos, self.sin, self.norms, plan.weights,
            self.qkv_biases, self.qk_norms, model.norm.weight, plan.head_weight, config.vocab, k_cache, v_cache, slots,
            tables, lengths, logits_rows, temperature, uniform, config.heads, config.ffn_hidden, config.rms_norm_eps,
            writes_first)

    def plan(self, rows: int) -> StepPlan:
        """The kernels and weights of a step of `rows` tokens (computed once per row count)."""
        if rows not in self.plans:
            kernels = [linear.kernel(rows) for linear in self.linears]
            head = self.model.lm_head.kernel(rows)
            streamed = all(kernel == Kernel.STREAMED for kernel in [*kernels, head])
            self.plans[rows] = StepPlan([linear.weight_for(kernel) for linear, kernel in zip(self.linears, kernels)],
                                        [int(kernel) for kernel in kernels], self.model.lm_head.weight_for(head),
                                        streamed)
        return self.plans[rows]
