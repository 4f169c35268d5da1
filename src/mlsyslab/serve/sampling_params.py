"""What a request asks the sampler for (`SamplingParams`, checked when it is made) and what the sampler gives back
for each row (`Sampled`). Plain data without torch: the server's HTTP process builds and validates them, and
sends them to the engine's process (`serve.engine_process`), which samples (`serve.sampling`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mlsyslab.errors import InvalidValue
from mlsyslab.serve.grammar import StructuredOutput

MAX_TOP_LOGPROBS = 20
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-5, 1e6  # under the least: greedy; the most keeps logits / T finite in fp32
MAX_TOP_K = 2**31 - 1  # any k from the vocabulary's size up keeps every token


@dataclass(frozen=True)
class SamplingParams:
    """What to generate and when to stop; invalid values raise `InvalidValue` naming the field."""

    max_tokens: int = 16
    min_tokens: int = 0  # no stop token or stop string ends the output before this many tokens (vLLM's)
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) pairs, OpenAI's logit_bias
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n >= 0: the sampled token's and the n most likely
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (vLLM's prompt_logprobs)
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None  # a grammar the output must match (`serve.grammar`)

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(self, "logit_bias", tuple((token, bias) for token, bias in dict(self.logit_bias).items()))
        if finite(self.temperature) and 0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        check = [
            ("max_tokens", integer(self.max_tokens) and (self.max_tokens >= 1 or self.max_tokens == 0
                                                                 and self.prompt_logprobs is not None),
             "an integer >= 1 (0 only with prompt_logprobs: score the prompt, generate nothing)"),
            ("min_tokens", integer(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
             f"an integer in 0..max_tokens={self.max_tokens}"),
            ("temperature", finite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
             f"in [0, {MAX_TEMPERATURE:g}] (0, or under {MIN_TEMPERATURE:g}: greedy)"),
            ("top_k", integer(self.top_k) and -1 <= self.top_k <= MAX_TOP_K, "an integer in -1..2^31-1 (0 or -1: off)"),
            ("top_p", finite(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", finite(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", finite(self.repetition_penalty) and self.repetition_penalty > 0, "> 0 (1: off)"),
            ("presence_penalty", finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("logit_bias", all(integer(t) and t >= 0 and finite(b) and -100 <= b <= 100 for t, b in self.logit_bias),
             "token ids >= 0, each with a bias in [-100, 100]"),
            ("seed", self.seed is None or integer(self.seed) and -2**63 <= self.seed < 2**63,
             "null or an integer in -2^63..2^63-1 (n choices take seed..seed+n-1)"),
            ("stop", all(isinstance(s, str) and s for s in self.stop) and len(self.stop) <= 16, "up to 16 non-empty strings"),
            ("stop_token_ids", all(integer(t) and t >= 0 for t in self.stop_token_ids), "token ids >= 0"),
            ("structured_output", self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
             "null or a StructuredOutput"),
            ("ignore_eos", not (self.ignore_eos and self.structured_output), "false with a structured output (its "
             "grammar says where the output ends)"),
            ("min_tokens", not (self.min_tokens and self.structured_output), "0 with a structured output (its grammar "
             "says where the output ends)"),
        ] + [(name, getattr(self, name) is None or (integer(getattr(self, name))
                                                    and 0 <= getattr(self, name) <= MAX_TOP_LOGPROBS),
              f"null or an integer in 0..{MAX_TOP_LOGPROBS}") for name in ("logprobs", "prompt_logprobs")]
        for name, ok, valid in check:
            if not ok:
                raise InvalidValue(name, getattr(self, name), valid)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def integer(value) -> bool:
    """An int that is not a bool (True is an int to Python, not a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class Sampled:
    """Per row: the token, and when asked its log-probability and the top ones [(id, logprob)]."""

    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
