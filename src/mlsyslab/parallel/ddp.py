"""Data parallelism from scratch (Li et al., VLDB 2020, "PyTorch Distributed").

Every rank holds the whole model and a slice of the batch. At start rank 0's parameters are
broadcast; during backward each gradient, once accumulated, marks its bucket ready, and a full
bucket (about `bucket_bytes`, parameters in reverse order of registration ≈ the order backward
produces them) is all-reduced asynchronously once the buckets before it are (the same order of calls on every rank,
whatever order backward fills them in) — so communication overlaps the rest of the backward
pass (on one x86 host, where data parallelism is all the ranks do, through shared memory instead, each bucket as
it fills: `comm/shared_memory.py`). Gradients are views of their bucket's flat buffer (as torch DDP's gradient_as_bucket_view), so
nothing is copied in or out; at the end of backward (an autograd engine callback) the rank waits. `no_sync()` accumulates locally without
communicating (gradient accumulation). Wire bytes per step per rank: 2(N−1)/N · Ψ · bytes per
gradient element (ring all-reduce). Twin: predict.collectives.ring_all_reduce_bytes_per_rank.
Held equal to torch DDP and to single-process training in tests/parallel/test_ddp.py.
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from mlsyslab.comm import shared_memory
from mlsyslab.comm.launch import Rank
from mlsyslab.comm.log import CommLog, nbytes, traced
from mlsyslab.comm.p2p import Pending
from mlsyslab.parallel.buckets import InOrder, bucket_parameters


class DataParallel(nn.Module):
    def __init__(self, module: nn.Module, rank: Rank, bucket_bytes: int = 25_000_000, log: CommLog | None = None):
        super().__init__()
        self.module, self.rank, self.log = module, rank, log
        self._sync = True
        self.shared = shared_memory.for_data_parallel(rank)
        params = [p for p in module.parameters() if p.requires_grad]
        with torch.no_grad():  # every rank starts from rank 0's weights
            for tensor in [*module.parameters(), *module.buffers()]:
                traced(log, "broadcast", nbytes(tensor), rank.world_size, dist.broadcast, tensor, group=rank.group, group_src=0)
        self.buckets = bucket_parameters(params[::-1], bucket_bytes)
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._in_order = InOrder([len(bucket) for bucket in self.buckets], self._launch)
        # Each bucket's gradients live in one flat buffer; a parameter's .grad is a view of it, so
        # backward accumulates straight into the buffer and the all-reduce needs no copies.
        self._flat = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device) for b in self.buckets]
        self._views = [list(torch.split(flat, [p.numel() for p in b])) for flat, b in zip(self._flat, self.buckets)]
        self._views = [[v.view_as(p) for v, p in zip(views, b)] for views, b in zip(self._views, self.buckets)]
        self._pending: list = [None] * len(self.buckets)
        self._callback_queued = False
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_gradient)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally; the next synced backward reduces the sum."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _on_gradient(self, param: torch.Tensor) -> None:
        if not self._sync:
            return
        if not self._callback_queued:  # once per backward: finish after the engine is done
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self._in_order.arrived(self._bucket_of[id(param)])

    def _launch(self, index: int) -> None:
        flat = self._flat[index]
        for p, view in zip(self.buckets[index], self._views[index]):  # each gradient into its view, averaged on the way
            if p.grad is None:  # no gradient this step (or zero_grad(set_to_none=True) dropped the view)
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                torch.div(p.grad, self.rank.world_size, out=view)
            else:
                view.div_(self.rank.world_size)
            p.grad = view
        if self.shared is not None:  # done on return
            traced(self.log, "all_reduce", nbytes(flat), self.rank.world_size, self.shared.all_reduce, flat)
            works = []
        else:
            works = [traced(self.log, "all_reduce", nbytes(flat), self.rank.world_size, dist.all_reduce, flat,
                            group=self.rank.group, async_op=True)]
        self._pending[index] = Pending(works, self.rank, "DDP gradient all-reduce", tuple(flat.shape))

    def _finish(self) -> None:
        """Wait for every bucket: the averaged gradients are already in place (views of the buckets)."""
        self._in_order.finish()  # buckets some parameter of which got no gradient this step
        for pending in self._pending:
            pending.wait()
        self._pending = [None] * len(self.buckets)
        self._callback_queued = False

