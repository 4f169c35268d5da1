"""The MoE layer routes, caps and balances as specified; expert parallelism (EP = 2, 4) gives the
same outputs and gradients as the same layer on one process, and logs the bytes that left each rank."""

import copy

import pytest
import torch

from mlsyslab.comm.launch import spawn
from mlsyslab.comm.log import CommLog
from mlsyslab.nn.moe import MixtureOfExperts
from mlsyslab.parallel.expert import ExpertParallel

HIDDEN, FFN, EXPERTS = 16, 24, 8


def _layer(capacity_factor=8.0):
    torch.manual_seed(0)
    return MixtureOfExperts(HIDDEN, FFN, EXPERTS, top_k=2, capacity_factor=capacity_factor).double()


def _tokens(rank_index, count=12):
    return torch.randn(count, HIDDEN, generator=torch.Generator().manual_seed(10 + rank_index), dtype=torch.float64)


def test_routing_capacity_and_balance_loss():
    layer = _layer(capacity_factor=0.5)
    tokens = _tokens(0, 64)
    routing = layer.route(tokens)
    capacity = int(0.5 * 64 * 2 / EXPERTS)
    assert torch.bincount(routing.expert, minlength=EXPERTS).max() <= capacity
    assert routing.dropped == 64 * 2 - routing.expert.numel() > 0
    uniform = MixtureOfExperts(HIDDEN, FFN, EXPERTS, top_k=2)
    torch.nn.init.zeros_(uniform.router.weight)  # equal probabilities: the balance loss is its minimum, 1
    assert uniform.route(_tokens(1, 64).float()).aux_loss.item() == pytest.approx(1.0, abs=0.2)


def _compare(rank):
    reference = _layer()
    parallel = ExpertParallel(copy.deepcopy(reference), rank, log := CommLog())
    everyone = [_tokens(r).requires_grad_() for r in range(rank.world_size)]
    expected = [reference(t) for t in everyone]
    sum(e.pow(2).sum() for e in expected).backward()  # a loss over every rank's tokens
    mine = _tokens(rank.rank).requires_grad_()
    out = parallel(mine)
    out.pow(2).sum().backward()
    for p in parallel.layer.router.parameters():  # the router is replicated: sum its gradient (DP over EP)
        torch.distributed.all_reduce(p.grad)
    errors = {"out": (out - expected[rank.rank]).abs().max().item(),
              "input grad": (mine.grad - everyone[rank.rank].grad).abs().max().item(),
              "router grad": (parallel.layer.router.weight.grad - reference.router.weight.grad).abs().max().item()}
    for local, expert in enumerate(parallel.layer.experts):
        full = reference.experts[parallel.dispatch.first + local]
        for (name, a), (_, b) in zip(expert.named_parameters(), full.named_parameters()):
            errors[f"expert{parallel.dispatch.first + local}.{name}"] = (a.grad - b.grad).abs().max().item()
    return errors, log.as_dict(), parallel.layer.last_routing.expert // parallel.dispatch.local  # owner rank of each copy


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_one_process(world):
    results = spawn(_compare, world)
    owners = [owner for _, _, owner in results]
    for me, (errors, log, owner) in enumerate(results):
        assert max(errors.values()) < 1e-10, errors
        # Dispatch sends my copies bound elsewhere; combine returns the outputs of the copies others sent
        # me; backward repeats both with the splits swapped.
        leaving = int((owner != me).sum())
        arriving = sum(int((other == me).sum()) for peer, other in enumerate(owners) if peer != me)
        assert log["all_to_all"]["calls"] == 4
        assert log["all_to_all"]["bytes_sent"] == 2 * (leaving + arriving) * HIDDEN * 8
        # the forward's routing metadata: my copy count for each other rank, the expert id of each copy that leaves
        assert log["all_to_all_routing"] == {"calls": 2, "bytes_sent": (world - 1) * 8 + leaving * 8}
