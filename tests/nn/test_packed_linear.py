"""The oneDNN-prepacked serving copy computes what the plain model computes."""

import pytest
import torch
from torch import nn

from mlsyslab.nn.llama import Llama, LlamaConfig
from mlsyslab.nn.packed_linear import (
    FusedPackedLinear,
    PackedLinear,
    can_pack,
    packed_for_inference,
    plain_rows,
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
    for batch, length in ((1, 1), (1, 2), (3, 17), (3, 100)):  # rows on each side of `plain_rows`' bounds
        ids = torch.randint(CONFIG.vocab, (batch, length))
        with torch.no_grad():
            torch.testing.assert_close(packed(ids).float(), model(ids).float(), atol=tolerance, rtol=tolerance)


def test_fp64_is_not_packed():
    assert not can_pack(Llama(CONFIG).double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_count_computes_the_same_product(dtype):
    """Both kernels (plain weight, packed weight) compute x Wᵀ, whichever row count picks which."""
    weight = torch.randn(48, 32).to(dtype)
    layer = PackedLinear(weight)
    below, start = plain_rows(dtype)
    for rows in sorted({1, max(below - 1, 1), below, 300}):
        x, residual = torch.randn(rows, 32).to(dtype), torch.randn(rows, 48).to(dtype)
        torch.testing.assert_close(layer(x).float(), (x.float() @ weight.float().T), atol=0.05, rtol=0.02)
        added = layer.add_to(x, residual)
        if dtype == torch.float32:  # the fused add rounds as a separate one does
            torch.testing.assert_close(added, residual + layer(x), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(added.float(), residual.float() + x.float() @ weight.float().T, atol=0.05, rtol=0.02)
    if below > 1 or start is not None:
        assert layer.plain_weight is not None and layer.plain_weight.data_ptr() != weight.data_ptr()
