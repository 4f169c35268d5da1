"""Batches of a token stream, the same on every run: step s always sees the same sequences.

The stream is cut into windows of seq + 1 tokens (input and shifted target); a seeded permutation
orders them, and optimizer step s takes the next `global_batch` windows, of which data-parallel rank
r takes its contiguous share. So a resumed run continues with exactly the sequences the
uninterrupted run would have seen.
"""

import torch

from mlsyslab.errors import InvalidValue


class TokenBatches:
    def __init__(self, tokens: torch.Tensor, seq: int, global_batch: int, seed: int = 0):
        windows = (tokens.numel() - 1) // seq
        if windows < global_batch:
            raise InvalidValue("global_batch", global_batch, f"<= {windows} sequences of {seq} tokens in the corpus")
        self.tokens, self.seq, self.global_batch = tokens, seq, global_batch
        self.order = torch.randperm(windows, generator=torch.Generator().manual_seed(seed))

    def step(self, step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) [global_batch / world_size, seq] of data-parallel `rank` at `step`."""
        per_rank = self.global_batch // world_size
        first = (step * self.global_batch + rank * per_rank) % len(self.order)
        picks = self.order[(first + torch.arange(per_rank)) % len(self.order)]
        starts = picks * self.seq
        windows = torch.stack([self.tokens[s: s + self.seq + 1] for s in starts.tolist()])
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()  # flattened as views: no copy to hold
