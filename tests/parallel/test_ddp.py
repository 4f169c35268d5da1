"""Our DDP equals torch DDP and single-process training on the full batch, through shared memory (one host) and through
the process group (MLSYS_SHM_COLLECTIVES=0, as on GPUs or several hosts); it moves 2(N−1)/N·Ψ."""

import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from mlsyslab.comm.log import CommLog
from mlsyslab.parallel.ddp import DataParallel
from mlsyslab.comm.launch import spawn
from mlsyslab.predict.collectives import ring_all_reduce_bytes_per_rank
from tests.parallel.models import (Branching, TinyLM, adam, batch, branching_reference_step, loss_fn, shard,
                                  train_loop, train_single)

STEPS, ACCUMULATE = 4, 2


def _train(rank, which: str, transport: str = "shared memory"):
    log = CommLog()
    model = TinyLM(seed=rank.rank)  # different init per rank: the start-up broadcast must fix it
    if which == "ours":
        os.environ["MLSYS_SHM_COLLECTIVES"] = "1" if transport == "shared memory" else "0"
        wrapped = DataParallel(model, rank, bucket_bytes=2_000, log=log)
        assert (wrapped.shared is not None) == (transport == "shared memory"), transport
    else:
        torch.manual_seed(0)
        wrapped = TorchDDP(model)
    optimizer = adam(wrapped.parameters())
    log.reset()
    losses = train_loop(wrapped, optimizer.step, optimizer.zero_grad, STEPS, ACCUMULATE, rank, wrapped.no_sync)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, log.as_dict()


def _train_both(rank, transport: str):
    return _train(rank, "ours", transport), _train(rank, "torch")


def assert_close_to(a: dict, b: dict, relative: float = 1e-6):
    """Every tensor within `relative` of the reference, in norm: ‖a − b‖ ≤ relative · ‖b‖."""
    for name in b:
        error = (a[name] - b[name]).norm() / b[name].norm().clamp_min(1e-30)
        assert error <= relative, (name, error.item())


@pytest.mark.parametrize("transport", ["shared memory", "process group"])
@pytest.mark.parametrize("world", [2, 4])
def test_ddp_equals_single_process_and_torch_ddp(world, transport):
    reference, reference_losses = train_single(STEPS, adam, ACCUMULATE)
    runs = spawn(_train_both, world, transport)
    ours, theirs = [r[0] for r in runs], [r[1] for r in runs]
    for rank in range(world):
        assert_close_to(ours[rank][0], reference)
        assert_close_to(ours[rank][0], theirs[rank][0])
    # The mean of the ranks' losses is the full-batch loss.
    mean_losses = [sum(r[1][i] for r in ours) / world for i in range(STEPS)]
    assert mean_losses == pytest.approx(reference_losses, rel=1e-6)
    # Wire bytes: one all-reduce of every gradient per optimizer step, none inside no_sync.
    psi = sum(v.numel() for v in reference.values())
    for _, _, log in ours:
        assert log["all_reduce"]["bytes_sent"] == pytest.approx(STEPS * ring_all_reduce_bytes_per_rank(4 * psi, world))


def _unused_on_some_ranks(rank, transport: str):
    os.environ["MLSYS_SHM_COLLECTIVES"] = "1" if transport == "shared memory" else "0"
    model = Branching(seed=rank.rank)
    wrapped = DataParallel(model, rank, bucket_bytes=2_000)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    tokens, targets = batch(0)
    tokens, targets = shard(tokens, rank.rank, rank.world_size), shard(targets, rank.rank, rank.world_size)
    loss_fn(wrapped(tokens, use_extra=rank.rank == 0), targets).backward()
    optimizer.step()
    return {k: v.clone() for k, v in model.state_dict().items()}, len(wrapped.buckets)


@pytest.mark.parametrize("transport", ["shared memory", "process group"])
def test_a_parameter_one_rank_leaves_unused_keeps_the_buckets_in_step(transport):
    """Rank 1 never fills the first bucket: its buckets wait for it and go in the same order as rank 0's; the step
    takes the mean of the ranks' gradients (zeros for the unused layer on rank 1), as one process computes it."""
    runs = spawn(_unused_on_some_ranks, 2, transport)
    expected = branching_reference_step(2, lr=0.1)
    for parameters, buckets in runs:
        assert buckets > 2
        assert_close_to(parameters, expected)
