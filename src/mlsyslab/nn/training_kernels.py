"""The training model's RMSNorm, rope, SwiGLU activation and causal attention: each forward one pass, and where
gradients are wanted an autograd function whose backward is one pass too.

On CPU PyTorch's autograd takes F.rms_norm apart into its composite formula (ten-odd kernels over the whole
activation in the backward, and fp32 copies of the input and the normalised input kept for it), rope's
concatenation of halves into slices and zero-filled copies, and silu(gate) * up into three kernels (silu(gate)
kept too); their forwards are several kernels each (F.rms_norm on a CPU: square, mean, add, rsqrt, two multiplies).
Here, for fp32 and bf16 CPU tensors where the C++ kernels build (`on_kernels`), every forward is one C++ pass — the
norm, rope and silu·up the serving copy's kernels (csrc/layer_ops.cpp: `rms_norm`, `rope_`, `silu_and_mul`) — with
gradients or without, so a pass with gradients and one without see the same numbers (RLHF's first ratio of new to old
log-probabilities is exactly 1), and the same as the serving copy's layers. Where gradients are wanted:
- `rms_norm` keeps the input and each row's fp32 rstd (the kernel's `rms_norm_rstd` returns it, as torch's
  `_fused_rms_norm` does); backward `rms_norm_backward`;
- `rope` keeps cos and sin; backward the rotation by minus the angle (the transpose of a rotation), `rope_` with the
  sin negated;
- `silu_and_mul` keeps gate and up; backward `silu_and_mul_backward` (csrc/layer_grads.cpp);
- `causal_attention` (csrc/causal_attention.cpp, head_dim a multiple of 16; in bf16 on AMX tiles the forward is
  csrc/prompt_attention.cpp's, the serving copy's prefill kernel, and the backward csrc/causal_attention_tiles.cpp's)
  keeps q, k, v, the output and each row's fp32 log-sum-exp, as torch's CPU flash attention does; backward
  FlashAttention-2's, recomputing the probabilities.
Elsewhere (fp64, no compiler, GPUs) the same functions run torch's ops — `_fused_rms_norm`, `apply_rope`,
F.silu(gate) * up, scaled_dot_product_attention — and the same backward formulas in PyTorch ops (attention: torch's
own backward); on a GPU the norm is F.rms_norm, torch's fused kernel, whose backward keeps the same input and rstd.
So what a layer keeps for backward is the same on every device (`predict.memory.eager_activation_bytes_per_layer`
counts it). The kernels' forwards are within a rounding of torch's ops (in bf16 rope and silu·up bit-equal; the
norm's sum of squares runs in another order) and the gradients as close to exact as autograd's
(tests/nn/test_training_kernels.py). DTensors (torch's own tensor parallelism) keep the plain ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlsyslab.nn import cpu_kernels
from mlsyslab.nn.rope import apply_rope


def plain(*tensors: torch.Tensor) -> bool:
    """Whether these are plain floating-point tensors (not DTensors or another subclass) of one dtype and device."""
    first = tensors[0]
    return first.is_floating_point() and all(type(t) in (torch.Tensor, nn.Parameter) and t.dtype == first.dtype
                                             and t.device == first.device for t in tensors)


def applies(*tensors: torch.Tensor) -> bool:
    """Whether these tensors take the autograd functions here: some need a gradient, all `plain`."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors) and plain(*tensors)


on_kernels = cpu_kernels.serves  # whether the C++ kernels take a tensor: fp32 or bf16 on a CPU, the kernels built


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        if on_kernels(x):
            out, rstd = cpu_kernels.load().rms_norm_rstd(x, weight, eps)
        else:
            out, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        if on_kernels(x):
            dx, dw = cpu_kernels.load().rms_norm_backward(grad.contiguous(), x, rstd, weight)
            return dx, dw, None
        compute = torch.promote_types(x.dtype, torch.float32)
        normed, grad_w = x.to(compute) * rstd, grad.to(compute) * weight.to(compute)
        dx = rstd * (grad_w - normed * (grad_w * normed).mean(-1, keepdim=True))
        dw = (grad.to(compute) * normed).flatten(0, -2).sum(0)
        return dx.to(x.dtype), dw.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm over the last dimension: as `RMSNormFunction` where gradients are wanted on a CPU, else on the
    kernels where they take x."""
    if applies(x, weight) and x.device.type == "cpu":  # (under sequence parallelism x comes sequence-major: the copy is what it keeps)
        return RMSNormFunction.apply(x.contiguous(), weight, eps)
    if on_kernels(x) and plain(x, weight):
        return cpu_kernels.load().rms_norm(x.contiguous(), weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, signed_sin):
        ctx.save_for_backward(cos, signed_sin)
        return rotated(x, cos, signed_sin)

    @staticmethod
    def backward(ctx, grad):
        cos, signed_sin = ctx.saved_tensors
        return rotated(grad, cos, -signed_sin), None, None


def rotated(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """A rotated copy of x [B, T, heads, d]: `rope_` on a fresh copy where the kernels take x, else `apply_rope`."""
    if not on_kernels(x):
        return apply_rope(x, cos, signed_sin)
    rows = (*x.shape[:2], 1, x.shape[-1])  # the tables per token, where they were broadcast over the batch
    return cpu_kernels.rope(x.clone(memory_format=torch.contiguous_format), cos.expand(rows), signed_sin.expand(rows))


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`nn.rope.apply_rope` of x [B, T, heads, d] with cos / signed sin [B, T, 1, d] (or broadcast to it), as
    `RopeFunction` where gradients are wanted."""
    if x.dim() == 4 and applies(x, cos, signed_sin):
        return RopeFunction.apply(x, cos, signed_sin)
    if x.dim() == 4 and plain(x, cos, signed_sin):
        return rotated(x, cos, signed_sin)
    return apply_rope(x, cos, signed_sin)


class SiluAndMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return activated(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        if on_kernels(gate):
            return cpu_kernels.load().silu_and_mul_backward(grad.contiguous(), gate, up)
        compute = torch.promote_types(gate.dtype, torch.float32)
        g, x = grad.to(compute), gate.to(compute)
        sigmoid = torch.sigmoid(x)
        d_gate = g * up.to(compute) * sigmoid * (1 + x * (1 - sigmoid))
        return d_gate.to(gate.dtype), (g * F.silu(gate).to(compute)).to(up.dtype)  # silu rounded as the forward's


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up, as `SiluAndMulFunction` where gradients are wanted."""
    if applies(gate, up) and gate.shape == up.shape:
        return SiluAndMulFunction.apply(gate.contiguous(), up.contiguous())
    if plain(gate, up) and gate.shape == up.shape:
        return activated(gate.contiguous(), up.contiguous())
    return F.silu(gate) * up


def activated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up of two contiguous tensors of one shape: `silu_and_mul` where the kernels take them."""
    return cpu_kernels.silu_and_mul(gate, up) if on_kernels(gate) else F.silu(gate) * up


class CausalAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        out, lse = attention_forward(q, k, v, with_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors  # q, k, v, out, lse
        return cpu_kernels.load().causal_attention_backward(grad.contiguous(), *saved,
                                                            tiles=cpu_kernels.serves_prompt_attention(saved[0]))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of q [B, T, heads, d] over k, v [B, T, kv_heads, d] (grouped-query), scale 1/√d, as
    [B, T, heads, d]: csrc/causal_attention.cpp where the kernels take the tensors (head_dim a multiple of 16) and
    there is a (sequence, KV head) for every thread (the kernel's unit of work: with fewer, threads would idle where
    torch's flash attention splits by query blocks too), with gradients (`CausalAttentionFunction`, keeping q, k, v,
    the output and each row's fp32 log-sum-exp, as torch's CPU flash attention keeps them) or without; else torch's
    scaled_dot_product_attention."""
    units = q.shape[0] * k.shape[2]
    if plain(q, k, v) and on_kernels(q) and q.shape[-1] % 16 == 0 and units >= torch.get_num_threads():
        if applies(q, k, v):
            return CausalAttentionFunction.apply(q, k, v)
        return attention_forward(q, k, v, with_lse=False)[0]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=q.shape[1] > 1, enable_gqa=True)
    return out.transpose(1, 2)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, with_lse: bool):
    """The kernels' causal attention of q [B, T, heads, d] (and `with_lse`, each row's log-sum-exp [B, heads, T] in
    fp32, else None): in bf16 where the CPU has AMX tiles and `prompt_attention` takes it (head_dim 32, 64 or 128: each
    sequence a whole prompt; its products on tiles, P rounded to bf16 as torch's flash attention rounds it), else
    csrc/causal_attention.cpp's forward. At every length: the serving prefill leaves prompts over
    `paged_attention.TILED_PROMPTS_UP_TO` tokens to torch's flash attention, faster there, but the backward needs each
    row's log-sum-exp, which torch's public SDPA does not return, and the tiles ran 1.4-2.3x the FMA forward's speed
    from 256 to 4,096 tokens (4 heads of 64 over 2 KV heads, 1 and 2 threads, Sapphire Rapids VM, 2026-12-02; torch's
    SDPA forward took 0.71-1.0x the tiles' time, its backward 1.4-5x the tiles backward's)."""
    batch, tokens, heads, dim = q.shape
    if not cpu_kernels.serves_prompt_attention(q):
        out, lse = cpu_kernels.load().causal_attention_forward(q, k, v)
        return out, lse if with_lse else None
    out = torch.empty(q.shape, dtype=q.dtype)
    lse = torch.empty(heads, batch * tokens) if with_lse else None
    starts = torch.arange(batch) * tokens
    cpu_kernels.load().prompt_attention(q.reshape(-1, heads, dim), k.reshape(-1, *k.shape[2:]),
                                        v.reshape(-1, *v.shape[2:]), starts, torch.full_like(starts, tokens),
                                        out.view(-1, heads, dim), lse)
    return out, None if lse is None else lse.view(heads, batch, tokens).transpose(0, 1).contiguous()
