"""Inference-only linear layers whose kernel is picked by row count (the CPU serving fast path).

At batch 1 a decoder step is one matrix-vector product per weight matrix, so its speed is the
bandwidth at which the matrices stream from memory (the decode roofline: weight bytes / bandwidth).
Three kernels compute x Wᵀ (`Kernel`):
- PACKED: oneDNN's matmul with the weight reordered once into its blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`, the op inductor's CPU freezing pass uses), spread over
  all intra-op threads;
- PLAIN: `F.linear` on the plain weight (MKL's GEMV / GEMM, or oneDNN's AMX GEMM for bf16);
- STREAMED: our matrix-vector kernel (`nn/csrc/streamed_linear.cpp`) on a tiled copy of the weight
  that it reads as one sequential stream per thread; for bf16 on CPUs with AVX512_BF16, a register-blocked
  GEMM over panels of 48 outputs (`nn/csrc/panel_linear.cpp`, `cpu_kernels.panels`) for fp32 on CPUs with
  AVX-512 and for bf16 on CPUs with AVX512_BF16 (its pair instruction), on AMX tiles where the CPU has them
  (`nn/csrc/amx_linear.cpp`).
Which is fastest depends on the dtype, the CPU and the row count (tokens in the step); measured (2
cores, 30 layers of SmolLM2-135M's matrices; benchmarks/serve.py runs the model end to end):
- AVX-512 host with AMX (before the streamed kernel existed): fp32 at 1-2 rows PLAIN (MKL's GEMV)
  streams the matrices at 25 GB/s, PACKED at 22, and from 4 rows PACKED is ahead (1.3-1.4x at 4-16
  rows, even from 256); bf16 PACKED is 1.5x `F.linear` at 1-128 rows, and with AMX tiles, from 256
  rows PLAIN reaches oneDNN's AMX GEMM at 1,200-1,500 GFLOP/s against 900-950 for PACKED;
- AVX2 host (AMD Zen 3, 2026-11-24; oneDNN refuses to pack bf16 there): STREAMED at 1 row reads
  27 GB/s in bf16 and 32 GB/s in fp32 (a sum reads 27-30), where MKL's fp32 GEMV reads 14 and
  PACKED fp32 28; over the model's matrices STREAMED is ahead of PACKED fp32 up to 16-24 rows in
  both dtypes (bf16 at 16 rows: 38.8 against 40.0 ms), so it takes steps under 16 rows, PACKED the
  fp32 steps above and PLAIN the bf16 ones (the engine runs wide steps on an fp32 copy there anyway:
  `serve.engine.Engine.wide_steps_from`);
- AVX-512 host with AVX512_BF16, no AMX (AMD Zen 4, 2026-11-25; the tiles on huge pages, alternating
  in one process, medians of 6): STREAMED against PACKED at 1 / 4 / 8 / 16 rows, bf16 9.4 / 15.3 /
  23.7 / 40.0 ms against 15.4 / 15.0 / 16.3 / 20.8, fp32 22.0 / 25.2 / 31.2 / 45.4 against 26.2 / 24.1 /
  26.9 / 34.9 (the streamed kernel widens bf16 and does a multiply-add per weight and row, where
  oneDNN's bf16 kernel multiplies pairs of bf16 in one instruction), so STREAMED takes steps under 4
  rows there (`streamed_below`; the Zen 4 batch-1 step went from 16-21 to 8.4-11.1 ms in bf16 and
  from 56-61 to 20-25 ms in fp32), PACKED the rest. Then the bf16 streamed kernel became the pair kernel there,
  ahead of PACKED at every row count measured (1 / 4 / 16 / 32 / 256 / 2,048 rows: 8.2 / 6.7 / 13.3 / 23.0 /
  167 / 1,359 ms against 15.2 / 12.5 / 19.8 / 30.7 / 171 / 1,432), so bf16 takes STREAMED alone where the
  CPU has AVX512_BF16 without AMX (with AMX: the last entry).
  Then fp32 on AVX-512 took the same panels (one FMA per weight vector and row, against the widening kernel's
  lane reductions), 1.15-1.4x the widening kernel at 1 row (121 matrices, alternating in one process: 16.0 / 10.7
  ms against 18.3 / 14.9 in the slow / fast memory phase; one 538 MB matrix at 97-99% of a sum's bandwidth against
  87-88%), and against PACKED fp32 at 1 / 4 / 8 / 16 / 32 / 64 / 96 / 128 / 256 / 2,048 rows 16.0 / 15.9 / 18.2 /
  26.3 / 47.7 / 90.8 / 138 / 188 / 374 / 3,300 ms against 27.1 / 24.4 / 28.9 / 35.0 / 57.0 / 98.0 / 138 / 180 /
  343 / 2,880 (means of two, 2026-11-25): fp32 takes STREAMED under 96 rows there, PACKED from 96.
- AVX-512 host with AMX (a 2-core Sapphire Rapids VM, 2026-12-01; SmolLM2's 121 bf16 matrices, variants alternating
  in one process, medians): the bf16 panels on AMX tiles (`cpu_kernels.amx_panels`, csrc/amx_linear.cpp) against
  PACKED (oneDNN's AMX matmul) at 1 / 16 / 32 / 40 / 48 / 64 / 256 rows 19.3 / 20.2 / 27.2 / 40.6 / 45.5 / 44.4 / 146
  ms against 28.4 / 31.4 / 42.6 / 42.6 / 39.4 / 38.8 / 128 (the vector pair kernel there: 20.4 / 43.7 / 76.8 ms at 1 /
  16 / 32 rows: its pair instruction issues at half an FMA's rate), so bf16 takes STREAMED under 48 rows, PACKED
  from 48; PACKED against PLAIN at 256 / 512 / 1,024 / 2,048 rows 155 / 346 / 690 / 1,096 ms against 198 / 367 / 676
  / 1,104, so no plain weight is kept.
q/k/v and gate/up are each one matrix (`FusedPackedLinear`), and `add_to` folds the residual add
that follows o_proj and down_proj into the matmul: at decode batch sizes the kernel count is what
costs (the fp32 batch-1 step went from 33.0 to 31.6 ms).

`packed_for_inference(model)` returns a copy of the model whose linear layers are `PackedLinear`
(embeddings and norms shared with the original, which stays untouched and trainable). The results
differ from `F.linear` only by summation order (about 1e-6 relative in fp32). Used when the weights
are fp32 or bf16 on a CPU whose torch has oneDNN; anything else keeps `F.linear` (fp64, GPUs).
Tested in tests/nn/test_packed_linear.py, and end to end by the engine tests on the real model.
"""

from __future__ import annotations

import copy
import enum
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from mlsyslab.measure import host
from mlsyslab.nn import cpu_kernels
from mlsyslab.nn.llama import Llama

BATCH_HINT = 256  # rows the packing is tuned for; measured here it also serves batch 1 at full speed


class Kernel(enum.IntEnum):
    """How a `PackedLinear` computes x Wᵀ for a given row count (the values are `decode_layers`' codes)."""

    PLAIN = 0
    PACKED = 1
    STREAMED = 2


class PackedLinear(nn.Module):
    """y = x Wᵀ through the kernel `kernel_plan` picks for the step's row count. No bias, no gradients."""

    def __init__(self, weight: torch.Tensor, batch_hint: int = BATCH_HINT, rows: tuple = (1, math.inf),
                 owned: bool = False, dtype: torch.dtype | None = None, arena: TileArena | None = None):
        """weight [out, in]; copied unless `owned` (the layer is a snapshot: training the original changes nothing
        here), in `dtype` if given. rows: [first, last), the products it will compute — kernels only for row counts
        outside are not prepared (the engine's bf16 copy, whose wide steps run on an fp32 copy, kept a plain bf16
        weight it never used: 270 MB of SmolLM2's). arena: where the streamed tiles go once packed."""
        super().__init__()
        weight = weight.detach()
        if dtype is not None and dtype != weight.dtype:
            weight, owned = weight.to(dtype), True
        self.out_features, self.in_features = weight.shape
        self.plan = rows_plan(weight.dtype, rows)
        kernels = {kernel for _, kernel in self.plan}
        self.register_buffer("plain_weight", (weight if owned else weight.clone()) if Kernel.PLAIN in kernels else None)
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
                             if Kernel.PACKED in kernels else None)
        tiles = cpu_kernels.load().stream_pack(weight) if Kernel.STREAMED in kernels else None
        self.register_buffer("stream_tiles", arena.place(tiles) if arena is not None and tiles is not None else tiles)

    def kernel(self, rows: int) -> Kernel:
        return next(kernel for below, kernel in self.plan if rows < below)

    def weight_for(self, kernel: Kernel) -> torch.Tensor:
        return (self.plain_weight, self.packed_weight, self.stream_tiles)[kernel]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        kernel = self.kernel(rows.shape[0])
        if kernel == Kernel.PLAIN:
            out = F.linear(rows, self.plain_weight)
        elif kernel == Kernel.STREAMED:
            out = cpu_kernels.load().streamed_linear(rows, self.stream_tiles, self.out_features)
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, None, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x Wᵀ in one kernel (oneDNN's binary-add post-op, addmm, or the streamed kernel's add)."""
        rows, base = x.reshape(-1, self.in_features), residual.reshape(-1, self.out_features)
        kernel = self.kernel(rows.shape[0])
        if kernel == Kernel.PLAIN:
            out = torch.addmm(base, rows, self.plain_weight.t())
        elif kernel == Kernel.STREAMED:
            out = cpu_kernels.load().streamed_linear(rows, self.stream_tiles, self.out_features, base.contiguous())
        else:
            out = torch.ops.mkldnn._linear_pointwise.binary(rows, base, self.packed_weight, None, "add")
        return out.reshape(residual.shape)


def rows_plan(dtype: torch.dtype, rows: tuple) -> tuple[tuple[float, Kernel], ...]:
    """`kernel_plan`'s entries that serve some row count in [first, last)."""
    first, last = rows
    plan, low = [], 0
    for below, kernel in kernel_plan(dtype):
        if below > first and low < last:
            plan.append((below, kernel))
        low = below
    return tuple(plan)


def kernel_plan(dtype: torch.dtype) -> tuple[tuple[float, Kernel], ...]:
    """((below, kernel), ...): products of fewer than `below` rows (and at least the previous bound) run
    on `kernel` (measurements in the module docstring): the streamed kernel under `streamed_below()` rows
    wherever the C++ kernels build, oneDNN or the plain weight from there (and everywhere without them)."""
    wide = wide_kernel_plan(dtype)
    if cpu_kernels.load() is None:
        return wide
    below = streamed_below(dtype)
    return ((below, Kernel.STREAMED),) + tuple((bound, kernel) for bound, kernel in wide if bound > below)


def streamed_below(dtype: torch.dtype) -> float:
    """Rows under which the streamed kernel runs. Where it is the panel kernel (`cpu_kernels.panels`): every row
    count for bf16 on a CPU without AMX (on Zen 4 it led oneDNN's packed bf16 from 1 to 2,048 rows), 48 for bf16 on
    AMX tiles (`cpu_kernels.amx_panels`: ahead of oneDNN's packed AMX matmul up to 40 rows, behind from 48: module
    docstring), 96 for fp32 (on Zen 4 it led oneDNN's packed fp32 up to 64 rows, tied at 96 and trailed from 128).
    Else 16 where oneDNN cannot pack bf16 (on Zen 3 the widening kernel led oneDNN's packed fp32 up to 16-24 rows), 4
    where it can (on Zen 4 oneDNN's packed matmul caught up with the widening kernel at 4 rows and led from there)."""
    if cpu_kernels.panels(dtype):
        if dtype == torch.float32:
            return 96
        if cpu_kernels.amx_panels():
            return 48
        if not host.cpu_has_amx():
            return math.inf
    return 4 if onednn_packs_bf16() else 16


def wide_kernel_plan(dtype: torch.dtype) -> tuple[tuple[float, Kernel], ...]:
    """The plan without the streamed kernel: MKL's GEMV or oneDNN's packed matmul for fp32, oneDNN's packed
    bf16 matmul where it packs bf16 (with AMX too: its packed weight was ahead of the plain one at 256-512 rows and
    even at 1,024-2,048, module docstring), else the plain weight."""
    if dtype == torch.float32:
        return (3, Kernel.PLAIN), (math.inf, Kernel.PACKED)
    if onednn_packs_bf16():
        return ((math.inf, Kernel.PACKED),)
    return ((math.inf, Kernel.PLAIN),)


@functools.cache
def onednn_packs_bf16() -> bool:
    """Whether oneDNN reorders bf16 weights on this CPU (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16), 1)
    except (RuntimeError, AttributeError):
        return False
    return True


def can_pack(model: Llama, dtype: torch.dtype | None = None) -> bool:
    """oneDNN packing applies to fp32 / bf16 weights (`model`'s, or a copy of them in `dtype`) on a CPU with a
    oneDNN-enabled torch."""
    if not isinstance(model.lm_head, nn.Linear) or model.config.experts:  # already packed, or MoE (not packed yet)
        return False
    weight = model.lm_head.weight
    dtype = dtype or weight.dtype
    if weight.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:  # the op is private: check it exists and agrees with F.linear before relying on it
        probe = nn.Linear(8, 4, bias=False).to(dtype)
        x = torch.randn(3, 8, dtype=dtype)
        return torch.allclose(PackedLinear(probe.weight)(x).float(), probe(x).float(), atol=1e-2, rtol=1e-2)
    except (RuntimeError, AttributeError):
        return False


def packed_for_inference(model: Llama, rows: tuple = (1, math.inf), dtype: torch.dtype | None = None) -> Llama:
    """A copy of `model` for serving: q/k/v and gate/up fused into one prepacked matrix each, every
    other linear prepacked; embeddings and norm weights shared. Where the C++ kernels build
    (`nn.cpu_kernels`), RMSNorm, rope and silu·up run as one pass each. The original is untouched.
    rows: [first, last), the step sizes the copy will run (`PackedLinear`). dtype: the copy's, if not the model's —
    each matrix converted as it is packed, the embedding and norms copied in it (the engine's fp32 copy of 16-bit
    weights once converted the whole model first: 538 MB of SmolLM2's at once, for nothing)."""
    dtype = None if dtype == model.lm_head.weight.dtype else dtype
    packed = copy.copy(model)  # shallow: embeddings and norms are shared, not copied
    packed._modules = dict(model._modules)
    kernels = cpu_kernels.serves(model.lm_head.weight.new_empty(0, dtype=dtype))
    weights_dtype = dtype or model.lm_head.weight.dtype
    streamed = Kernel.STREAMED in {kernel for _, kernel in rows_plan(weights_dtype, rows)}
    arena = TileArena([shape for layer in model.layers for shape in step_shapes(layer)]
                      + [tuple(model.lm_head.weight.shape)], weights_dtype) if streamed else None
    packed.layers = nn.ModuleList(packed_layer(layer, kernels, rows, dtype, arena) for layer in model.layers)
    packed.lm_head = PackedLinear(model.lm_head.weight, rows=rows, dtype=dtype, arena=arena)
    # the streamed decode step reads the table itself, in the copy's dtype; elsewhere a 16-bit one can be widened
    packed.embed_tokens = converted(model.embed_tokens, dtype) if streamed else WidenedEmbedding.of(model.embed_tokens,
                                                                                                    dtype)
    packed.norm = converted(model.norm, dtype)
    if kernels:
        packed.norm = cpu_kernels.KernelRMSNorm(packed.norm)
    return packed.eval()


class TileArena:
    """One buffer on transparent huge pages (csrc/huge_pages.cpp) for the streamed tiles of a copy's matrices, in the
    order a step reads them, each at a 64-byte boundary: a decode step streams them all, and in 4 kB pages each page
    is a TLB miss and a stop for the prefetchers. Sized from the matrices' shapes before any is packed, so that each
    one's tiles move in as soon as they are packed (packed all first, then moved, they were held twice while building:
    ~270 MB of SmolLM2's bf16 copy)."""

    def __init__(self, shapes: list[tuple[int, int]], dtype: torch.dtype):
        group, chunk = cpu_kernels.load().stream_pack(torch.zeros(1, 1, dtype=dtype)).shape[2:]  # a tile's rows, inputs
        self.sizes = [_aligned(-(-out // group) * -(-inputs // chunk) * group * chunk * dtype.itemsize)
                      for out, inputs in shapes]
        self.buffer = cpu_kernels.huge_page_zeros((sum(self.sizes),), torch.uint8)
        self.placed = self.offset = 0

    def place(self, tiles: torch.Tensor) -> torch.Tensor:
        """`tiles` copied into the next matrix's place (the order of `shapes`)."""
        if self.placed == len(self.sizes) or _aligned(tiles.nbytes) != self.sizes[self.placed]:
            raise ValueError(f"tiles of {tiles.nbytes} bytes are not the next matrix's of the arena's shapes")
        start, self.offset, self.placed = self.offset, self.offset + self.sizes[self.placed], self.placed + 1
        return self.buffer[start:start + tiles.nbytes].view(tiles.dtype).view(tiles.shape).copy_(tiles)


def _aligned(size: int) -> int:
    return -(-size // 64) * 64


def step_shapes(layer: nn.Module) -> list[tuple[int, int]]:
    """[out, in] of a decoder layer's matrices as its serving copy fuses them, in step order: q|k|v, o, gate|up,
    down."""
    attention, mlp = layer.self_attn, layer.mlp
    fused = lambda *linears: (sum(linear.out_features for linear in linears), linears[0].in_features)  # noqa: E731
    return [fused(attention.q_proj, attention.k_proj, attention.v_proj), fused(attention.o_proj),
            fused(mlp.gate_proj, mlp.up_proj), fused(mlp.down_proj)]


def packed_layer(layer: nn.Module, kernels: bool, rows: tuple, dtype: torch.dtype | None = None,
                 arena: TileArena | None = None) -> nn.Module:
    attention, mlp = shallow_copy(layer.self_attn), shallow_copy(layer.mlp)
    names = ("q_proj", "k_proj", "v_proj")
    attention.fused_qkv = FusedPackedLinear([attention._modules.pop(name) for name in names], rows=rows, dtype=dtype,
                                            arena=arena)
    attention.o_proj = PackedLinear(attention.o_proj.weight, rows=rows, dtype=dtype, arena=arena)
    names = ("gate_proj", "up_proj")
    mlp.fused_gate_up = FusedPackedLinear([mlp._modules.pop(name) for name in names], rows=rows, dtype=dtype,
                                          arena=arena)
    mlp.down_proj = PackedLinear(mlp.down_proj.weight, rows=rows, dtype=dtype, arena=arena)
    if attention.q_norm is not None:
        attention.q_norm, attention.k_norm = converted(attention.q_norm, dtype), converted(attention.k_norm, dtype)
    new = shallow_copy(layer)
    new.self_attn, new.mlp = attention, mlp
    new.input_layernorm = converted(layer.input_layernorm, dtype)
    new.post_attention_layernorm = converted(layer.post_attention_layernorm, dtype)
    if kernels:
        attention.rope, mlp.silu_and_mul = cpu_kernels.rope, cpu_kernels.silu_and_mul
        if attention.q_norm is not None:
            attention.q_norm, attention.k_norm = map(cpu_kernels.KernelRMSNorm, (attention.q_norm, attention.k_norm))
        new.input_layernorm = cpu_kernels.KernelRMSNorm(new.input_layernorm)
        new.post_attention_layernorm = cpu_kernels.KernelRMSNorm(new.post_attention_layernorm)
    return new


def converted(module: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """`module` itself, or a copy of it in `dtype`."""
    return module if dtype is None else copy.deepcopy(module).to(dtype)


class WidenedEmbedding(nn.Module):
    """A 16-bit embedding's rows looked up, then widened to fp32 (exact): the engine's fp32 copy for wide steps
    shares the 16-bit table instead of holding its own fp32 one (113 MB of SmolLM2's; the tied head is packed
    apart anyway). It has no `weight`: a copy whose streamed decode step reads the table keeps its own."""

    def __init__(self, embedding: nn.Embedding, dtype: torch.dtype):
        super().__init__()
        self.embedding, self.dtype = embedding, dtype

    @staticmethod
    def of(embedding: nn.Embedding, dtype: torch.dtype | None) -> nn.Module:
        """`embedding` itself, widened where `dtype` holds its values exactly, else a copy in `dtype`."""
        exact = dtype == torch.float32 and embedding.weight.dtype in (torch.bfloat16, torch.float16)
        return WidenedEmbedding(embedding, dtype) if exact else converted(embedding, dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(input_ids).to(self.dtype)


def shallow_copy(module: nn.Module) -> nn.Module:
    """A copy sharing parameters but with its own submodule table (so replacing one leaves the original)."""
    twin = copy.copy(module)
    twin._modules = dict(module._modules)
    return twin


class FusedPackedLinear(PackedLinear):
    """Several linears on the same input as one prepacked matrix; returns their outputs in order. Their biases
    (all or none: Qwen2's q/k/v) are added after the product, as one add over the fused row (`bias`), which the C++
    decode steps repeat in the same dtype (nn/csrc/decode_layers.cpp, streamed_decode.cpp)."""

    def __init__(self, linears: list[nn.Linear], batch_hint: int = BATCH_HINT, rows: tuple = (1, math.inf),
                 dtype: torch.dtype | None = None, arena: TileArena | None = None):
        super().__init__(torch.cat([linear.weight.detach() for linear in linears]), batch_hint, rows, owned=True,
                         dtype=dtype, arena=arena)
        self.sizes = [linear.out_features for linear in linears]
        biased = [linear.bias is not None for linear in linears]
        if any(biased) and not all(biased):
            raise ValueError("fused linears have biases all or none")
        bias = torch.cat([linear.bias.detach() for linear in linears]) if all(biased) else None
        self.register_buffer("bias", bias.to(dtype) if bias is not None and dtype is not None else bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = super().forward(x)
        if self.bias is not None:
            out += self.bias
        return out.split(self.sizes, dim=-1)
