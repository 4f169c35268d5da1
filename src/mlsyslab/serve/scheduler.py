"""Iteration-level scheduling with chunked prefill and preemption by recompute.

Continuous batching (Orca, Yu et al., OSDI 2022): the batch is re-formed at every model step, so a
request joins as soon as there is room and leaves the step it finishes — nobody waits for the
longest request of a static batch. Each step has a token budget (`max_batched_tokens`): running
requests go first (a decode costs one token), then waiting requests in arrival order (FCFS). A
prompt longer than what is left of the budget runs in chunks over several steps, alongside the
decodes of the others (chunked prefill, Sarathi, Agrawal et al. 2023): decodes are never stalled by
a long prompt, and every step's batch has about the same cost.

Memory: before a request computes tokens it must own the KV blocks that will hold them
(`serve.kv_cache`). When the pool (plus what the prefix cache can evict) runs short, the most
recently arrived running request is preempted: its blocks go back (full ones to the prefix cache),
it returns to the head of the queue keeping its output, and when readmitted it recomputes its
prompt and output as one longer prefill (vLLM's recompute preemption, Kwon et al. 2023). Nothing
is lost; an abort frees everything at once. The queue is bounded: `add` raises `QueueFull` beyond
`max_waiting`.

Tested by the hypothesis property test in tests/serve/test_scheduler.py (random arrivals, lengths,
aborts, tiny pools that force preemption: every request finishes or is aborted, outputs equal
batch-1, the pool returns to empty).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from mlsyslab.errors import InvalidValue, QueueFull
from mlsyslab.serve.kv_cache import KVCache
from mlsyslab.serve.radix import RadixCache
from mlsyslab.serve.request import Request, Status


@dataclass
class Scheduled:
    """One request's share of a step: compute `num_tokens` tokens starting at `request.num_computed`."""

    request: Request
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last known token, so its logits give the next one."""
        return self.request.num_computed + self.num_tokens == self.request.num_tokens


class Scheduler:
    """Decides, every step, which requests compute how many tokens; owns their blocks."""

    def __init__(self, kv: KVCache, max_seq: int, max_batched_tokens: int, max_running: int, max_waiting: int,
                 prefix_cache: bool):
        """Limits as `serve.engine.EngineConfig` sets them (its defaults are the engine's); max_seq is the model's
        context length, past which no request grows whatever its max_tokens."""
        for name, value in (("max_batched_tokens", max_batched_tokens), ("max_running", max_running),
                            ("max_waiting", max_waiting)):
            if value < 1:
                raise InvalidValue(name, value, ">= 1")
        self.kv, self.max_seq = kv, max_seq
        self.max_batched_tokens, self.max_running, self.max_waiting = max_batched_tokens, max_running, max_waiting
        self.radix = RadixCache(kv) if prefix_cache else None
        self.waiting: list[Request] = []  # by arrival: preempted requests go back in their place
        self.running: list[Request] = []  # by arrival
        self.preemptions = 0

    @property
    def capacity_tokens(self) -> int:
        return self.kv.num_blocks * self.kv.block_size

    def add(self, request: Request) -> None:
        """Queue a request; raises QueueFull at the bound, InvalidValue if it could never fit the pool."""
        longest = min(len(request.prompt_ids) + request.params.max_tokens, self.max_seq)
        if longest > self.capacity_tokens:
            raise InvalidValue("prompt tokens + max_tokens", longest,
                               f"<= {self.capacity_tokens} (the KV cache's capacity; the context length is {self.max_seq})")
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"queue is full: {len(self.waiting)} requests waiting (max_waiting={self.max_waiting}); retry later")
        request.status = Status.WAITING
        bisect.insort(self.waiting, request, key=lambda r: r.arrival)

    def abort(self, request: Request) -> None:
        """Drop a request wherever it is and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.release(request.blocks)
        request.blocks, request.num_computed = [], 0
        request.status, request.finish_reason = Status.FINISHED, request.finish_reason or "abort"

    def finish(self, request: Request, reason: str) -> None:
        """A request is done: its full blocks go to the prefix cache, the rest back to the pool."""
        self.running.remove(request)
        self.give_back(request)
        request.status, request.finish_reason = Status.FINISHED, reason

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Scheduled]:
        """This step's batch: running requests first (oldest first), then waiting ones (FCFS)."""
        budget, batch, preempted = self.max_batched_tokens, [], False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            count = min(request.remaining, budget)
            while not self.reserve(request, count):
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status is Status.RUNNING:
                batch.append(Scheduled(request, count))
                budget -= count
                index += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_running and not preempted:
            request = self.waiting[0]
            self.reuse_prefix(request)
            count = min(request.remaining, budget)
            if not self.reserve(request, count):
                self.give_back(request)
                break
            self.waiting.pop(0)
            request.status = Status.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.arrival)
            batch.append(Scheduled(request, count))
            budget -= count
        return batch

    def reuse_prefix(self, request: Request) -> None:
        """Start a request from the longest cached prefix of its tokens (at least one token left to compute),
        up to the first position whose logits must still score a prompt token (vLLM likewise skips the cache
        for prompt log-probabilities: cached positions have no logits)."""
        if self.radix is None or request.blocks:
            return
        limit = request.num_tokens - 1
        if request.prompt_scored_to is not None:
            limit = min(limit, request.prompt_scored_to)
        blocks = self.radix.match(request.all_ids[:limit])
        self.kv.share(blocks)
        request.blocks = blocks
        request.num_computed = len(blocks) * self.kv.block_size
        request.cached_prompt_tokens = min(request.num_computed, len(request.prompt_ids))

    def reserve(self, request: Request, count: int) -> bool:
        """Own the blocks for `count` more tokens, evicting cached prefixes if needed; False if impossible."""
        needed = self.blocks_short(request, count)
        if needed <= 0:
            return True
        if needed > self.kv.num_free and self.radix is not None:
            self.radix.evict(needed - self.kv.num_free)
        if needed > self.kv.num_free:
            return False
        request.blocks += self.kv.allocate(needed)
        return True

    def reserve_ahead(self, requests: list[Request], count: int) -> bool:
        """Own the blocks for `count` more tokens of each request (multi-step decoding), from free blocks only:
        nothing is evicted or preempted for tokens that may never be kept. False, taking nothing, if too few are
        free. (A request keeps what it took until it finishes or is preempted, as it would for its next tokens.)"""
        needed = [self.blocks_short(request, count) for request in requests]
        if sum(max(0, n) for n in needed) > self.kv.num_free:
            return False
        for request, n in zip(requests, needed):
            if n > 0:
                request.blocks += self.kv.allocate(n)
        return True

    def blocks_short(self, request: Request, count: int) -> int:
        """Blocks the request lacks for `count` more tokens (<= 0: none)."""
        return self.kv.blocks_for(request.num_computed + count) - len(request.blocks)

    def preempt(self, request: Request) -> None:
        """Recompute preemption: give the blocks back, requeue in arrival order, keep the output."""
        self.running.remove(request)
        self.give_back(request)
        request.status = Status.WAITING
        request.preemptions += 1
        self.preemptions += 1
        bisect.insort(self.waiting, request, key=lambda r: r.arrival)

    def give_back(self, request: Request) -> None:
        """Release a request's blocks, caching the full ones first."""
        if self.radix is not None:
            self.radix.insert(request.all_ids[:request.num_computed], request.blocks)
        self.kv.release(request.blocks)
        request.blocks, request.num_computed = [], 0

    def after_step(self, batch: list[Scheduled]) -> None:
        """The model has computed the batch's tokens: advance each request's cached count, and publish
        the full blocks of prefill chunks to the prefix cache at once (so requests arriving while this
        one still decodes already share its prompt, as SGLang does)."""
        for item in batch:
            item.request.num_computed += item.num_tokens
            if self.radix is not None and item.num_tokens > 1:
                self.radix.insert(item.request.all_ids[:item.request.num_computed], item.request.blocks)

    def owners(self) -> list[list[int]]:
        """Every holder of blocks (running requests and the prefix cache), for `KVCache.check`."""
        holders = [request.blocks for request in self.running + self.waiting]
        if self.radix is not None:
            holders.append(self.radix.blocks())
        return holders
