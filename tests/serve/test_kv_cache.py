"""The block pool: sizing from bytes, reference counts, and the invariant check."""

import pytest
import torch

from mlsyslab.errors import InvalidValue
from mlsyslab.serve.kv_cache import KVCache
from mlsyslab.serve.radix import RadixCache
from tests.serve.tiny import CONFIG, block_bytes


def test_pool_is_sized_from_the_byte_budget():
    kv = KVCache(CONFIG, 10 * block_bytes(4) + 5, block_size=4, dtype=torch.float64)
    assert kv.num_blocks == 10 and kv.block_bytes == 2 * 2 * 2 * 8 * 4 * 8
    assert kv.k.shape == (2, 2, 10, 4, 8)
    for dtype in (torch.float64, torch.bfloat16):  # zeroed (masked padding reads unwritten slots), distinct pools
        pool = KVCache(CONFIG, 10 * block_bytes(4), block_size=4, dtype=dtype)
        assert pool.k.dtype == dtype and not pool.k.any() and not pool.v.any() and pool.k.data_ptr() != pool.v.data_ptr()
    with pytest.raises(InvalidValue, match=r"kv_cache_bytes.*--kv-cache-gb"):  # the CLI's name for it too
        KVCache(CONFIG, block_bytes(4) - 1, block_size=4, dtype=torch.float64)


def test_reference_counts_and_check():
    kv = KVCache(CONFIG, 6 * block_bytes(4), block_size=4, dtype=torch.float64)
    a, b = kv.allocate(3), kv.allocate(2)
    kv.share(a[:2])
    kv.check([a, b, a[:2]])
    with pytest.raises(AssertionError, match="owners"):
        kv.check([a, b])  # a shared block whose second owner is not listed: a leak
    kv.release(a)
    assert kv.num_used == 4
    kv.release(a[:2])
    kv.release(b)
    assert kv.num_free == 6
    kv.check([])
    with pytest.raises(RuntimeError, match="double free"):
        kv.release(b[:1])
    with pytest.raises(RuntimeError, match="asked for 7"):
        kv.allocate(7)


def test_radix_matches_full_blocks_and_evicts_least_recently_used():
    kv = KVCache(CONFIG, 8 * block_bytes(4), block_size=4, dtype=torch.float64)
    radix = RadixCache(kv)
    first = list(range(10))  # 2 full blocks + 2 tokens
    blocks = kv.allocate(3)
    radix.insert(first, blocks)
    kv.release(blocks)
    assert kv.num_used == 2 and radix.evictable() == 2  # the partial block went back to the pool
    assert radix.match(list(range(9)) + [99]) == blocks[:2]
    assert radix.match([0, 1, 2, 3, 9, 9, 9, 9]) == blocks[:1]
    assert radix.match([5, 5, 5, 5]) == []
    other = kv.allocate(1)
    radix.insert([7, 7, 7, 7], other)
    kv.release(other)
    radix.match([7, 7, 7, 7])  # the newest use: evicted last
    assert radix.evict(1) == 1 and radix.match(list(range(8))) == blocks[:1]  # the leaf of the old branch went first
    assert radix.evict(10) == 2 and kv.num_used == 0
    kv.check([radix.blocks()])
    assert 0 < radix.hit_rate() < 1
