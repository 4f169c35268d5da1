"""Inference-only linear layers with weights prepacked once for oneDNN (the CPU serving fast path).

At batch 1 a decoder step is one matrix-vector product per weight matrix, so its speed is the
bandwidth at which the matrices stream from memory (the decode roofline: weight bytes / bandwidth).
oneDNN's matmul with the weight reordered once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, the op inductor's CPU freezing pass uses) spreads every
product over all intra-op threads. Which kernel is fastest depends on the dtype and on how many rows
(tokens) the step multiplies; measured here (2 cores, AVX-512, 30 layers of SmolLM2-135M's matrices,
benchmarks/serve.py runs the model end to end):
- fp32: at 1-2 rows the plain `F.linear` (MKL GEMV) streams the matrices at 25 GB/s, the packed
  weight at 22; from 4 rows the packed weight is ahead (1.3-1.4x at 4-16 rows, even from 256);
- bf16: the packed weight is 1.5x `F.linear` at 1-128 rows; with AMX tiles, from 256 rows the
  plain weight reaches oneDNN's AMX GEMM at 1,200-1,500 GFLOP/s against 900-950 for the packed one.
So `PackedLinear` keeps a copy of the plain weight too where a row range prefers it (`plain_rows`).
q/k/v and gate/up are each one matrix (`FusedPackedLinear`), and `add_to` folds the residual add
that follows o_proj and down_proj into the matmul: at decode batch sizes the kernel count is what
costs (the fp32 batch-1 step went from 33.0 to 31.6 ms here).

`packed_for_inference(model)` returns a copy of the model whose linear layers are `PackedLinear`
(embeddings and norms shared with the original, which stays untouched and trainable). The results
differ from `F.linear` only by summation order (about 1e-6 relative in fp32). Used when the weights
are fp32 or bf16 on a CPU whose torch has oneDNN; anything else keeps `F.linear` (fp64, GPUs).
Tested in tests/nn/test_packed_linear.py, and end to end by the engine tests on the real model.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from mlsyslab.nn import cpu_kernels
from mlsyslab.nn.llama import Llama

BATCH_HINT = 256  # rows the packing is tuned for; measured here it also serves batch 1 at full speed


class PackedLinear(nn.Module):
    """y = x Wᵀ through oneDNN with W reordered once, or through `F.linear` on the plain W for the row
    counts `plain_rows` says are faster that way. No bias, no gradients."""

    def __init__(self, weight: torch.Tensor, batch_hint: int = BATCH_HINT):
        """weight [out, in]; copied (the layer is a snapshot: training the original changes nothing here)."""
        super().__init__()
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.plain_below, self.plain_from = plain_rows(weight.dtype)
        self.register_buffer("plain_weight", weight.clone() if self.plain_below > 1 or self.plain_from is not None else None)
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.uses_plain(rows.shape[0]):
            out = F.linear(rows, self.plain_weight)
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, None, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x Wᵀ in one kernel (oneDNN's binary-add post-op, or addmm on the plain weight)."""
        rows, base = x.reshape(-1, self.in_features), residual.reshape(-1, self.out_features)
        if self.uses_plain(rows.shape[0]):
            out = torch.addmm(base, rows, self.plain_weight.t())
        else:
            out = torch.ops.mkldnn._linear_pointwise.binary(rows, base, self.packed_weight, None, "add")
        return out.reshape(residual.shape)

    def uses_plain(self, rows: int) -> bool:
        return rows < self.plain_below or (self.plain_from is not None and rows >= self.plain_from)


def plain_rows(dtype: torch.dtype) -> tuple[int, int | None]:
    """(below, from): products of fewer than `below` rows, or of `from` rows or more (None: never), run
    on the plain weight; the rest on the packed one (measurements in the module docstring)."""
    if dtype == torch.float32:
        return 3, None
    return 1, (256 if cpu_kernels.cpu_has_amx() else None)


def can_pack(model: Llama) -> bool:
    """oneDNN packing applies to fp32 / bf16 weights on a CPU with a oneDNN-enabled torch."""
    if not isinstance(model.lm_head, nn.Linear) or model.config.experts:  # already packed, or MoE (not packed yet)
        return False
    weight = model.lm_head.weight
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:  # the op is private: check it exists and agrees with F.linear before relying on it
        probe = nn.Linear(8, 4, bias=False).to(weight.dtype)
        x = torch.randn(3, 8, dtype=weight.dtype)
        return torch.allclose(PackedLinear(probe.weight)(x).float(), probe(x).float(), atol=1e-2, rtol=1e-2)
    except (RuntimeError, AttributeError):
        return False


def packed_for_inference(model: Llama) -> Llama:
    """A copy of `model` for serving: q/k/v and gate/up fused into one prepacked matrix each, every
    other linear prepacked; embeddings and norm weights shared. Where the C++ kernels build
    (`nn.cpu_kernels`), RMSNorm, rope and silu·up run as one pass each. The original is untouched."""
    packed = copy.copy(model)  # shallow: embeddings and norms are shared, not copied
    packed._modules = dict(model._modules)
    kernels = cpu_kernels.serves(model.lm_head.weight)
    packed.layers = nn.ModuleList(packed_layer(layer, kernels) for layer in model.layers)
    packed.lm_head = PackedLinear(model.lm_head.weight)
    if kernels:
        packed.norm = cpu_kernels.KernelRMSNorm(model.norm)
    return packed.eval()


def packed_layer(layer: nn.Module, kernels: bool) -> nn.Module:
    attention, mlp = shallow_copy(layer.self_attn), shallow_copy(layer.mlp)
    attention.fused_qkv = FusedPackedLinear([attention._modules.pop(name) for name in ("q_proj", "k_proj", "v_proj")])
    attention.o_proj = PackedLinear(attention.o_proj.weight)
    mlp.fused_gate_up = FusedPackedLinear([mlp._modules.pop(name) for name in ("gate_proj", "up_proj")])
    mlp.down_proj = PackedLinear(mlp.down_proj.weight)
    new = shallow_copy(layer)
    new.self_attn, new.mlp = attention, mlp
    if kernels:
        attention.rope, mlp.silu_and_mul = cpu_kernels.rope, cpu_kernels.silu_and_mul
        new.input_layernorm = cpu_kernels.KernelRMSNorm(layer.input_layernorm)
        new.post_attention_layernorm = cpu_kernels.KernelRMSNorm(layer.post_attention_layernorm)
    return new


def shallow_copy(module: nn.Module) -> nn.Module:
    """A copy sharing parameters but with its own submodule table (so replacing one leaves the original)."""
    twin = copy.copy(module)
    twin._modules = dict(module._modules)
    return twin


class FusedPackedLinear(PackedLinear):
    """Several linears on the same input as one prepacked matrix; returns their outputs in order."""

    def __init__(self, linears: list[nn.Linear], batch_hint: int = BATCH_HINT):
        super().__init__(torch.cat([linear.weight.detach() for linear in linears]), batch_hint)
        self.sizes = [linear.out_features for linear in linears]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return super().forward(x).split(self.sizes, dim=-1)
