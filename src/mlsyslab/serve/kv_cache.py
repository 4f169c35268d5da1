"""The paged KV cache: a pool of fixed-size blocks sized from a byte budget (vLLM, Kwon et al. 2023).

Memory: one block holds `block_size` tokens of K and V for every layer,
`2 · layers · kv_heads · head_dim · block_size · dtype_bytes` bytes (SmolLM2-135M in fp32: 46 kB
per token, 737 kB per 16-token block); the pool is `budget // block_bytes` blocks, allocated
once. Twin: `predict.inference` (KV bytes per token).

Ownership: every block has a reference count — one per sequence whose block table lists it, plus
one if the prefix cache (`serve.radix`) holds it. A block is free exactly when its count is zero;
`check` verifies that against the owners the caller lists (no leaked block, no block owned twice,
no free block in use). Tested in tests/serve/test_kv_cache.py and the scheduler property test.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

import torch

from mlsyslab.errors import InvalidValue
from mlsyslab.nn import cpu_kernels
from mlsyslab.nn.llama import LlamaConfig


class KVCache:
    """K and V block pools `[layers, kv_heads, num_blocks, block_size, head_dim]` with reference counts."""

    def __init__(self, config: LlamaConfig, budget_bytes: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if block_size < 1:
            raise InvalidValue("block_size", block_size, ">= 1")
        self.block_size = block_size
        self.block_bytes = block_bytes(config, block_size, dtype)
        self.num_blocks = int(budget_bytes // self.block_bytes)
        if self.num_blocks < 1:
            raise InvalidValue("kv_cache_bytes", budget_bytes, f">= {self.block_bytes}, one block of {block_size} "
                               f"tokens (mlsys serve --kv-cache-gb {self.block_bytes / 1e9:.3g} or more)")
        shape = (config.layers, config.kv_heads, self.num_blocks, block_size, config.head_dim)
        # Zeros, not garbage: masked padding reads unwritten slots, and 0 · NaN would poison attention.
        # Faulted in now, not on first touch: a lazily zeroed pool (calloc) took its page faults during
        # serving (9 ms of every 32-sequence decode step went to faults on fresh K/V pages).
        self.k, self.v = (pool(shape, dtype, torch.device(device)) for _ in range(2))
        self.refcount = [0] * self.num_blocks
        self.free_blocks: deque[int] = deque(range(self.num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold `tokens` tokens."""
        return -(-tokens // self.block_size)

    def allocate(self, count: int) -> list[int]:
        """`count` free blocks, each with reference count 1."""
        if count > len(self.free_blocks):
            raise RuntimeError(f"KV cache: asked for {count} blocks, {len(self.free_blocks)} free")
        blocks = [self.free_blocks.popleft() for _ in range(count)]
        for block in blocks:
            self.refcount[block] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """One more owner for each of `blocks` (already in use)."""
        for block in blocks:
            if self.refcount[block] < 1:
                raise RuntimeError(f"KV cache: sharing free block {block}")
            self.refcount[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """One owner fewer for each of `blocks`; a block nobody owns returns to the free pool."""
        for block in blocks:
            if self.refcount[block] < 1:
                raise RuntimeError(f"KV cache: releasing free block {block} (double free)")
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                self.free_blocks.append(block)

    def check(self, owners: Iterable[Iterable[int]]) -> None:
        """Raise unless reference counts equal the owners listed and the free pool is exactly the unowned blocks."""
        counted = Counter(block for owner in owners for block in owner)
        for block in range(self.num_blocks):
            if self.refcount[block] != counted.get(block, 0):
                raise AssertionError(f"KV cache: block {block} has refcount {self.refcount[block]} "
                                     f"but {counted.get(block, 0)} owners")
        free = list(self.free_blocks)
        if len(free) != len(set(free)):
            raise AssertionError("KV cache: a block is in the free pool twice")
        if set(free) != {block for block in range(self.num_blocks) if self.refcount[block] == 0}:
            raise AssertionError("KV cache: the free pool differs from the blocks with refcount 0")


def pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed K or V pool. On CPU on transparent huge pages (`nn.cpu_kernels.huge_page_zeros`): the decode
    kernel walks each sequence's blocks, scattered over the pool, and in 4 kB pages nearly every block is a TLB
    miss (bf16 batch 1 at ~190 tokens, alternating in one process: TPOT median 10.31 -> 9.87 ms, the 8-token
    prompt's 9.91). Its pages fault in from a background thread while the engine starts and serves: on a VM a fresh
    huge page can cost ~7 ms, and the default 1 GB pool took 3.5-4 s of `mlsys serve`'s start-up on the Zen 3 host."""
    if device.type == "cpu":
        return cpu_kernels.huge_page_zeros(shape, dtype, in_background=True)
    return torch.zeros(shape, dtype=dtype, device=device)


def block_bytes(config: LlamaConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V one block holds across all layers."""
    return config.kv_elements_per_token * block_size * torch.empty((), dtype=dtype).element_size()
