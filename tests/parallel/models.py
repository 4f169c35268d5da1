"""Small models, data and the training loop shared by the parallel tests (same seed → same weights)."""

from contextlib import nullcontext

import torch
from torch import nn


class TinyLM(nn.Module):
    """Embedding → two GELU MLP blocks with LayerNorm → untied head: every common layer kind."""

    def __init__(self, vocab: int = 50, width: int = 24, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 3 * width), nn.GELU(),
                                                  nn.Linear(3 * width, width)) for _ in range(2))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


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


def batch(step: int, size: int = 8, seq: int = 6, vocab: int = 50):
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, vocab, (size, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def shard(tensor, rank: int, world: int):
    return tensor.chunk(world)[rank]


def train_loop(model, step, zero_grad, steps: int, accumulate: int, rank=None, no_sync=None) -> list:
    """`steps` optimizer steps of `accumulate` microbatches; with `rank`, on that rank's shard of each batch.

    `no_sync` (a model's context manager) wraps every microbatch but the last. Returns the losses.
    """
    losses = []
    for index in range(steps):
        zero_grad()
        total = 0.0
        for micro in range(accumulate):
            tokens, targets = batch(index * accumulate + micro)
            if rank is not None:
                tokens, targets = shard(tokens, rank.rank, rank.world_size), shard(targets, rank.rank, rank.world_size)
            with no_sync() if no_sync is not None and micro < accumulate - 1 else nullcontext():
                loss = loss_fn(model(tokens).float(), targets) / accumulate
                loss.backward()
            total += loss.item()
        step()
        losses.append(total)
    return losses


def train_single(steps: int, optimizer_factory, accumulate: int = 1):
    """The reference: one process, the whole batch."""
    model = TinyLM()
    optimizer = optimizer_factory(model.parameters())
    losses = train_loop(model, optimizer.step, optimizer.zero_grad, steps, accumulate)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def adam(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, foreach=False)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False)


def branching_reference_step(world: int, lr: float) -> dict:
    """One SGD step of `Branching` on the mean of the ranks' losses of batch 0, only rank 0 using `extra`: the
    parameters a data-parallel run of it must end with."""
    reference = Branching(seed=0)
    tokens, targets = batch(0)
    losses = [loss_fn(reference(shard(tokens, r, world), use_extra=r == 0), shard(targets, r, world)) for r in range(world)]
    (sum(losses) / world).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= lr * p.grad
    return {k: v.clone() for k, v in reference.state_dict().items()}
