"""The oneDNN-prepacked serving copy computes what the plain model computes."""

import math

import pytest
import torch
from torch import nn

from mlsyslab.nn.llama import Llama, LlamaConfig
from mlsyslab.measure import host
from mlsyslab.nn import cpu_kernels, packed_linear
from mlsyslab.nn.packed_linear import (
    FusedPackedLinear,
    Kernel,
    PackedLinear,
    can_pack,
    kernel_plan,
    packed_for_inference,
)

CONFIG = LlamaConfig(vocab=96, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn_hidden=128, max_seq=128)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_packed_copy_matches_plain_model(dtype, tolerance):
    model = Llama(CONFIG).initialize(0.1, torch.Generator().manual_seed(0)).to(dtype).eval()
    assert can_pack(model)
    packed = packed_for_inference(model)
    assert isinstance(packed.layers[0].mlp.fused_gate_up, FusedPackedLinear) and isinstance(packed.lm_head, PackedLinear)
    assert isinstance(packed.layers[0].self_attn.fused_qkv, FusedPackedLinear) and "q_proj" not in packed.layers[0].self_attn._modules
    assert isinstance(model.layers[0].mlp.up_proj, nn.Linear) and isinstance(model.lm_head, nn.Linear)  # untouched
    assert model.layers[0].self_attn.fused_qkv is None and model.layers[0].mlp.fused_gate_up is None
    assert packed.embed_tokens is model.embed_tokens and not can_pack(packed)
    for batch, length in ((1, 1), (1, 2), (3, 17), (3, 100)):  # rows on each side of `kernel_plan`'s bounds
        ids = torch.randint(CONFIG.vocab, (batch, length))
        with torch.no_grad():
            torch.testing.assert_close(packed(ids).float(), model(ids).float(), atol=tolerance, rtol=tolerance)


def test_fp64_is_not_packed():
    assert not can_pack(Llama(CONFIG).double())


def check_every_row_count(dtype):
    """Every kernel of the plan computes x Wᵀ (and residual + x Wᵀ), whichever row count picks which."""
    weight = torch.randn(48, 32).to(dtype)
    layer = PackedLinear(weight)
    bounds = [below for below, _ in layer.plan if below != float("inf")]
    row_counts = sorted({1, 300, *bounds, *(bound - 1 for bound in bounds)})
    for rows in row_counts:
        x, residual = torch.randn(rows, 32).to(dtype), torch.randn(rows, 48).to(dtype)
        torch.testing.assert_close(layer(x).float(), (x.float() @ weight.float().T), atol=0.05, rtol=0.02)
        added = layer.add_to(x, residual)
        if dtype == torch.float32:  # the fused add rounds as a separate one does
            torch.testing.assert_close(added, residual + layer(x), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(added.float(), residual.float() + x.float() @ weight.float().T, atol=0.05, rtol=0.02)
    assert {layer.kernel(rows) for rows in row_counts} == {kernel for _, kernel in layer.plan}  # each one ran
    kernels = {kernel for _, kernel in layer.plan}
    if Kernel.PLAIN in kernels:
        assert layer.plain_weight.data_ptr() != weight.data_ptr()
    for kernel in Kernel:  # a copy of the weight for each kernel the plan uses, and none for the others
        assert (layer.weight_for(kernel) is not None) == (kernel in kernels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_count_computes_the_same_product(dtype):
    check_every_row_count(dtype)


S, P, L, INF = Kernel.STREAMED, Kernel.PACKED, Kernel.PLAIN, float("inf")


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the C++ kernels did not build here")
@pytest.mark.parametrize("packs_bf16, panels, amx, tiles, dtype, plan", [
    (False, False, False, False, torch.bfloat16, ((16, S), (INF, L))),  # AVX2 (Zen 3): oneDNN refuses to pack bf16
    (False, False, False, False, torch.float32, ((16, S), (INF, P))),
    (True, False, False, False, torch.bfloat16, ((4, S), (INF, P))),  # AVX-512 without AVX512_BF16
    (True, True, False, False, torch.bfloat16, ((INF, S),)),  # AVX512_BF16 (Zen 4): the panel kernel at every row count
    (True, True, False, False, torch.float32, ((96, S), (INF, P))),  # AVX-512: the fp32 panel kernel under 96 rows
    (True, True, True, True, torch.bfloat16, ((48, S), (INF, P))),  # AMX: the panels on tiles under 48 rows
    (True, True, True, True, torch.float32, ((96, S), (INF, P))),
    (True, True, True, False, torch.bfloat16, ((4, S), (INF, P))),  # AMX the OS did not grant: oneDNN's from 4 rows
])
def test_small_steps_stream_on_every_cpu(monkeypatch, packs_bf16, panels, amx, tiles, dtype, plan):
    """Wherever the C++ kernels build, steps under `streamed_below(dtype)` rows (on the panel kernel, every row
    count for bf16 without AMX, 48 for bf16 on AMX tiles and 96 for fp32; else 16 where oneDNN cannot pack bf16 and 4
    where it can) take the streamed kernel on its tiled weight, and wider ones oneDNN's packed weight or the plain
    one, by what the CPU has; every kernel of the plan computes the product (where this CPU can run it)."""
    runnable = dtype == torch.float32 or not packs_bf16 or packed_linear.onednn_packs_bf16()
    monkeypatch.setattr(packed_linear, "onednn_packs_bf16", lambda: packs_bf16)
    monkeypatch.setattr(cpu_kernels, "panels", lambda _: panels)
    monkeypatch.setattr(cpu_kernels, "amx_panels", lambda: tiles)
    monkeypatch.setattr(host, "cpu_has_amx", lambda: amx)
    assert kernel_plan(dtype) == plan
    if runnable:
        check_every_row_count(dtype)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the C++ kernels did not build here")
def test_streamed_tiles_share_one_huge_page_buffer_in_step_order(monkeypatch):
    monkeypatch.setattr(packed_linear, "onednn_packs_bf16", lambda: False)
    model = Llama(CONFIG).initialize(0.1, torch.Generator().manual_seed(0)).to(torch.bfloat16).eval()
    packed = packed_for_inference(model)
    linears = [linear for layer in packed.layers for linear in (layer.self_attn.fused_qkv, layer.self_attn.o_proj,
                                                                 layer.mlp.fused_gate_up, layer.mlp.down_proj)]
    linears.append(packed.lm_head)
    tiles = [linear.stream_tiles for linear in linears]
    assert len({t.untyped_storage().data_ptr() for t in tiles}) == 1
    assert tiles[0].untyped_storage().data_ptr() % (2 << 20) == 0  # whole 2 MB pages
    addresses = [t.data_ptr() for t in tiles]
    assert addresses == sorted(addresses) and all(a % 64 == 0 for a in addresses)
    weights = [torch.cat([model.layers[i].self_attn.q_proj.weight, model.layers[i].self_attn.k_proj.weight,
                          model.layers[i].self_attn.v_proj.weight]) for i in range(CONFIG.layers)]
    assert torch.equal(tiles[0], cpu_kernels.load().stream_pack(weights[0]))
    assert torch.equal(tiles[-1], cpu_kernels.load().stream_pack(model.lm_head.weight))


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the C++ kernels did not build here")
def test_each_matrix_is_packed_into_the_buffer_before_the_next(monkeypatch):
    """While a copy builds, a matrix's packed tiles are gone (moved into the huge-page buffer, `TileArena`) before
    the next matrix is packed: they once all stayed until every matrix was packed, and were then moved in — the
    tiles held twice at the build's peak (~270 MB of SmolLM2's bf16 copy)."""
    import weakref

    kernels, packed, alive_at_each_pack = cpu_kernels.load(), [], []

    class Recording:
        def __getattr__(self, name):
            return getattr(kernels, name)

        def stream_pack(self, weight):
            alive_at_each_pack.append(sum(ref() is not None for ref in packed))
            tiles = kernels.stream_pack(weight)
            packed.append(weakref.ref(tiles))
            return tiles

    monkeypatch.setattr(cpu_kernels, "load", lambda: Recording())
    model = Llama(CONFIG).initialize(0.1, torch.Generator().manual_seed(0)).eval()
    copy = packed_for_inference(model, rows=(1, 2))
    assert len(packed) > 4 * CONFIG.layers and alive_at_each_pack == [0] * len(packed), alive_at_each_pack
    x = torch.randn(1, 1, CONFIG.hidden)
    assert torch.allclose(copy.lm_head(x), model.lm_head(x), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_range_prepares_only_the_kernels_it_can_reach(dtype):
    """A copy for wide steps only (the engine's fp32 copy of 16-bit weights) prepares no kernel that serves fewer
    rows, one for narrow steps only (its 16-bit copy beside that) none that serves more; each still computes x Wᵀ."""
    weight = torch.randn(48, 32).to(dtype)
    whole = [kernel for _, kernel in PackedLinear(weight).plan]
    for first, last in ((20, math.inf), (1, 16), (1, 3), (3, 20)):
        layer = PackedLinear(weight, rows=(first, last))
        bounds = [0] + [below for below, _ in PackedLinear(weight).plan]
        reachable = {kernel for low, below, kernel in zip(bounds, bounds[1:], whole) if below > first and low < last}
        assert {kernel for _, kernel in layer.plan} == reachable and reachable, (first, last)
        for kernel in Kernel:
            assert (layer.weight_for(kernel) is not None) == (kernel in reachable)
        for rows in {first, last - 1} - {math.inf - 1}:
            x = torch.randn(rows, 32).to(dtype)
            torch.testing.assert_close(layer(x).float(), (x.float() @ weight.float().T), atol=5e-2, rtol=2e-2)
