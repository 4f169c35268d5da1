"""Our DDP equals torch DDP and single-process training on the full batch, through shared memory (one host) and through
the process group (MLSYS_SHM_COLLECTIVES=0, as on GPUs or several hosts); it moves 2(N−1)/N·Ψ."""

import os

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from mlsyslab.comm.log import CommLog
from mlsyslab.parallel.ddp import DataParallel
from mlsyslab.comm.launch import spawn
from mlsyslab.predict.collectives import ring_all_reduce_bytes_per_rank
from tests.parallel.models import TinyLM, adam, batch, loss_fn, shard, train_loop, train_single

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


class Branching(TinyLM):
    """TinyLM with a layer registered last (so in DDP's first bucket) that only some ranks use."""

    def __init__(self, seed: int = 0):
        super().__init__(seed=seed)
        self.extra = nn.Linear(24, 24)

    def forward(self, tokens, use_extra: bool):
        x = self.embed(tokens)
        if use_extra:
            x = x + self.extra(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


def _unused_on_some_ranks(rank, transport: str):
    os.environ["MLSYS_SHM_COLLECTIVES"] = "1" if transport == "shared memory" else "0"
    model = Branching(seed=rank.rank)
    wrapped = DataParallel(model, rank, bucket_bytes=2_000)
    tokens, targets = batch(0)
    tokens, targets = shard(tokens, rank.rank, rank.world_size), shard(targets, rank.rank, rank.world_size)
    loss_fn(wrapped(tokens, use_extra=rank.rank == 0), targets).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}, len(wrapped.buckets)


@pytest.mark.parametrize("transport", ["shared memory", "process group"])
def test_a_parameter_one_rank_leaves_unused_keeps_the_buckets_in_step(transport):
    """Rank 1 never fills the first bucket: its buckets wait for it and go in the same order as rank 0's; the
    gradients are the mean of the ranks' (zeros for the unused layer on rank 1), as one process computes them."""
    world = 2
    runs = spawn(_unused_on_some_ranks, world, transport)
    reference = Branching(seed=0)
    tokens, targets = batch(0)
    losses = [loss_fn(reference(shard(tokens, r, world), use_extra=r == 0), shard(targets, r, world)) for r in range(world)]
    (sum(losses) / world).backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}
    for gradients, buckets in runs:
        assert buckets > 2
        assert_close_to(gradients, expected)
