"""Sampling: from a step's logits to one token per sequence, with every OpenAI / vLLM option.

Order of operations (as vLLM and HF apply them): OpenAI's logit_bias added to the raw logits; then the
penalties — repetition (Keskar et al. 2019, CTRL: divide a positive logit, multiply a negative one, for
every token in the prompt or output), then presence and frequency (OpenAI: subtract `presence` once and
`frequency · count` for tokens already generated); the request's stop tokens masked while it has fewer than
`min_tokens` (vLLM's, HF's MinNewTokensLengthLogitsProcessor); the tokens a structured output's grammar forbids
masked (`serve.grammar`); then temperature (0 means greedy: argmax; so does any under MIN_TEMPERATURE = 1e-5,
vLLM's _SAMPLING_EPS: logits / T would overflow fp32 below ~1e-38, and long before that softmax is argmax's one-hot);
then the filters on the probabilities — top-k, top-p (nucleus, Holtzman et al. 2020: the smallest
set whose mass reaches p), min-p (Nguyen et al. 2024: drop tokens below min_p · the top
probability); then one draw by inverse CDF.

Reproducibility: each request owns a `torch.Generator` seeded from its `seed`, and draws exactly one
uniform per generated token from it, whatever else is in the batch; every other operation is
row-wise. So the same seed gives the same tokens at any batch composition — up to the last-bit
differences a different batch size can make in the logits themselves. Log-probabilities are those
of the model's raw distribution (log-softmax of the logits before bias, penalties and temperature), as
vLLM reports by default. Tested in tests/serve/test_sampling.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mlsyslab.errors import InvalidValue
from mlsyslab.nn import cpu_kernels
from mlsyslab.serve.grammar import StructuredOutput, constrain

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
class SamplerInput:
    """One row of a step's logits: its request's options, token history, random stream, the tokens that would
    stop it (masked while it is under `min_tokens`), and its grammar's matcher (`serve.grammar`) if it has one."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator
    stop_ids: frozenset[int] = frozenset()
    matcher: object | None = None


@dataclass
class Sampled:
    """Per row: the token, and when asked its log-probability and the top ones [(id, logprob)]."""

    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


def sample(logits: torch.Tensor, rows: list[SamplerInput], argmax: torch.Tensor | None = None) -> list[Sampled]:
    """One token per row of `logits` [N, vocab]. argmax: each row's first largest logit, where the step already
    computed it (`nn.fused_decode`, while the logits were in cache); a batch of greedy rows without penalties
    takes it as is (at batch 1 the logits' conversion and max cost ~0.15 ms a step after the step has pushed
    everything else out of the caches)."""
    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    penalties = any(penalised(row.params) for row in rows)
    if argmax is not None and not sampled and not penalties:
        tokens = argmax
    else:
        tokens = pick(logits, rows, greedy, sampled, penalties)
    results = [Sampled(token) for token in tokens.tolist()]
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if wanted:
        scored = score(logits[wanted], [results[i].token for i in wanted], [rows[i].params.logprobs for i in wanted])
        for i, row in zip(wanted, scored):
            results[i] = row
    return results


def score(logits: torch.Tensor, tokens: list[int], counts: list[int], rows_at_once: int = 256) -> list[Sampled]:
    """Each row's token with its log-probability under the row's raw distribution (log-softmax of the logits)
    and the row's `count` most likely [(id, logprob)]; `rows_at_once` rows at a time, so that scoring a prompt
    chunk's thousands of rows never holds more than one slice's fp32 copy."""
    scored = []
    for start in range(0, len(tokens), rows_at_once):
        rows = slice(start, start + rows_at_once)
        logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
        chosen = logprobs.gather(1, torch.tensor(tokens[rows])[:, None])[:, 0].tolist()
        values, ids = logprobs.topk(max(counts[rows]), dim=-1)
        for j, (token, logprob, count) in enumerate(zip(tokens[rows], chosen, counts[rows])):
            scored.append(Sampled(token, logprob, list(zip(ids[j, :count].tolist(), values[j, :count].tolist()))))
    return scored


def pick(logits: torch.Tensor, rows: list[SamplerInput], greedy: list[int], sampled: list[int],
         penalties: bool) -> torch.Tensor:
    """The rows' tokens from their logits (fp32 or bf16): penalties and grammars' masks first (on an fp32 copy),
    then the greedy rows' largest logit and the other rows' draws."""
    if penalties:
        logits = logits.to(torch.float32, copy=True)
        for index, row in enumerate(rows):
            if penalised(row.params):
                apply_penalties(logits[index], row)
        constrain(logits, {index: row.matcher for index, row in enumerate(rows) if row.matcher is not None})
    # max(dim).indices: the first maximum, as argmax, in a third of argmax's time on CPU (0.18 vs 0.55 ms
    # for 16 rows of a 49k vocabulary here)
    if not sampled:  # the common cases need no copy of the [N, vocab] logits
        return logits.max(dim=-1).indices
    if not greedy:
        return draw(logits, rows)
    tokens = torch.empty(len(rows), dtype=torch.long)
    tokens[greedy] = logits[greedy].max(dim=-1).indices
    tokens[sampled] = draw(logits[sampled], [rows[i] for i in sampled])
    return tokens


def picked_in_step(params: SamplingParams) -> bool:
    """Whether the decode step's kernel can pick a row's token itself (`nn.fused_decode.FusedDecode.ahead`): its
    largest logit, or `draw`'s draw without top-k / top-p / min-p; no penalties, nothing else reported (logprobs)."""
    return not penalised(params) and params.logprobs is None and (params.greedy or not filters(params))


def penalised(params: SamplingParams) -> bool:
    """Whether a row's logits change before temperature: a logit bias, a penalty, a minimum length or a grammar."""
    return (bool(params.logit_bias) or params.repetition_penalty != 1 or params.presence_penalty != 0
            or params.frequency_penalty != 0 or params.min_tokens > 0 or params.structured_output is not None)


def apply_penalties(logits: torch.Tensor, row: SamplerInput) -> None:
    """In place on one row of logits: the logit bias, the penalties, then the stop tokens' mask under min_tokens."""
    params = row.params
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias)
        logits[list(ids)] += torch.tensor(biases, dtype=logits.dtype)
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long)
        if len(seen):
            values = logits[seen]
            logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and row.output_ids:
        ids, counts = torch.tensor(row.output_ids, dtype=torch.long).unique(return_counts=True)
        logits[ids] -= params.presence_penalty + params.frequency_penalty * counts.to(logits.dtype)
    if len(row.output_ids) < params.min_tokens and row.stop_ids:
        logits[sorted(row.stop_ids)] = -math.inf


def draw(logits: torch.Tensor, rows: list[SamplerInput]) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p where a row asks for them, then inverse-CDF sampling with
    one uniform per row. Rows without filters draw over the vocabulary in its own order: sorting 49k
    probabilities costs ~1 ms a row here (15 ms a step at 16 rows, half a decode step) and only the
    filters need the order; with the C++ kernels built, in one kernel (`softmax_draw`, nn/csrc: the same
    draw; one row after a decode step 0.82 -> 0.40 ms, 0.12 of it the kernel). Which way a row goes depends on its own options only, so the same seed
    still gives the same token at any batch composition."""
    temperature = torch.tensor([row.params.temperature for row in rows], dtype=torch.float32)
    uniform = torch.cat([torch.rand(1, generator=row.generator, dtype=torch.float64) for row in rows])
    tokens = torch.empty(len(rows), dtype=torch.long)
    filtered = [i for i, row in enumerate(rows) if filters(row.params)]
    plain = [i for i, row in enumerate(rows) if not filters(row.params)]
    if plain:  # (all rows, most often: then without a copy of the logits, ~0.1 ms at batch 1)
        part = logits if len(plain) == len(rows) else logits[plain]
        if cpu_kernels.serves(part):
            tokens[plain] = cpu_kernels.load().softmax_draw(part.contiguous(), temperature[plain], uniform[plain])
        else:
            tokens[plain] = inverse_cdf(softmax(part, temperature[plain]), uniform[plain, None])
    if filtered:
        tokens[filtered] = draw_filtered(softmax(logits[filtered], temperature[filtered]),
                                         [rows[i].params for i in filtered], uniform[filtered, None])
    return tokens


def softmax(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """softmax(logits / temperature) per row, in fp32."""
    return torch.softmax(logits.float() / temperature[:, None], dim=-1)


def filters(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1 or params.min_p > 0


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative probability exceeds uniform · total, per row; zero-probability
    tokens (rounding) never picked."""
    vocab = probs.shape[-1]
    cumulative = probs.cumsum(dim=-1)
    threshold = (uniform * cumulative[:, -1:].double()).float()
    position = torch.searchsorted(cumulative, threshold, right=True).clamp(max=vocab - 1)
    impossible = probs.gather(-1, position) == 0  # only where rounding ran past the last possible token
    if impossible.any():
        last_possible = vocab - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1, keepdim=True)
        position = torch.where(impossible, last_possible, position)
    return position[:, 0]


def draw_filtered(probs: torch.Tensor, params: list[SamplingParams], uniform: torch.Tensor) -> torch.Tensor:
    """top-k, top-p and min-p on the probabilities in decreasing order, then `inverse_cdf` there.

    Only the `CANDIDATES` most likely tokens are sorted (`topk`: 2.6 ms for 16 rows of 49k here, a full
    sort 22 ms) when that provably holds every token the filters keep: top-k within them, top-p's mass
    reached inside them, min-p's threshold above the last of them. Other rows sort the whole vocabulary."""
    vocab = probs.shape[-1]
    width = min(CANDIDATES, vocab)
    candidates, order = probs.topk(width, dim=-1)
    inside = kept(candidates, params, vocab)[:, -1].logical_not() | (width == vocab)  # the kept set ends inside
    tokens = torch.empty(len(params), dtype=torch.long)
    for rows, among_candidates in ((inside.nonzero()[:, 0], True), (inside.logical_not().nonzero()[:, 0], False)):
        if len(rows):
            values, ids = (candidates[rows], order[rows]) if among_candidates else probs[rows].sort(-1, descending=True)
            position = inverse_cdf(values * kept(values, [params[i] for i in rows.tolist()], vocab), uniform[rows])
            tokens[rows] = ids.gather(-1, position[:, None])[:, 0]
    return tokens


CANDIDATES = 1024


def kept(sorted_probs: torch.Tensor, params: list[SamplingParams], vocab: int) -> torch.Tensor:
    """Which of the (decreasing) probabilities top-k, top-p and min-p keep: always a prefix, never empty."""
    rank = torch.arange(sorted_probs.shape[-1])[None, :]
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params])[:, None]
    top_p = torch.tensor([p.top_p for p in params])[:, None]
    min_p = torch.tensor([p.min_p for p in params])[:, None]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (rank < top_k) & (mass_before < top_p) & (sorted_probs >= min_p * sorted_probs[:, :1])
    keep[:, 0] = True  # the most likely token always survives
    return keep
