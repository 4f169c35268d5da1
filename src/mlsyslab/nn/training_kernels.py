"""The training path's RMSNorm, rope and SwiGLU activation as autograd functions, each backward one pass.

On CPU PyTorch's autograd takes F.rms_norm apart into its composite formula (ten-odd kernels over the whole
activation in the backward, and fp32 copies of the input and the normalised input kept for it), rope's
concatenation of halves into slices and zero-filled copies, and silu(gate) * up into three kernels (silu(gate)
kept too). Here, wherever gradients are wanted:
- `rms_norm`: forward torch's own `_fused_rms_norm` (what F.rms_norm runs; it returns the reciprocal RMS), keeping
  the input and that rstd; backward `rms_norm_backward`;
- `rope`: forward `nn.rope.apply_rope`, keeping cos and sin; backward the rotation by minus the angle (the
  transpose of a rotation), the serving copy's kernel `rope_` with the sin negated;
- `silu_and_mul`: forward torch's F.silu(gate) * up, keeping gate and up; backward `silu_and_mul_backward`.
The backward passes are C++ (csrc/layer_grads.cpp) for fp32 and bf16 CPU tensors where the kernels build, the same
formulas in PyTorch ops elsewhere (fp64, no compiler, and for rope and silu·up GPUs; on a GPU F.rms_norm is torch's
fused kernel, whose backward keeps the same input and rstd), so what a layer keeps for backward is the same on every
device (`predict.memory.eager_activation_bytes_per_layer` counts it). Every forward gives the plain ops' bits, so a
pass with gradients and one without see the same numbers (RLHF's first ratio of new to old log-probabilities is
exactly 1); the gradients differ from autograd's by rounding (tests/nn/test_training_kernels.py). DTensors (torch's
own tensor parallelism) keep the plain ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlsyslab.nn import cpu_kernels
from mlsyslab.nn.rope import apply_rope


def applies(*tensors: torch.Tensor) -> bool:
    """Whether these tensors take the functions here: some need a gradient, all plain floating-point tensors of one
    dtype and device."""
    first = tensors[0]
    return (torch.is_grad_enabled() and any(t.requires_grad for t in tensors) and first.is_floating_point()
            and all(type(t) in (torch.Tensor, nn.Parameter) and t.dtype == first.dtype and t.device == first.device
                    for t in tensors))


on_kernels = cpu_kernels.serves  # whether the C++ backward takes a tensor: fp32 or bf16 on a CPU, the kernels built


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
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
    """F.rms_norm over the last dimension, as `RMSNormFunction` where gradients are wanted on a CPU."""
    if applies(x, weight) and x.device.type == "cpu":  # (under sequence parallelism x comes sequence-major: the copy is what it keeps)
        return RMSNormFunction.apply(x.contiguous(), weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, signed_sin):
        ctx.save_for_backward(cos, signed_sin)
        return apply_rope(x, cos, signed_sin)

    @staticmethod
    def backward(ctx, grad):
        cos, signed_sin = ctx.saved_tensors
        if not on_kernels(grad):
            return apply_rope(grad, cos, -signed_sin), None, None
        rows = (*grad.shape[:2], 1, grad.shape[-1])  # the tables per token, where they were broadcast over the batch
        return cpu_kernels.rope(grad.contiguous().clone(), cos.expand(rows), (-signed_sin).expand(rows)), None, None


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`nn.rope.apply_rope` of x [B, T, heads, d] with cos / signed sin [B, T, 1, d] (or broadcast to it), as
    `RopeFunction` where gradients are wanted."""
    if x.dim() == 4 and applies(x, cos, signed_sin):
        return RopeFunction.apply(x, cos, signed_sin)
    return apply_rope(x, cos, signed_sin)


class SiluAndMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

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
    return F.silu(gate) * up
