"""The C++ serving kernels (nn/csrc) compute what the PyTorch path computes, and refuse bad input."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mlsyslab.measure import host
from mlsyslab.nn import cpu_kernels, paged_attention, training_kernels
from mlsyslab.nn.llama import Llama, LlamaConfig, RMSNorm
from mlsyslab.nn.rope import apply_rope, rope_cos_sin, rope_inverse_frequencies
from mlsyslab.nn.packed_linear import packed_for_inference
from mlsyslab.nn.paged_attention import PagedAttention, SequenceSlice, cache_rows, decode_attention, decode_batch

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C++ kernels did not build here")


def paged_case(dtype, head_dim, heads, kv_heads, lengths, block_size=16, num_blocks=64, seed=0, query_scale=1.0):
    """A pool with random contents and each sequence's blocks scattered over it in random order; the queries (fp32)
    hold values of the cache's dtype, as a model's do (the kernel may read them in that dtype: with AVX512_BF16,
    bf16 pair dot products for q·k)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (kv_heads, num_blocks, block_size, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for length in lengths:
        count = -(-length // block_size)
        tables.append(order[:count])
        order = order[count:]
    query = (torch.randn(len(lengths), heads, head_dim, generator=generator) * query_scale).to(dtype).float()
    return query, k_cache, v_cache, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, heads, kv_heads", [(64, 9, 3), (32, 4, 4), (128, 8, 2)])
@pytest.mark.parametrize("lengths", [[1], [200], [5, 16, 17, 130, 33]])
@pytest.mark.parametrize("block_size", [8, 16, 48])  # chunks of 16 tokens: part of one, one, three per block
def test_paged_decode_reads_the_blocks_in_place_like_the_gathered_path(dtype, head_dim, heads, kv_heads, lengths,
                                                                        block_size):
    query, k_cache, v_cache, tables = paged_case(dtype, head_dim, heads, kv_heads, lengths, block_size, num_blocks=64)
    padded, mask, longest = decode_batch(tables, lengths, block_size, "cpu")
    expected = decode_attention(query, k_cache.float(), v_cache.float(), cache_rows(padded, k_cache.shape), mask, longest)
    got = cpu_kernels.load().paged_decode_attention(query, k_cache, v_cache, padded, torch.tensor(lengths),
                                                    head_dim ** -0.5)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_is_as_accurate_as_torch_fp32_on_peaked_softmaxes(dtype):
    """Scores spanning hundreds (the online softmax rescales its running sums many times, and weights far
    below the maximum underflow): fp32 rounding of the scores themselves then moves the weights by ~1e-5,
    so the kernel is held to the fp32 PyTorch path's own distance from an fp64 reference."""
    lengths = [700, 3, 333]
    query, k_cache, v_cache, tables = paged_case(dtype, 64, 8, 2, lengths, num_blocks=80, query_scale=30)
    padded, mask, longest = decode_batch(tables, lengths, 16, "cpu")
    rows = cache_rows(padded, k_cache.shape)
    exact = decode_attention(query.double(), k_cache.double(), v_cache.double(), rows, mask, longest)
    torch_fp32 = decode_attention(query, k_cache.float(), v_cache.float(), rows, mask, longest)
    got = cpu_kernels.load().paged_decode_attention(query, k_cache, v_cache, padded, torch.tensor(lengths), 0.125)
    torch_error = (torch_fp32.double() - exact).abs().max().item()
    assert (got.double() - exact).abs().max().item() <= 2 * torch_error + 1e-6


def test_paged_decode_refuses_a_length_past_its_table_or_a_block_outside_the_pool():
    query, k_cache, v_cache, tables = paged_case(torch.float32, 64, 9, 3, [20])
    padded = torch.tensor(tables)
    kernel = cpu_kernels.load().paged_decode_attention
    with pytest.raises(RuntimeError, match=r"lengths\[0\] = 33"):
        kernel(query, k_cache, v_cache, padded, torch.tensor([33]), 0.125)
    with pytest.raises(RuntimeError, match=r"tables\[0\]\[1\] = 64: not a block of the pool"):
        kernel(query, k_cache, v_cache, torch.tensor([[tables[0][0], 64]]), torch.tensor([20]), 0.125)
    with pytest.raises(RuntimeError, match="head_dim: 32, 64 or 128"):
        kernel(query[..., :48].contiguous(), k_cache[..., :48].contiguous(), v_cache[..., :48].contiguous(), padded,
               torch.tensor([20]), 0.125)


def bf16_ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable bf16 values lie between a and b (same-sign values)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_torch_fused_rms_norm(dtype):
    generator = torch.Generator().manual_seed(1)
    x = (torch.randn(37, 576, generator=generator) * 3).to(dtype)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = (1 + torch.randn(576, generator=generator) * 0.1).to(dtype)
    got, expected = cpu_kernels.KernelRMSNorm(norm)(x), norm(x)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    else:  # fp32 sums in another order: the one rounding to bf16 may land one step away, rarely
        ulps = bf16_ulps_apart(got, expected)
        assert ulps.max() <= 1 and (ulps == 0).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_rounds_as_silu_then_mul(dtype):
    gate_up = torch.randn(1, 19, 2 * 1536, generator=torch.Generator().manual_seed(2)).to(dtype) * 4
    gate, up = gate_up.split(1536, dim=-1)  # the fused matmul's two halves: views with a row stride of 3072
    got = cpu_kernels.silu_and_mul(gate, up)
    expected = F.silu(gate) * up
    assert got.shape == expected.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    else:
        silu = cpu_kernels.silu_and_mul(gate, torch.ones_like(gate_up).split(1536, dim=-1)[1])  # its silu, in bf16
        assert torch.equal(got, (silu.float() * up.float()).to(dtype))  # then rounded again after the product
        # its fp32 exp may differ from torch's in the last bit: a different bf16 rounding only at a midpoint
        ulps = bf16_ulps_apart(silu, F.silu(gate))
        assert ulps.max() <= 1 and (ulps == 0).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_of_a_very_negative_gate_is_about_zero_not_nan(dtype):
    """Gates past e^-g's overflow (under -88.7) and just before it: silu(g)·up is ~0, as torch's, never NaN (and at
    -50 torch's value to a few fp32 ulps: the kernel's exp is not libm's)."""
    gate = torch.tensor([[-1e4, -200.0, -100.0, -88.8, -88.6, -50.0] * 8], dtype=dtype)  # 48: whole vectors and a tail
    up = torch.full_like(gate, 3.0)
    got = cpu_kernels.silu_and_mul(gate, up)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), (F.silu(gate) * up).float(), atol=1e-30, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_equals_apply_rope_on_a_view_of_the_fused_qkv_output(dtype):
    config = LlamaConfig(vocab=64, hidden=64, layers=1, heads=9, kv_heads=3, head_dim=64, ffn_hidden=64, max_seq=4096)
    tokens = 23
    qkv = torch.randn(1, tokens, (9 + 2 * 3) * 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    q = qkv[..., :9 * 64].view(1, tokens, 9, 64)
    positions = torch.randint(4096, (1, tokens))
    cos, sin = rope_cos_sin(rope_inverse_frequencies(config), positions, dtype)
    expected = apply_rope(q.clone(), cos, sin)
    rotated = cpu_kernels.rope(q, cos, sin)
    assert rotated.data_ptr() == qkv.data_ptr()  # in place, in the fused buffer
    torch.testing.assert_close(q, expected, atol=1e-6, rtol=1e-6) if dtype == torch.float32 else \
        torch.testing.assert_close(q, expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 0.05)])
def test_serving_copy_with_kernels_matches_the_plain_model(dtype, tolerance):
    config = LlamaConfig(vocab=96, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=32, ffn_hidden=128, max_seq=128)
    model = Llama(config).initialize(0.1, torch.Generator().manual_seed(0)).to(dtype).eval()
    packed = packed_for_inference(model)
    assert isinstance(packed.layers[0].input_layernorm, cpu_kernels.KernelRMSNorm)
    assert packed.layers[0].self_attn.rope is cpu_kernels.rope and model.layers[0].self_attn.rope is training_kernels.rope
    ids = torch.randint(config.vocab, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).float(), model(ids).float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, out, inputs", [(1, 576, 576), (3, 1536, 576), (2, 37, 29), (5, 100, 77), (4, 4096, 64),
                                             (17, 960, 1536), (33, 100, 77)])
def test_streamed_linear_rounds_the_exact_product_once(dtype, rows, out, inputs):
    """fp32 sums of the weights' values, plus the residual, rounded once to the weights' dtype: within one
    unit in the last place of the fp64 product rounded (ties and the fp32 sum decide the last bit), with
    outputs and inputs that do not fill whole tiles, split over threads (4,096 outputs), and rows past one block of
    AMX tiles (17, 33)."""
    generator = torch.Generator().manual_seed(rows * out)
    weight = torch.randn(out, inputs, generator=generator).to(dtype)
    x, residual = torch.randn(rows, inputs, generator=generator).to(dtype), torch.randn(rows, out, generator=generator).to(dtype)
    ops = cpu_kernels.load()
    tiles = ops.stream_pack(weight)
    mantissa_bits = 8 if dtype == torch.bfloat16 else 24
    for got, exact in ((ops.streamed_linear(x, tiles, out), x.double() @ weight.double().T),
                       (ops.streamed_linear(x, tiles, out, residual), x.double() @ weight.double().T + residual.double())):
        assert got.dtype == dtype and got.shape == (rows, out)
        unit = 2.0 ** (torch.frexp(exact.float())[1].double() - mantissa_bits)  # one unit in the last place of each value
        error = (got.double() - exact).abs()
        if dtype == torch.bfloat16:
            assert (error <= unit * 0.5 + 1e-6 * exact.abs().max()).float().mean() > 0.99
            assert (error <= unit).all()
        else:  # fp32 sums of `inputs` products: a few units of fp32 rounding, relative to the terms' size
            assert (error <= 4 * inputs * 2.0 ** -24 * (x.double().abs() @ weight.double().abs().T + 1)).all()
    alone = torch.cat([ops.streamed_linear(x[r:r + 1], tiles, out, residual[r:r + 1]) for r in range(rows)])
    assert torch.equal(alone, ops.streamed_linear(x, tiles, out, residual))  # a row's result does not depend on the batch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_streamed_linear_of_no_rows_is_empty(dtype):
    """A product of no rows is an empty [0, out] (with and without the residual), not a fault: AMX tiles are
    configured with the call's rows, and tiles of 0 rows are no valid configuration."""
    ops = cpu_kernels.load()
    tiles = ops.stream_pack(torch.randn(96, 64).to(dtype))
    x, residual = torch.empty(0, 64, dtype=dtype), torch.empty(0, 96, dtype=dtype)
    for y in (ops.streamed_linear(x, tiles, 96), ops.streamed_linear(x, tiles, 96, residual)):
        assert y.shape == (0, 96) and y.dtype == dtype


AMX_CASES = [(1, 576, 576), (16, 96, 1536), (17, 960, 64), (40, 100, 77)]  # rows, out, inputs


def vector_and_tile_products(cases) -> list[torch.Tensor]:
    """residual + x·Wᵀ of each case's seeded bf16 operands, by the streamed kernel as this process runs it."""
    ops, products = cpu_kernels.load(), []
    for rows, out, inputs in cases:
        generator = torch.Generator().manual_seed(rows * out + inputs)
        weight, x = torch.randn(out, inputs, generator=generator).bfloat16(), torch.randn(rows, inputs, generator=generator).bfloat16()
        products.append(ops.streamed_linear(x, ops.stream_pack(weight), out, torch.randn(rows, out, generator=generator).bfloat16()))
    return products


@pytest.mark.skipif(not host.cpu_has_amx(), reason="no AMX tiles on this CPU")
def test_bf16_panels_take_amx_tiles_and_agree_with_the_vector_kernel(tmp_path):
    """On a CPU with AMX the bf16 panel products run on tiles (csrc/amx_linear.cpp); with MLSYS_AMX=0 (a process of
    its own) on the vector kernel: the same sums, but for the last bit of a few outputs in 10^4 (the hardware's order
    within an input pair), over one, two and three blocks of 16 rows and inputs that leave steps past the last tile."""
    assert cpu_kernels.amx_panels()
    saved = tmp_path / "vector.pt"
    script = ("import sys, torch; sys.path.insert(0, {tests!r}); from test_cpu_kernels import *; "
              "assert not cpu_kernels.amx_panels(); torch.save(vector_and_tile_products(AMX_CASES), {saved!r})")
    subprocess.run([sys.executable, "-c", script.format(tests=str(Path(__file__).parent), saved=str(saved))],
                   env={**os.environ, "MLSYS_AMX": "0"}, check=True)
    for tiles, vector in zip(vector_and_tile_products(AMX_CASES), torch.load(saved)):
        differ = tiles != vector
        assert differ.float().mean() < 1e-3
        assert ((tiles.float() - vector.float()).abs()[differ] <= vector.float().abs()[differ] * 2.0 ** -7).all()


def packed_prompts(lengths, heads, kv_heads, head_dim, seed=0):
    """q, k, v [tokens, heads, head_dim] bf16 as views of one fused q|k|v output (token stride = its row), and the
    prompts' starts and lengths packed back to back."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lengths), (heads + 2 * kv_heads) * head_dim, generator=generator).bfloat16()
    q, k, v = (part.unflatten(1, (-1, head_dim)) for part in
               qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1))
    starts = torch.tensor([sum(lengths[:i]) for i in range(len(lengths))])
    return q, k, v, starts, torch.tensor(lengths)


def causal_sdpa(q, k, v, start, length, dtype):
    return F.scaled_dot_product_attention(*(x[start:start + length].transpose(0, 1).to(dtype) for x in (q, k, v)),
                                          is_causal=True, enable_gqa=True).transpose(0, 1)


needs_prompt_attention = pytest.mark.skipif(not cpu_kernels.serves_prompt_attention(torch.zeros(1, 64).bfloat16()),
                                            reason="prompt_attention needs AMX tiles")


@needs_prompt_attention
@pytest.mark.parametrize("head_dim, heads, kv_heads", [(64, 9, 3), (32, 4, 4), (128, 8, 2)])
def test_prompt_attention_is_within_torch_bf16_rounding_of_exact_attention(head_dim, heads, kv_heads):
    """Whole prompts of 1 to 130 tokens (part of a block of 16 queries, one, several, a half chunk of 32 keys):
    against fp32 attention of the same bf16 inputs, each prompt within twice torch's own bf16 SDPA's distance."""
    lengths = [1, 5, 16, 17, 33, 100, 130]
    q, k, v, starts, lens = packed_prompts(lengths, heads, kv_heads, head_dim)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    cpu_kernels.load().prompt_attention(q, k, v, starts, lens, out)
    for start, length in zip(starts.tolist(), lengths):
        exact = causal_sdpa(q, k, v, start, length, torch.float32)
        torch_error = (causal_sdpa(q, k, v, start, length, torch.bfloat16).float() - exact).abs().max().item()
        assert (out[start:start + length].float() - exact).abs().max().item() <= 2 * torch_error + 1e-3


@needs_prompt_attention
def test_prompt_attention_of_a_prompt_does_not_depend_on_the_others():
    lengths = [40, 7, 128]
    q, k, v, starts, lens = packed_prompts(lengths, 9, 3, 64, seed=1)
    together = torch.empty(q.shape, dtype=torch.bfloat16)
    cpu_kernels.load().prompt_attention(q, k, v, starts, lens, together)
    for start, length in zip(starts.tolist(), lengths):
        alone = torch.empty(q.shape, dtype=torch.bfloat16)
        cpu_kernels.load().prompt_attention(q, k, v, torch.tensor([start]), torch.tensor([length]), alone)
        assert torch.equal(alone[start:start + length], together[start:start + length])


@needs_prompt_attention
def test_prompt_attention_gives_each_rows_log_sum_exp():
    """With `lse` [heads, tokens], each query row's log Σ exp(q·k/√d) over the keys it sees (what the training
    model's backward takes), within fp32 rounding of the exact value; the output as without it."""
    lengths = [5, 40]
    q, k, v, starts, lens = packed_prompts(lengths, 4, 2, 64, seed=3)
    out, plain = torch.empty(q.shape, dtype=torch.bfloat16), torch.empty(q.shape, dtype=torch.bfloat16)
    lse = torch.empty(4, sum(lengths))
    cpu_kernels.load().prompt_attention(q, k, v, starts, lens, out, lse)
    cpu_kernels.load().prompt_attention(q, k, v, starts, lens, plain)
    assert torch.equal(out, plain)
    for start, length in zip(starts.tolist(), lengths):
        queries = q[start:start + length].double().transpose(0, 1)  # [heads, tokens, d]
        keys = k[start:start + length].double().transpose(0, 1).repeat_interleave(2, dim=0)
        scores = queries @ keys.transpose(1, 2) / 8.0
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
        torch.testing.assert_close(lse[:, start:start + length].double(), scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="lse: contiguous fp32"):
        cpu_kernels.load().prompt_attention(q, k, v, starts, lens, out, torch.empty(4, 3))


@needs_prompt_attention
def test_prompt_attention_refuses_prompts_outside_the_tokens_and_other_dtypes():
    q, k, v, starts, lens = packed_prompts([8, 8], 4, 2, 64)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"prompt 1 \(start 8, length 9\) outside the 16 tokens"):
        cpu_kernels.load().prompt_attention(q, k, v, starts, torch.tensor([8, 9]), out)
    with pytest.raises(RuntimeError, match="q, k, v, out: bf16"):
        cpu_kernels.load().prompt_attention(q.float(), k, v, starts, lens, out)


@needs_prompt_attention
@pytest.mark.parametrize("tiled_up_to", [1024, 30])
def test_paged_attention_takes_whole_prompts_to_the_kernel_beside_a_decode(monkeypatch, tiled_up_to):
    """A step of two whole prompts and a decode (bf16, head_dim 64): the prompts' rows through `prompt_attention`
    (the one over `TILED_PROMPTS_UP_TO` tokens through torch's SDPA beside it) within a bf16 rounding of torch's SDPA
    path, the decode's row the same either way."""
    monkeypatch.setattr(paged_attention, "TILED_PROMPTS_UP_TO", tiled_up_to)
    lengths = [20, 1, 37]
    q, k, v, _, _ = packed_prompts(lengths, 9, 3, 64, seed=2)
    k_cache = torch.randn(1, 3, 16, 16, 64).bfloat16()
    v_cache = torch.randn_like(k_cache)
    slices = [SequenceSlice(20, 20, [0, 1]), SequenceSlice(1, 5, [2]), SequenceSlice(37, 37, [3, 4, 5])]
    steps = {}
    for kernel in (True, False):
        if not kernel:
            monkeypatch.setattr(cpu_kernels, "serves_prompt_attention", lambda q: False)
        attention = PagedAttention(k_cache.clone(), v_cache.clone(), slices)
        steps[kernel] = attention(0, q[None], k[None], v[None])[0]
    torch.testing.assert_close(steps[True][20:21], steps[False][20:21], atol=0, rtol=0)
    for start, length in ((0, 20), (21, 37)):
        torch.testing.assert_close(steps[True][start:start + length].float(), steps[False][start:start + length].float(),
                                   atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_slots_writes_what_index_copy_writes_and_refuses_a_slot_outside(dtype):
    cache = torch.zeros(3, 8, 4, 16, dtype=dtype)
    values = torch.randn(5, 3 * 16 + 7).to(dtype)[:, :48].view(5, 3, 16)  # heads of a wider row, as q|k|v's K part
    slots = torch.tensor([31, 0, 7, 12, 13])
    expected = cache.clone()
    expected.view(3, -1, 16).index_copy_(1, slots, values.transpose(0, 1))
    cpu_kernels.load().write_slots_(cache, values, slots)
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match=r"slots\[1\] = 32: not a slot of the cache \(0..31\)"):
        cpu_kernels.load().write_slots_(cache, values, torch.tensor([0, 32, 1, 2, 3]))


def test_streamed_linear_refuses_what_it_does_not_compute():
    ops, x = cpu_kernels.load(), torch.randn(2, 8).bfloat16()
    tiles = ops.stream_pack(torch.randn(4, 8).bfloat16())
    with pytest.raises(RuntimeError, match="weight: an fp32 or bf16 CPU tensor"):
        ops.stream_pack(torch.randn(4, 8).double())
    with pytest.raises(RuntimeError, match="tiles: a contiguous"):
        ops.streamed_linear(x, torch.randn(4, 8).bfloat16(), 4)
    group = tiles.shape[2]  # outputs a tile holds: 8, or 48 where bf16 takes the panel kernel
    with pytest.raises(RuntimeError, match=f"tiles: out_features {group + 1} does not fit"):
        ops.streamed_linear(x, tiles, group + 1)
    with pytest.raises(RuntimeError, match=f"tiles: 70 inputs do not fit tiles of {tiles.shape[1]} chunks"):
        ops.streamed_linear(torch.randn(2, 70).bfloat16(), tiles, 4)
    with pytest.raises(RuntimeError, match="residual: a contiguous tensor"):
        ops.streamed_linear(x, tiles, 4, torch.randn(2, 5).bfloat16())


def _resident_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="Linux: resident memory from /proc")
def test_a_pool_faulted_in_the_background_keeps_what_is_written_meanwhile():
    """`in_background`: the tensor returns at once, zeroed and writable; the pages fault in from the kernels' own
    thread without touching what the caller writes meanwhile, until all of it is resident; dropping one mid-way
    stops and joins that thread first (no write after the unmapping)."""
    cpu_kernels.huge_page_zeros((64 << 20,), torch.uint8, in_background=True)  # dropped at once, still populating
    size = 256 << 20
    before = _resident_bytes()
    pool = cpu_kernels.huge_page_zeros((size,), torch.uint8, in_background=True)
    marks = torch.tensor([1, 4097, size // 2 + 12345, size - 1])  # 4 pages of thousands: the rest is the thread's
    pool[marks] = 7  # written while the thread populates
    for _ in range(200):  # up to 20 s: all of it resident
        if _resident_bytes() - before >= size:
            break
        time.sleep(0.1)
    assert _resident_bytes() - before >= size
    assert bool((pool[marks] == 7).all()) and int(pool.sum()) == 7 * len(marks)
