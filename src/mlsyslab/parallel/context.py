"""Context parallelism: ring attention (Liu, Zaharia & Abbeel 2023) with zig-zag load balancing.

The sequence is cut into 2·c chunks and rank r keeps chunks r and 2c − 1 − r ("zig-zag"), so under a
causal mask every rank has the same amount of work. Each rank keeps its queries; the keys and values
travel around the ring: in c steps every rank sees every K/V block and merges the partial results
with the online-softmax accumulator (Milakov & Gimelshein 2018): with running log-sum-exp ℓ and
output o, a block with log-sum-exp ℓ_b and output o_b gives ℓ' = log(e^ℓ + e^ℓ_b),
o' = o·e^(ℓ−ℓ') + o_b·e^(ℓ_b−ℓ'). The backward pass rotates K, V and their gradient accumulators once
more around the ring, recomputing each block's probabilities from the saved ℓ (as FlashAttention
does); after c − 1 hops every rank has seen every block, and one last hop of the accumulators alone
brings dK and dV home. Each forward step's transfer is posted before the block's compute, so it can
overlap it. Every rank is given every rank's token positions (the layout is known to all), so only
K, V and their gradients travel.
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


def ring_attention(wire: Wire, q, k, v, positions: torch.Tensor):
    """Causal attention of local queries over every rank's keys; q [b, t, heads, d], k/v [b, t, kv_heads, d],
    `positions` [c, t] the global positions of every rank's tokens (row r: rank r's; `zigzag_layout`)."""
    return _RingAttention.apply(q, k, v, positions, wire)


def zigzag_layout(sequence: int, ranks: int) -> torch.Tensor:
    """[ranks, sequence / ranks]: row r is `zigzag_indices(sequence, ranks, r)`."""
    return torch.stack([zigzag_indices(sequence, ranks, rank) for rank in range(ranks)])


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, positions, wire: Wire):
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
            block_out, block_lse = _attend_block(q, block_k, block_v, positions[me], positions[(me - step) % n], scale)
            new_lse = torch.logaddexp(lse, block_lse)
            out = out * torch.exp(lse - new_lse).nan_to_num(0.0)[..., None] + block_out * torch.exp(block_lse - new_lse).nan_to_num(0.0)[..., None]
            lse = new_lse
            if pending is not None:
                pending.wait()
                block = incoming
        ctx.save_for_backward(q, k, v, positions, out, lse)
        ctx.wire, ctx.scale = wire, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, positions, out, lse = ctx.saved_tensors
        wire, scale = ctx.wire, ctx.scale
        n, me = wire.size, wire.me
        grad_out = grad_out.to(_precision(q))
        delta = (grad_out * out).sum(-1)  # D = rowsum(dO ∘ O), [b, t, heads]
        grad_q = torch.zeros_like(q, dtype=_precision(q))
        block = (k.contiguous(), v.contiguous(), torch.zeros_like(k, dtype=_precision(q)),
                 torch.zeros_like(v, dtype=_precision(q)))
        for step in range(n):
            bk, bv, bdk, bdv = block
            dq, dk, dv = _attend_block_backward(q, bk, bv, positions[me], positions[(me - step) % n], lse, grad_out,
                                                delta, scale)
            grad_q += dq
            block = (bk, bv, bdk + dk, bdv + dv) if step < n - 1 else (bdk + dk, bdv + dv)  # the last hop: home
            incoming = tuple(torch.empty_like(t) for t in block)
            wire.exchange([(t, (me + 1) % n) for t in block], [(t, (me - 1) % n) for t in incoming],
                          "ring attention backward").wait()
            block = incoming  # after n hops every accumulator is back with its owner
        grad_k, grad_v = block
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None


def _scores(q, k, q_positions, k_positions, scale):
    """Masked scores [b, heads, tq, tk] with K/V heads repeated for grouped-query attention."""
    groups = q.shape[2] // k.shape[2]
    k = k.to(_precision(q)).repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.to(_precision(q)), k) * scale
    allowed = k_positions[None, :] <= q_positions[:, None]
    return scores.masked_fill(~allowed, -math.inf), groups


def _attend_block(q, k, v, q_positions, k_positions, scale):
    scores, groups = _scores(q, k, q_positions, k_positions, scale)
    block_lse = torch.logsumexp(scores, dim=-1)  # [b, heads, tq]; -inf where no key is visible
    probabilities = torch.exp(scores - block_lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probabilities, v.to(probabilities.dtype).repeat_interleave(groups, dim=2))
    return out, block_lse.transpose(1, 2)


def _attend_block_backward(q, k, v, q_positions, k_positions, lse, grad_out, delta, scale):
    scores, groups = _scores(q, k, q_positions, k_positions, scale)
    probabilities = torch.exp(scores - lse.transpose(1, 2)[..., None]).nan_to_num(0.0)  # [b, h, tq, tk]
    v_full = v.to(probabilities.dtype).repeat_interleave(groups, dim=2)
    grad_v = torch.einsum("bhqk,bqhd->bkhd", probabilities, grad_out)
    grad_p = torch.einsum("bqhd,bkhd->bhqk", grad_out, v_full)
    grad_s = probabilities * (grad_p - delta.transpose(1, 2)[..., None])
    grad_q = torch.einsum("bhqk,bkhd->bqhd", grad_s, k.to(grad_s.dtype).repeat_interleave(groups, dim=2)) * scale
    grad_k = torch.einsum("bhqk,bqhd->bkhd", grad_s, q.to(grad_s.dtype)) * scale
    # Sum the gradients of repeated K/V heads back onto their group's head.
    fold = lambda t: t.reshape(*t.shape[:2], t.shape[2] // groups, groups, t.shape[3]).sum(3)  # noqa: E731
    return grad_q, fold(grad_k), fold(grad_v)


def _precision(q: torch.Tensor) -> torch.dtype:
    """Accumulate in at least fp32 (bf16 inputs), in fp64 for fp64 inputs."""
    return torch.promote_types(q.dtype, torch.float32)
