"""Ring attention with zig-zag shards (CP = 2, 4) equals full causal attention, forward and backward,
with grouped-query heads; and a context-parallel Llama forward gives the single-process logits."""

import copy

import pytest
import torch

from mlsyslab.comm.launch import spawn
from mlsyslab.comm.log import CommLog
from mlsyslab.comm.p2p import Wire
from mlsyslab.nn.llama import Llama, LlamaConfig, causal_attention
from mlsyslab.parallel.context import plain_attention, plain_attention_backward, ring_attention, zigzag_indices

B, T, HEADS, KV_HEADS, D = 2, 16, 4, 2, 8


def _tensors():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, HEADS, D, generator=generator, dtype=torch.float64)
    k = torch.randn(B, T, KV_HEADS, D, generator=generator, dtype=torch.float64)
    v = torch.randn(B, T, KV_HEADS, D, generator=generator, dtype=torch.float64)
    grad = torch.randn(B, T, HEADS, D, generator=generator, dtype=torch.float64)
    return q, k, v, grad


def _ring(rank):
    q, k, v, grad = _tensors()
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = causal_attention(0, *full)
    reference.backward(grad)
    mine = zigzag_indices(T, rank.world_size, rank.rank)
    local = [t[:, mine].clone().requires_grad_() for t in (q, k, v)]
    log = CommLog()
    out = ring_attention(Wire(rank, log), *local)
    out.backward(grad[:, mine])
    errors = {"out": (out - reference[:, mine]).abs().max().item()}
    for name, ours, theirs in zip("qkv", local, full):
        errors[f"grad_{name}"] = (ours.grad - theirs.grad[:, mine]).abs().max().item()
    return errors, log.total_bytes()


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_equals_full_causal_attention(world):
    results = spawn(_ring, world)
    for errors, _ in results:
        assert max(errors.values()) < 1e-10, errors
    local_kv = 2 * B * (T // world) * KV_HEADS * D * 8  # a K and a V block, float64
    forward = (world - 1) * local_kv  # c − 1 hops
    backward = (world - 1) * 2 * local_kv + local_kv  # K, V and their gradient accumulators, then the accumulators home
    assert results[0][1] == forward + backward


CONFIG = LlamaConfig(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, ffn_hidden=48, max_seq=64)


def _llama(rank):
    torch.manual_seed(0)
    model = Llama(CONFIG).initialize(generator=torch.Generator().manual_seed(5)).double()
    ids = torch.randint(0, CONFIG.vocab, (2, 16), generator=torch.Generator().manual_seed(6))
    reference = model(ids)
    mine = zigzag_indices(16, rank.world_size, rank.rank)
    wire = Wire(rank)
    ours = copy.deepcopy(model)
    hidden = ours.hidden_states(ids[:, mine], mine.expand(2, -1), lambda layer, q, k, v: ring_attention(wire, q, k, v))
    logits = ours.lm_head(hidden)
    return (logits - reference[:, mine]).abs().max().item()


def test_context_parallel_llama_forward_equals_single_process():
    assert max(spawn(_llama, 4)) < 1e-10


@pytest.mark.parametrize("causal", [False, True])
def test_the_plain_ops_off_cpu_equal_the_cpu_flash_kernel(causal):
    """Off CPU ring attention computes each chunk pair in plain ops (the flash kernel it uses is CPU-only):
    the same output, log-sum-exp and gradients, here against the kernel itself."""
    generator = torch.Generator().manual_seed(3)
    q, k, v, grad = (torch.randn(2, 4, 12, 8, generator=generator, dtype=torch.float64) for _ in range(4))
    out, lse = plain_attention(q, k, v, causal, 0.35)
    kernel_out, kernel_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal,
                                                                                        scale=0.35)
    assert torch.allclose(out, kernel_out, atol=1e-12) and torch.allclose(lse, kernel_lse, atol=1e-12)
    ours = plain_attention_backward(grad, q, k, v, out, lse, causal, 0.35)
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, kernel_out, kernel_lse,
                                                                                 0.0, causal, scale=0.35)
    for mine, theirs in zip(ours, kernel):
        assert torch.allclose(mine, theirs, atol=1e-12)
