"""Context parallelism: ring attention (Liu, Zaharia & Abbeel 2023) with zig-zag load balancing.

The sequence is cut into 2·c chunks and rank r keeps chunks r and 2c − 1 − r ("zig-zag"), so under a
causal mask every rank has the same amount of work. Each rank keeps its queries; the keys and values
travel around the ring: in c steps every rank sees every K/V block and merges the partial results
with the online-softmax accumulator (Milakov & Gimelshein 2018): with running log-sum-exp ℓ and
output o, a block with log-sum-exp ℓ_b and output o_b gives ℓ' = log(e^ℓ + e^ℓ_b),
o' = o·e^(ℓ−ℓ') + o_b·e^(ℓ_b−ℓ'). The layout is known to every rank, so only K, V and their gradients
travel, and each pair of zig-zag chunks is one of three cases: a key chunk before the query chunk is
attended whole, the same chunk causally, a later one not at all — so each pair is one call of torch's
fused CPU flash-attention kernel (`_scaled_dot_product_flash_attention_for_cpu`, which returns the
log-sum-exp the merge needs; off CPU the same computation in plain torch ops, `plain_attention`), no mask
is built and no invisible pair is computed. (Scores
materialised per block in plain torch ops ran 8-13x slower than one process's fused kernel on the same
cores: benchmarks/README.md.) The backward pass rotates K, V and their gradient accumulators once
more around the ring; the kernel's backward recomputes each pair's probabilities from the final ℓ and
output (as FlashAttention does); after c − 1 hops every rank has seen every block, and one last hop of
the accumulators alone brings dK and dV home. Each forward step's transfer is posted before the
block's compute, so it can overlap it.
Bytes per rank per layer, with a K + V block of B = 2·(s/c)·kv_width·bytes: forward (c−1)·B;
backward (c−1)·2B + B. Twin: predict.training (context-parallel term). Held against full attention
in tests/parallel/test_context.py (output, gradients and those bytes).
"""

import math

import torch

from mlsyslab.comm.p2p import Wire


def zigzag_indices(sequence: int, ranks: int, rank: int) -> torch.Tensor:
    """Token positions rank `rank` holds: chunks rank and 2·ranks − 1 − rank of 2·ranks equal chunks."""
    chunk = sequence // (2 * ranks)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = torch.arange((2 * ranks - 1 - rank) * chunk, (2 * ranks - rank) * chunk)
    return torch.cat([first, second])


def ring_attention(wire: Wire, q, k, v):
    """Causal attention of this rank's queries over every rank's keys; q [b, t, heads, d], k/v [b, t, kv_heads, d]
    hold the rank's zig-zag share of the sequence (`zigzag_indices`, rank `wire.me` of `wire.size`)."""
    if q.shape[1] % 2:
        raise ValueError(f"ring attention: {q.shape[1]} local tokens, not two equal zig-zag chunks")
    return _RingAttention.apply(q, k, v, wire)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, wire: Wire):
        n, me = wire.size, wire.me
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = torch.zeros(q.shape, dtype=_precision(q))
        lse = torch.full(q.shape[:-1], -math.inf, dtype=_precision(q))  # [b, t, heads]
        block = (k.contiguous(), v.contiguous())
        for step in range(n):
            pending = None
            if step < n - 1:
                incoming = tuple(torch.empty_like(t) for t in block)
                pending = wire.exchange([(t, (me + 1) % n) for t in block], [(t, (me - 1) % n) for t in incoming], "ring attention K/V")
            block_k, block_v = block
            for rows, keys, causal in _visible_pairs(n, me, (me - step) % n, q.shape[1] // 2):
                pair_out, pair_lse = _flash(q[:, rows], block_k[:, keys], block_v[:, keys], causal, scale)
                merged = torch.logaddexp(lse[:, rows], pair_lse)
                out[:, rows] = (out[:, rows] * torch.exp(lse[:, rows] - merged)[..., None]
                                + pair_out * torch.exp(pair_lse - merged)[..., None])
                lse[:, rows] = merged
            if pending is not None:
                pending.wait()
                block = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.wire, ctx.scale = wire, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        wire, scale = ctx.wire, ctx.scale
        n, me = wire.size, wire.me
        grad_out = grad_out.to(_precision(q))
        grad_q = torch.zeros_like(q, dtype=_precision(q))
        block = (k.contiguous(), v.contiguous(), torch.zeros_like(k, dtype=_precision(q)),
                 torch.zeros_like(v, dtype=_precision(q)))
        for step in range(n):
            bk, bv, bdk, bdv = block
            for rows, keys, causal in _visible_pairs(n, me, (me - step) % n, q.shape[1] // 2):
                dq, dk, dv = _flash_backward(grad_out[:, rows], q[:, rows], bk[:, keys], bv[:, keys], out[:, rows],
                                             lse[:, rows], causal, scale)
                grad_q[:, rows] += dq
                bdk[:, keys] += dk
                bdv[:, keys] += dv
            block = (bk, bv, bdk, bdv) if step < n - 1 else (bdk, bdv)  # the last hop: the accumulators home
            incoming = tuple(torch.empty_like(t) for t in block)
            wire.exchange([(t, (me + 1) % n) for t in block], [(t, (me - 1) % n) for t in incoming],
                          "ring attention backward").wait()
            block = incoming  # after n hops every accumulator is back with its owner
        grad_k, grad_v = block
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None


def _visible_pairs(ranks: int, me: int, owner: int, half: int) -> list[tuple[slice, slice, bool]]:
    """(query rows, key rows, causal) of each pair of zig-zag chunks where rank `me`'s queries (chunks me and
    2·ranks − 1 − me) see rank `owner`'s keys (chunks owner and 2·ranks − 1 − owner): an earlier key chunk
    whole, the same chunk causally, a later one not at all."""
    halves, chunks = (slice(0, half), slice(half, 2 * half)), lambda rank: (rank, 2 * ranks - 1 - rank)
    return [(rows, keys, key_chunk == query_chunk) for rows, query_chunk in zip(halves, chunks(me))
            for keys, key_chunk in zip(halves, chunks(owner)) if key_chunk <= query_chunk]


def _flash(q, k, v, causal: bool, scale: float):
    """q [b, tq, heads, d] over k, v [b, tk, kv_heads, d] (causal: tq = tk, the same positions) by torch's CPU
    flash-attention kernel, in q's accumulation precision -> (out [b, tq, heads, d], log-sum-exp [b, tq, heads])."""
    heads_first = _heads_first(q, k, v)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*heads_first, is_causal=causal,
                                                                              scale=scale)
    else:  # the kernel is CPU-only (no fused kernel returns the log-sum-exp on every device): the same in plain ops
        out, lse = plain_attention(*heads_first, causal, scale)
    return out.transpose(1, 2), lse.transpose(1, 2)


def _flash_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float):
    """The gradients of one pair's share of the attention, given the whole attention's output and log-sum-exp
    (the kernel recomputes the pair's probabilities from them): dq [b, tq, heads, d], dk, dv [b, tk, kv_heads, d]."""
    groups = q.shape[2] // k.shape[2]
    args = (grad_out.transpose(1, 2), *_heads_first(q, k, v), out.transpose(1, 2), lse.transpose(1, 2).contiguous())
    if q.device.type == "cpu":
        grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *args, 0.0, causal, scale=scale)
    else:
        grad_q, grad_k, grad_v = plain_attention_backward(*args, causal, scale)
    fold = lambda t: t.transpose(1, 2).unflatten(2, (-1, groups)).sum(3)  # noqa: E731 - a K/V head's query heads summed
    return grad_q.transpose(1, 2), fold(grad_k), fold(grad_v)


def plain_attention(q, k, v, causal: bool, scale: float):
    """What the CPU flash kernel returns, in plain ops on any device: q, k, v [b, heads, t, d] -> (out, log-sum-exp
    [b, heads, tq]); causal: query i sees keys <= i."""
    scores = _scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]) @ v, lse


def plain_attention_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float):
    """The CPU flash kernel's backward in plain ops: probabilities recomputed from `lse`, D = rowsum(dO ∘ O)
    (FlashAttention-2, Dao 2023, algorithm 2) -> (dq, dk, dv), each [b, heads, t, d]."""
    probabilities = torch.exp(_scores(q, k, causal, scale) - lse[..., None])
    grad_scores = probabilities * (grad_out @ v.transpose(-1, -2) - (grad_out * out).sum(-1, keepdim=True))
    grad_v = probabilities.transpose(-1, -2) @ grad_out
    return (grad_scores @ k) * scale, (grad_scores.transpose(-1, -2) @ q) * scale, grad_v


def _scores(q, k, causal: bool, scale: float):
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        later = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(later, -math.inf)
    return scores


def _heads_first(q, k, v):
    """q, k, v as [b, heads, t, d] in q's accumulation precision, each K/V head repeated for its query heads
    (grouped-query attention: the kernel takes as many K/V heads as query heads)."""
    precision, groups = _precision(q), q.shape[2] // k.shape[2]
    return (q.to(precision).transpose(1, 2),
            *(t.to(precision).repeat_interleave(groups, dim=2).transpose(1, 2) for t in (k, v)))


def _precision(q: torch.Tensor) -> torch.dtype:
    """Accumulate in at least fp32 (bf16 inputs), in fp64 for fp64 inputs."""
    return torch.promote_types(q.dtype, torch.float32)
