"""The shared-memory all-reduce (sum and maximum), all-gather and reduce-scatter equal gloo's, on every rank, for 2, 3
and 4 ranks, several dtypes and sizes that span several slots; they leave nothing in /dev/shm, a rank that never comes
makes the others fail in time, ranks that make different calls all fail naming every rank's call, and ranks that do not map the same segment all keep the process group's collectives."""

import dataclasses
import os
import platform

import pytest
import torch
import torch.distributed as dist

from mlsyslab.comm import shared_memory
from mlsyslab.comm.launch import spawn
from mlsyslab.comm.shared_memory import CollectiveMismatch, SharedMemoryCollectives
from mlsyslab.comm.torch_ops import all_gather_single, reduce_scatter_single

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not shared_memory.SHM.is_dir(),
                                reason="the shared-memory collectives run on x86-64 Linux only")

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64]
SIZES = [1, 5, 1003, 4099]  # with 256-byte slots, 4099 fp64 values go through in 129 pieces


def _equal_to_gloo(rank):
    reducer = SharedMemoryCollectives(rank, slot_bytes=256)
    problems = []
    for round_ in range(3):  # the flags carry on from call to call
        for dtype in DTYPES:
            for numel in SIZES:
                generator = torch.Generator().manual_seed(1000 * rank.rank + numel + round_)
                x = torch.randint(-16, 16, (numel,), generator=generator).to(dtype)  # exact sums in every dtype
                for maximum, reduction in ((False, dist.ReduceOp.SUM), (True, dist.ReduceOp.MAX)):
                    ours, theirs = x.clone(), x.clone()
                    reducer.all_reduce(ours, maximum)
                    dist.all_reduce(theirs, reduction)
                    if not torch.equal(ours, theirs):
                        problems.append(f"rank {rank.rank}: {dtype} x{numel} {reduction}: {ours[:4].tolist()} != "
                                        f"{theirs[:4].tolist()}")
    floats = torch.randn(3, 1000, generator=torch.Generator().manual_seed(rank.rank))
    inputs = [torch.empty_like(floats) for _ in range(rank.world_size)]
    dist.all_gather(inputs, floats)
    reducer.all_reduce(floats)
    everyone = [torch.empty_like(floats) for _ in range(rank.world_size)]
    dist.all_gather(everyone, floats)  # every rank the same bits, as from a collective
    if not all(torch.equal(other, floats) for other in everyone):
        problems.append(f"rank {rank.rank}: fp32 sums differ between ranks")
    if not torch.equal(floats, in_rank_order(inputs)):
        problems.append(f"rank {rank.rank}: the fp32 all-reduce is not the sum in rank order")
    return problems


def in_rank_order(parts: list[torch.Tensor]) -> torch.Tensor:
    """((x0 + x1) + x2) + ...: the shared-memory collectives' sum, whatever rank computes it."""
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shared_memory_all_reduce_equals_gloo_on_every_rank(world):
    assert spawn(_equal_to_gloo, world) == [[]] * world


def _gather_and_scatter_equal_gloo(rank):
    group = SharedMemoryCollectives(rank, slot_bytes=256)
    n, problems = rank.world_size, []
    for round_ in range(2):
        for dtype in DTYPES:
            for numel in SIZES:  # per rank: a shard, and a reduce-scatter's output
                generator = torch.Generator().manual_seed(1000 * rank.rank + numel + round_)
                shard = torch.randint(-16, 16, (numel,), generator=generator).to(dtype)
                full = torch.randint(-16, 16, (n * numel,), generator=generator).to(dtype)  # exact sums
                ours, theirs = torch.empty(n * numel, dtype=dtype), torch.empty(n * numel, dtype=dtype)
                group.all_gather(ours, shard)
                all_gather_single(theirs, shard)
                if not torch.equal(ours, theirs):
                    problems.append(f"rank {rank.rank}: all-gather {dtype} x{numel}")
                ours, theirs = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
                group.reduce_scatter(ours, full)
                reduce_scatter_single(theirs, full)
                if not torch.equal(ours, theirs):
                    problems.append(f"rank {rank.rank}: reduce-scatter {dtype} x{numel}: {ours[:4].tolist()} != "
                                    f"{theirs[:4].tolist()}")
    full = torch.randn(n * 1000, generator=torch.Generator().manual_seed(rank.rank))
    inputs = [torch.empty_like(full) for _ in range(n)]
    dist.all_gather(inputs, full)
    ours = torch.empty(1000)
    group.reduce_scatter(ours, full)
    if not torch.equal(ours, in_rank_order([x.view(n, -1)[rank.rank] for x in inputs])):
        problems.append(f"rank {rank.rank}: the fp32 reduce-scatter is not the sum in rank order")
    for call, args, message in ((group.all_gather, (torch.empty(n * 3 + 1), torch.empty(3)), "output: "),
                                (group.reduce_scatter, (torch.empty(3), torch.empty(n * 3 - 1)), "input: "),
                                (group.all_gather, (torch.empty(n * 3), torch.empty(3, dtype=torch.float64)), "output: ")):
        try:
            call(*args)
            problems.append(f"{call.__name__} took {[tuple(a.shape) for a in args]}")
        except ValueError as error:
            if not str(error).startswith(message):
                problems.append(str(error))
    return problems


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shared_memory_all_gather_and_reduce_scatter_equal_gloo_on_every_rank(world):
    assert spawn(_gather_and_scatter_equal_gloo, world) == [[]] * world


def _segments(rank):
    before = {path.name for path in shared_memory.SHM.glob("mlsyslab_collectives_*")}
    SharedMemoryCollectives(rank).all_reduce(torch.ones(10))
    dist.barrier()
    return {path.name for path in shared_memory.SHM.glob("mlsyslab_collectives_*")} - before


def test_the_segment_leaves_no_name_behind():
    assert spawn(_segments, 2) == [set(), set()]


def _late(rank):
    reducer = SharedMemoryCollectives(dataclasses.replace(rank, timeout_s=1.0))
    if rank.rank == 1:
        return None  # never calls
    with pytest.raises(TimeoutError, match=r"call 1 still waits for ranks \[1\] after 1 s"):
        reducer.all_reduce(torch.ones(4))
    return "timed out"


def test_a_rank_that_never_comes_times_out_naming_it():
    assert spawn(_late, 2) == ["timed out", None]


def _mismatched(rank, case):
    group = SharedMemoryCollectives(rank, slot_bytes=256)
    group.all_reduce(torch.ones(8))  # in step first: the check is per call
    x = torch.ones(4 if rank.rank == 0 else 8)
    try:
        if case == "sizes":  # a whole size that differs, its first piece equal
            group.all_reduce(torch.ones(64 if rank.rank == 0 else 96))
        elif rank.rank == 0:
            group.all_reduce(x)
        else:
            group.all_gather(torch.empty(rank.world_size * 8), x)
    except CollectiveMismatch as error:
        return str(error)
    return None


@pytest.mark.parametrize("case", ["sizes", "collectives"])
def test_ranks_making_different_calls_all_fail_naming_every_call(case):
    messages = spawn(_mismatched, 2, case)
    assert messages[0] == messages[1] and messages[0] is not None
    assert "call 2: the ranks disagree" in messages[0]
    if case == "sizes":
        assert "rank 0: all_reduce (sum) of 256 bytes (a piece of 256)" in messages[0]
        assert "rank 1: all_reduce (sum) of 384 bytes (a piece of 256)" in messages[0]
    else:
        assert "rank 0: all_reduce (sum) of 16 bytes" in messages[0] and "rank 1: all_gather of 32 bytes" in messages[0]


def _chosen(rank, switch):
    if switch is not None:
        os.environ["MLSYS_SHM_COLLECTIVES"] = switch
    return shared_memory.for_group(rank) is not None


def test_switched_off_by_the_environment():
    assert spawn(_chosen, 2, None) == [True, True]
    assert spawn(_chosen, 2, "0") == [False, False]


def _elsewhere(rank, directory):
    if rank.rank == 1:  # as if on another host: the segment's name leads to a file of its own
        shared_memory.SHM = directory
    chosen = shared_memory.for_group(rank)
    dist.barrier()  # rank 1 has removed its file
    return chosen is None, sorted(path.name for path in directory.iterdir())


def test_ranks_that_do_not_share_the_segment_keep_the_process_group(tmp_path):
    assert spawn(_elsewhere, 2, tmp_path) == [(True, []), (True, [])]
