"""Expert parallelism (Lepikhin et al. 2020, GShard): the experts of an MoE layer spread over e ranks.

Every rank routes its own tokens with the (replicated) router. Dispatch: the routed token copies,
sorted by expert, are exchanged with one `all_to_all_single` (each rank first tells every other how
many copies it sends, a tiny all-to-all of counts); each rank runs its E/e experts on what it
received; combine: a second `all_to_all_single` returns the outputs to the tokens' ranks, where they
are summed with their routing weights. Autograd flows back through both all-to-alls (each is its
own backward, with the splits swapped). all_to_all_single with split sizes is ~3.5x faster than
the list form on gloo. Bytes per rank per MoE layer and pass: 2 · (routed copies sent) · hidden ·
bytes — (e−1)/e of the local copies leave the rank when routing is balanced — counted in the CommLog
as "all_to_all"; and in each forward the routing metadata, 8 bytes a count for each other rank and 8
an expert id for each copy that leaves, counted as "all_to_all_routing".
Twin: predict.training (expert-parallel term). Held against the same layer on one process in
tests/parallel/test_expert.py.
"""

import torch
import torch.distributed as dist

from mlsyslab.comm.launch import Rank
from mlsyslab.comm.log import CommLog
from mlsyslab.errors import InvalidValue
from mlsyslab.nn.moe import MixtureOfExperts, combine, run_experts


class ExpertParallel(torch.nn.Module):
    """Rank r keeps experts [r·E/e, (r+1)·E/e) of `layer` (which every rank built with the same seed)."""

    def __init__(self, layer: MixtureOfExperts, rank: Rank, log: CommLog | None = None):
        super().__init__()
        self.layer = layer
        self.dispatch = ExpertDispatch(layer, rank, log)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output for this rank's tokens x [..., hidden], plus `residual` when given."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        routing = self.layer.route(tokens)
        self.layer.last_routing = routing
        out = combine(tokens, routing, self.dispatch(self.layer.experts, tokens, routing)).reshape(shape)
        return out if residual is None else residual + out


class ExpertDispatch:
    """The routed copies of a rank's tokens to the ranks of its EP group that hold their experts, through
    those experts, and back: one output row per copy, in `routing`'s order. Cuts `layer`'s experts to this
    rank's E/e. Also used by `parallel.tensor.TensorParallelExperts` under TP × EP, where each TP rank
    exchanges with the ranks of its own TP index, which hold the same slice of their experts."""

    def __init__(self, layer: MixtureOfExperts, rank: Rank, log: CommLog | None = None):
        ranks, experts = rank.world_size, layer.experts_count
        if experts % ranks:
            raise InvalidValue("ep", ranks, f"a divisor of the {experts} experts")
        self.rank, self.log = rank, log
        self.local = experts // ranks
        self.first = rank.rank * self.local
        layer.experts = torch.nn.ModuleList(layer.experts[self.first: self.first + self.local])

    def __call__(self, experts: torch.nn.ModuleList, tokens: torch.Tensor, routing) -> torch.Tensor:
        ranks = self.rank.world_size
        owner = routing.expert // self.local
        send_counts = torch.bincount(owner, minlength=ranks)
        receive_counts = torch.empty_like(send_counts)
        _routing_exchange(receive_counts, send_counts, [1] * ranks, [1] * ranks, self.rank, self.log)
        send, receive = send_counts.tolist(), receive_counts.tolist()
        # Which local expert each received copy is for travels with it (as an integer all-to-all).
        expert_ids = torch.empty(sum(receive), dtype=routing.expert.dtype)
        _routing_exchange(expert_ids, routing.expert, receive, send, self.rank, self.log)
        arrived = _AllToAll.apply(tokens[routing.token], receive, send, self.rank, self.log)
        order = torch.argsort(expert_ids, stable=True)
        computed = run_experts(experts, arrived[order], expert_ids[order] - self.first)
        outputs = torch.empty_like(computed).index_copy(0, order, computed)
        return _AllToAll.apply(outputs, send, receive, self.rank, self.log)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single forward; the reverse exchange (splits swapped) backward."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, rank: Rank, log: CommLog | None):
        ctx.splits, ctx.rank, ctx.log = (output_splits, input_splits), rank, log
        return _exchange(x, output_splits, input_splits, rank, log)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _exchange(grad.contiguous(), input_splits, output_splits, ctx.rank, ctx.log), None, None, None, None


def _leaving_bytes(x, input_splits, rank: Rank) -> int:
    """Bytes of x's rows (split by destination) that go to the other ranks."""
    row = x[0].numel() * x.element_size() if x.shape[0] else 0
    return sum(n for peer, n in enumerate(input_splits) if peer != rank.rank) * row


def _routing_exchange(out, x, output_splits, input_splits, rank: Rank, log: CommLog | None) -> None:
    """The routing metadata's all-to-all (copy counts, expert ids: int64), counted as "all_to_all_routing"."""
    if log is not None:
        log.calls["all_to_all_routing"] += 1
        log.bytes_sent["all_to_all_routing"] += _leaving_bytes(x, input_splits, rank)
    dist.all_to_all_single(out, x, output_splits, input_splits, group=rank.group)


def _exchange(x, output_splits, input_splits, rank: Rank, log: CommLog | None):
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    if log is not None:
        log.calls["all_to_all"] += 1
        log.bytes_sent["all_to_all"] += _leaving_bytes(x, input_splits, rank)
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=rank.group)
    return out
