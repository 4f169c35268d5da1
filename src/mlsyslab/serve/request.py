"""A request's life in the engine: its tokens, how many have K/V in the cache, its blocks, its state.

A request is WAITING (queued, or preempted back to the queue), RUNNING (owns KV blocks and is
scheduled every step until done) or FINISHED (stopped, hit its length, or aborted). The scheduler
only ever needs `num_tokens - num_computed`: the tokens whose K/V are not yet in the cache — the
prompt (and, after a preemption, the output so far) for a prefill, one token for a decode.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlsyslab.serve.sampling_params import SamplingParams

if TYPE_CHECKING:  # a Request travels through the server's HTTP process (`serve.output`), which imports no torch
    import torch


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int  # order of arrival: FCFS and preemption victims follow it
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose K/V are in `blocks`
    blocks: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "abort"
    cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache at the last admission
    preemptions: int = 0
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    generator: torch.Generator | None = None
    prompt_logprobs: list | None = None  # when asked: [None, then a `Sampled` per prompt token scored so far]
    matcher: object | None = None  # its grammar's state, for a structured output (`serve.grammar`)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def prompt_scored_to(self) -> int | None:
        """The first position whose logits still score a prompt token (position p scores token p + 1); None
        if none does: the prompt's log-probabilities were not asked for, or are all known."""
        if self.prompt_logprobs is None or len(self.prompt_logprobs) >= len(self.prompt_ids):
            return None
        return len(self.prompt_logprobs) - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
