"""Attention that stores and reads K/V through block tables (PagedAttention, Kwon et al., SOSP 2023).

The KV cache is a pool of fixed-size blocks per layer, `[kv_heads, num_blocks, block_size, head_dim]`
(owned by `serve.kv_cache.KVCache`). A sequence's tokens live in the blocks its block table lists,
in order: token at position p sits in block `table[p // block_size]`, slot `p % block_size`. So a
sequence grows one block at a time, never needs contiguous memory, and sequences can share blocks
(a common prefix). Heads come first so that gathering a sequence's blocks (whole rows of the cache
seen as `[kv_heads · num_blocks, block_size, head_dim]`) yields K as `[kv_heads, tokens, head_dim]`, the
layout attention multiplies, in one copy.

One step's tokens come packed: each scheduled sequence contributes `query_len` new tokens (a prefill
chunk, or 1 for a decode) and has `context_len` tokens in the cache once they are written. For each
layer, `PagedAttention(layer, q, k, v)`
1. writes the new K/V into their slots (`slot_mapping`, one flat slot per new token);
2. attends: all decodes at once — on CPU through the C++ kernel that reads each sequence's blocks in
   place (`nn.cpu_kernels`, csrc/paged_decode.cpp: one pass over the cached bytes, fp32 or bf16 cache),
   elsewhere as two batched matmuls over (KV head, sequence) on the gathered blocks — each K/V head read
   once for the `heads // kv_heads` query heads that share it (grouped-query attention, no repeated
   K/V), block tables padded to the longest context and the padding masked; then each prefill chunk on
   its own through torch's SDPA, causally offset by the context already cached (Sarathi-style chunked
   prefill, Agrawal et al. 2023: a chunk sees every earlier chunk); a chunk that is a whole prompt
   attends over its own new K/V, with nothing to read back from the cache, and whole prompts of one length
   attend in one batched call (16 prompts of 128 tokens, bf16 on a Sapphire Rapids VM: 2.56 ms a layer against
   3.10 one by one, medians of 40 alternating rounds, 1.04-1.49x paired; the same numbers, as torch's CPU flash
   attention computes each (prompt, head, query block) on its own). In bf16 on a CPU with AMX the step's whole prompts of up
   to `TILED_PROMPTS_UP_TO` tokens go to one call of csrc/prompt_attention.cpp instead (`cpu_kernels.serves_prompt_attention`): K and V
   laid out once per (prompt, KV head) for the group's query heads, scores and P·V on tiles. 16 x 128 tokens with
   SmolLM2's heads: 2.6 against torch's 3.7 ms a layer; whole 16 x 128 and 32 x 128 prefills 1.067x and 1.027x
   (medians of 20 and 16 alternating runs, Sapphire Rapids VM, 2026-12-02; 1.079x at 16 x 128 with a unit of work
   per query head); within a bf16 rounding of torch's SDPA,
   not bit-equal (2 of 32 random-token prompts took another first token among near-ties).

Cost per layer: reads each sequence's cached K/V once, 2·context·kv_heads·head_dim·dtype bytes; the
gathered path copies it first (three passes over the bytes instead of one: at 16-32 sequences the
in-place kernel made whole bf16 decode steps 20-28% faster here, with the cache in bf16 — which the
gathered path could not afford, torch's 16-bit CPU attention being several times slower than fp32).
Tested against the contiguous causal attention in tests/nn/test_llama.py, the kernel against the
gathered path in tests/nn/test_cpu_kernels.py, and end to end against HF transformers in tests/serve.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mlsyslab.measure import host
from mlsyslab.nn import cpu_kernels


TILED_PROMPTS_UP_TO = 1024  # longer whole prompts take torch's flash attention: csrc/prompt_attention.cpp took 0.86x
# its time for one prompt of 2,048 tokens, 1.08x of 1,024, 1.34x for 4 of 512 (SmolLM2's heads, 2 threads, 2026-12-02)


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence's part of a step: `query_len` new tokens, `context_len` cached after writing them."""

    query_len: int
    context_len: int
    block_table: list[int]


class PagedAttention:
    """The `attention` argument of `Llama.forward_packed`, for one step over a paged KV cache."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, sequences: list[SequenceSlice],
                 rows_extend_sequences: bool = False):
        """k_cache, v_cache: [layers, kv_heads, num_blocks, block_size, head_dim]; `sequences` in packed order.
        rows_extend_sequences: some one-token slices are consecutive positions of one sequence (a speculative draft
        verified as decodes, `serve.speculative`), each reading the K/V the earlier ones write this step — as this
        path always writes every slot before attending, and the fused step does when told (`nn.fused_decode`)."""
        self.k_cache, self.v_cache, self.rows_extend_sequences = k_cache, v_cache, rows_extend_sequences
        block_size = k_cache.shape[3]
        device = k_cache.device
        slots, decode_rows, decode_tables, decode_lens, self.chunks = [], [], [], [], []
        self.whole_prompts: dict[int, list[int]] = {}  # length -> the packed starts of the whole prompts that long
        start = 0
        for seq in sequences:
            first = seq.context_len - seq.query_len
            if first < 0 or seq.context_len > len(seq.block_table) * block_size:
                raise ValueError(f"sequence slice {seq} does not fit its block table of block size {block_size}")
            slots += [seq.block_table[p // block_size] * block_size + p % block_size for p in range(first, seq.context_len)]
            if seq.query_len == 1:
                decode_rows.append(start)
                decode_tables.append(seq.block_table[: -(-seq.context_len // block_size)])
                decode_lens.append(seq.context_len)
            elif seq.query_len == seq.context_len:  # a whole prompt reads nothing back from the cache
                self.whole_prompts.setdefault(seq.query_len, []).append(start)
            else:  # a later chunk of a prompt: it reads the chunks before it from the cache
                blocks = torch.tensor([seq.block_table[: -(-seq.context_len // block_size)]], device=device)
                self.chunks.append((start, seq.query_len, seq.context_len, cache_rows(blocks, k_cache.shape)))
            start += seq.query_len
        tiled = [(start, length) for length, starts in self.whole_prompts.items() if length <= TILED_PROMPTS_UP_TO
                 for start in starts]  # the whole prompts `prompt_attention` takes where the CPU has AMX tiles
        self.prompt_starts = torch.tensor([start for start, _ in tiled], dtype=torch.long)
        self.prompt_lengths = torch.tensor([length for _, length in tiled], dtype=torch.long)
        self.long_prompts = {length: starts for length, starts in self.whole_prompts.items()
                             if length > TILED_PROMPTS_UP_TO}
        self.slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        self.decode_rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
        self.in_place = cpu_kernels.serves_attention(k_cache.device, k_cache.dtype, k_cache.shape[-1])
        self.decode_tables, self.decode_mask, self.decode_len = decode_batch(decode_tables, decode_lens, block_size, device,
                                                                             masked=not self.in_place)
        if self.in_place:
            self.decode_lengths = torch.tensor(decode_lens, dtype=torch.long, device=device)
        elif self.decode_tables is not None:
            self.decode_rows_in_cache = cache_rows(self.decode_tables, k_cache.shape)

    @property
    def prefills(self) -> bool:
        """Whether the step has prefill tokens (a whole prompt or a chunk of one)."""
        return bool(self.whole_prompts or self.chunks)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [1, T, heads, d], k/v [1, T, kv_heads, d] (packed) -> [1, T, heads, d]."""
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        kv_heads, head_dim = k_cache.shape[0], k_cache.shape[-1]
        for cache, new in ((k_cache, k), (v_cache, v)):
            if cpu_kernels.serves(cache) and new.dtype == cache.dtype:  # a copy per (token, head): 2.2-2.6x index_copy_'s rate
                cpu_kernels.load().write_slots_(cache, new[0], self.slot_mapping)
            else:
                cache.view(kv_heads, -1, head_dim).index_copy_(1, self.slot_mapping, new[0].transpose(0, 1).to(cache.dtype))
        if not self.prefills:  # decodes only: every packed token is its sequence's one new token
            return self._decode(q[0], k_cache, v_cache)[None]
        out = torch.empty(q.shape[1:], dtype=q.dtype, device=q.device)
        if len(self.decode_rows):
            out[self.decode_rows] = self._decode(q[0, self.decode_rows], k_cache, v_cache)
        on_tiles = bool(self.whole_prompts) and cpu_kernels.serves_prompt_attention(q)
        if on_tiles and len(self.prompt_starts):  # the whole prompts up to TILED_PROMPTS_UP_TO tokens in one call
            cpu_kernels.load().prompt_attention(q[0], k[0], v[0], self.prompt_starts, self.prompt_lengths, out)
        self._attend_whole_prompts(q, k, v, out, self.long_prompts if on_tiles else self.whole_prompts)
        for start, query_len, context_len, rows in self.chunks:
            query = q[:, start:start + query_len].transpose(1, 2)  # [1, heads, query_len, d]
            keys = gather_blocks(k_cache, rows, 1, context_len).transpose(0, 1)
            values = gather_blocks(v_cache, rows, 1, context_len).transpose(0, 1)
            mask = chunk_causal_mask(query_len, context_len, q.device)
            attended = attention(query, keys, values, mask, causal=False)
            out[start:start + query_len] = attended[0].transpose(0, 1).to(out.dtype)
        return out[None]

    @staticmethod
    def _attend_whole_prompts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                              prompts: dict[int, list[int]]) -> None:
        """Whole prompts ({length: packed starts}) through torch's SDPA, those of one length in one batched call."""
        for length, starts in prompts.items():  # keys and values are this step's: no cache to read
            query, keys, values = (prompt_rows(x[0], starts, length).transpose(1, 2) for x in (q, k, v))
            attended = attention(query, keys, values, None, causal=True).transpose(1, 2)  # [prompts, length, heads, d]
            if back_to_back(starts, length):
                out[starts[0]:starts[0] + len(starts) * length].view(attended.shape).copy_(attended)
            else:
                for prompt, start in enumerate(starts):
                    out[start:start + length] = attended[prompt]

    def _decode(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        if self.in_place:
            return cpu_kernels.load().paged_decode_attention(query.float().contiguous(), k_cache, v_cache, self.decode_tables,
                                                              self.decode_lengths, query.shape[-1] ** -0.5).to(query.dtype)
        return decode_attention(query, k_cache, v_cache, self.decode_rows_in_cache, self.decode_mask,
                                self.decode_len).to(query.dtype)


@dataclass(frozen=True)
class DecodeSteps:
    """The inputs of several decode steps of the same sequences in one call (multi-step decoding,
    `nn.fused_decode.FusedDecode.ahead`): sequence i's new token at step j sits at position `first[i] + j`.
    positions, slot_mapping, lengths [steps, sequences]; tables [sequences, blocks] cover the last step."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    lengths: torch.Tensor
    tables: torch.Tensor

    @classmethod
    def of(cls, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: list[list[int]], first: list[int],
           steps: int) -> "DecodeSteps":
        """Caches [layers, kv_heads, num_blocks, block_size, head_dim]; each table must hold its sequence's
        `first + steps` tokens (the caller reserved the blocks)."""
        block_size = k_cache.shape[3]
        needed = [-(-(position + steps) // block_size) for position in first]
        for table, count, position in zip(block_tables, needed, first):
            if len(table) < count:
                raise ValueError(f"a block table of {len(table)} blocks cannot hold positions {position}.."
                                 f"{position + steps - 1} (block size {block_size})")
        last_lengths = [position + steps for position in first]
        tables = decode_batch([table[:count] for table, count in zip(block_tables, needed)], last_lengths, block_size,
                              k_cache.device, masked=False)[0]
        positions = torch.tensor(first, dtype=torch.long)[None, :] + torch.arange(steps)[:, None]
        blocks = tables.gather(1, (positions // block_size).t()).t()
        slots = (blocks * block_size + positions % block_size).contiguous()
        return cls(k_cache, v_cache, positions, slots, positions + 1, tables)


def decode_attention(query, k_cache, v_cache, rows, mask, length: int) -> torch.Tensor:
    """query [D, heads, d] (one new token per sequence); caches [kv, num_blocks, block_size, d];
    rows: `cache_rows` of the D block tables; mask [D, length] (True: a real token) or None
    -> [D, heads, d] in the cache dtype.

    softmax(q·Kᵀ/√d)·V as two batched matmuls over (KV head, sequence), the `heads // kv` query heads
    of a group as the rows of one product: K and V are read once, never repeated per query head."""
    sequences, kv_heads, head_dim = query.shape[0], k_cache.shape[0], k_cache.shape[-1]
    keys = gather_blocks(k_cache, rows, sequences, length)  # [kv, D, length, d]
    values = gather_blocks(v_cache, rows, sequences, length)
    grouped = query.view(sequences, kv_heads, -1, head_dim).transpose(0, 1).to(keys.dtype) * head_dim ** -0.5
    scores = grouped @ keys.transpose(-1, -2)  # [kv, D, group, length]
    if mask is not None:
        scores = scores.masked_fill(~mask[None, :, None, :], float("-inf"))
    out = scores.softmax(-1) @ values  # [kv, D, group, d]
    return out.transpose(0, 1).reshape(sequences, -1, head_dim)


def attention(query, keys, values, mask, causal: bool) -> torch.Tensor:
    """Scaled dot-product attention with GQA. On CPU, 16-bit inputs are computed in fp32 unless they are
    bf16 and the CPU has AMX tiles: without them torch's 16-bit attention kernel is several times slower
    than its fp32 one; with them bf16 is 2.1x faster (240 causal 128-token chunks of SmolLM2's heads:
    33 ms against 71 here) and rounds as HF's bf16 attention does."""
    on_cpu_16_bit = query.dtype in (torch.bfloat16, torch.float16) and query.device.type == "cpu"
    widen = on_cpu_16_bit and not (query.dtype == torch.bfloat16 and host.cpu_has_amx())
    compute = torch.float32 if widen else query.dtype  # (an fp32 cache of a bf16 model holds bf16 values)
    query, keys, values = query.to(compute), keys.to(compute), values.to(compute)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=causal, enable_gqa=True)


def back_to_back(starts: list[int], length: int) -> bool:
    """Whether prompts of `length` tokens at these packed starts sit one after another (a step of new prompts)."""
    return starts == list(range(starts[0], starts[0] + len(starts) * length, length))


def prompt_rows(x: torch.Tensor, starts: list[int], length: int) -> torch.Tensor:
    """x [T, heads, d] packed -> the prompts of `length` tokens at `starts`, [prompts, length, heads, d]: a view of x when
    they sit back to back, else a copy. The view spares a layer's 16-prompt prefill the 48 slices, 3 stacks and 16
    scatters of a copy (16 x 128 tokens, bf16, Sapphire Rapids VM, 2026-12-02: 4.1 against 6.4 ms a layer, attention
    included; whole 16 x 128 and 32 x 128 prefills 1.04x and 1.025x, medians of 30 and 20 alternating runs)."""
    if back_to_back(starts, length):
        return x[starts[0]:starts[0] + len(starts) * length].view(len(starts), length, *x.shape[1:])
    return torch.stack([x[start:start + length] for start in starts])


def cache_rows(tables: torch.Tensor, cache_shape) -> torch.Tensor:
    """Block tables [B, n] -> rows of the cache seen as [kv · num_blocks, block_size, d]: head h's copy of
    block b is row h · num_blocks + b; ordered (head, sequence, block) for `gather_blocks`."""
    kv_heads, num_blocks = cache_shape[-4], cache_shape[-3]
    heads = torch.arange(kv_heads, device=tables.device)[:, None] * num_blocks
    return (heads + tables.reshape(1, -1)).reshape(-1)


def gather_blocks(cache: torch.Tensor, rows: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """cache [kv, num_blocks, block_size, d], rows from `cache_rows` of B = `batch` tables -> the first
    `length` tokens of each, [kv, B, length, d]. Gathering whole rows of the flattened cache (dim 0)
    copies contiguous blocks and ran 2x faster here than `index_select` on the block axis (dim 1)."""
    kv_heads, num_blocks, block_size, head_dim = cache.shape
    gathered = cache.reshape(kv_heads * num_blocks, block_size, head_dim).index_select(0, rows)
    return gathered.view(kv_heads, batch, -1, head_dim)[:, :, :length]


def decode_batch(tables: list[list[int]], lengths: list[int], block_size: int, device, masked: bool = True):
    """Block tables padded to the longest context, and the mask hiding each row's padding.

    When every context has the same length nothing is padded and the mask is None (batch-1 decode
    does no masking work); `masked=False` (the in-place kernel, which stops at each row's length)
    builds no mask either."""
    if not tables:
        return None, None, 0
    longest = max(lengths)
    width = -(-longest // block_size)
    padded = torch.tensor([table + [table[0]] * (width - len(table)) for table in tables], dtype=torch.long, device=device)
    if not masked or min(lengths) == longest:
        return padded, None, longest
    mask = torch.arange(longest, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    return padded, mask, longest


def chunk_causal_mask(query_len: int, context_len: int, device) -> torch.Tensor:
    """[query_len, context_len] bool: query i (at position context_len - query_len + i) sees keys <= it."""
    positions = torch.arange(context_len - query_len, context_len, device=device)
    return torch.arange(context_len, device=device)[None, :] <= positions[:, None]
