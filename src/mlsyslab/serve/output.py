"""From sampled tokens to what a client sees: text deltas, stop conditions, logprobs.

A request stops on its first of (none before `min_tokens` tokens): a stop token (its `stop_token_ids`, or the
tokenizer's EOS unless `ignore_eos`), a stop string (the text is cut before it; while streaming, the last
`len(longest stop) - 1` characters are held back so a stop string split across tokens is never
sent), `max_tokens`, or the model's context length. Finish reasons follow OpenAI: "stop" or
"length" (and "abort" for a cancelled request). Tested in tests/serve/test_engine.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlsyslab.nn.tokenizer import IncrementalDetokenizer, Tokenizer
from mlsyslab.serve.request import Request
from mlsyslab.serve.sampling_params import Sampled


@dataclass
class Delta:
    """What one step added to a request (for streaming); `finish_reason` set on its last delta."""

    request_id: str
    token_ids: list[int]
    text: str = ""
    logprobs: list[Sampled] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[Sampled | None] | None = None  # on a request's first delta, when asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def then(self, later: "Delta") -> "Delta":
        """This delta and a later one of the same request as one (the tokens of a multi-step decode)."""
        return Delta(self.request_id, self.token_ids + later.token_ids, self.text + later.text,
                     self.logprobs + later.logprobs, later.finish_reason, self.prompt_logprobs)


@dataclass
class RequestOutput:
    """A finished request: prompt and output ids, text, why it stopped, and its measurements."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[Sampled] | None
    prompt_logprobs: list[Sampled | None] | None  # None for the first prompt token, then one per token
    cached_prompt_tokens: int
    ttft_s: float | None
    latency_s: float
    preemptions: int


class OutputTracker:
    """Per request: detokenizes, applies stop conditions, and accumulates the full output."""

    def __init__(self, request: Request, tokenizer: Tokenizer | None, eos_token_ids: frozenset[int], max_seq: int):
        self.request = request
        params = request.params
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_token_ids))
        self.max_seq = max_seq
        self.detokenizer = (IncrementalDetokenizer(tokenizer, request.prompt_ids, params.skip_special_tokens)
                            if tokenizer is not None else None)
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self.text = ""  # the output text so far (cut at a stop string)
        self.sent = 0  # characters of `text` already delivered in deltas
        self.logprobs: list[Sampled] = []

    def add(self, sampled: Sampled) -> tuple[Delta, str | None]:
        """Append one sampled token; returns the delta to deliver and the finish reason (None: go on)."""
        request, token = self.request, sampled.token
        if request.params.max_tokens == 0:  # only the prompt was to be scored: its first sample is dropped
            return Delta(request.request_id, [], "", [], "length", request.prompt_logprobs), "length"
        request.output_ids.append(token)
        if request.params.logprobs is not None:
            self.logprobs.append(sampled)
        reason = None
        if token in self.stop_ids:
            reason = "stop"
        elif self.detokenizer is not None:
            self.text += self.detokenizer.add(token)
            if len(request.output_ids) >= request.params.min_tokens:  # (stop tokens are masked before, in sampling)
                reason = self.cut_at_stop_string()
        if reason is None and (len(request.output_ids) >= request.params.max_tokens or request.num_tokens >= self.max_seq):
            reason = "length"
        end = len(self.text) if reason else max(self.sent, len(self.text) - self.holdback)
        delta = Delta(request.request_id, [token], self.text[self.sent:end],
                      [sampled] if request.params.logprobs is not None else [], reason,
                      request.prompt_logprobs if len(request.output_ids) == 1 else None)
        self.sent = end
        return delta, reason

    def cut_at_stop_string(self) -> str | None:
        stops = self.request.params.stop
        if not stops:
            return None
        start = max(0, self.sent - self.holdback)
        found = [index for index in (self.text.find(stop, start) for stop in stops) if index >= 0]
        if not found:
            return None
        self.text = self.text[:min(found)]
        return "stop"

    def result(self, finish_reason: str, now_s: float) -> RequestOutput:
        request = self.request
        return RequestOutput(
            request_id=request.request_id, prompt_ids=request.prompt_ids, output_ids=list(request.output_ids),
            text=self.text, finish_reason=finish_reason,
            logprobs=self.logprobs if request.params.logprobs is not None else None,
            prompt_logprobs=request.prompt_logprobs,
            cached_prompt_tokens=request.cached_prompt_tokens,
            ttft_s=None if request.first_token_s is None else request.first_token_s - request.arrival_s,
            latency_s=now_s - request.arrival_s, preemptions=request.preemptions)
