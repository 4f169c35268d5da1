"""Sampling: from a step's logits to one token per sequence, with every OpenAI / vLLM option.

Order of operations (as vLLM and HF apply them): OpenAI's logit_bias added to the raw logits; then the
penalties — repetition (Keskar et al. 2019, CTRL: divide a positive logit, multiply a negative one, for
every token in the prompt or output), then presence and frequency (OpenAI: subtract `presence` once and
`frequency · count` for tokens already generated); the request's stop tokens masked while it has fewer than
`min_tokens` (vLLM's, HF's MinNewTokensLengthLogitsProcessor); the tokens a structured output's grammar forbids
masked (`serve.grammar`); then temperature (0 means greedy: argmax; so does any under MIN_TEMPERATURE = 1e-5,
vLLM's _SAMPLING_EPS, which SamplingParams applies (`serve.sampling_params`): logits / T would overflow fp32 below
~1e-38, and long before that softmax is argmax's one-hot);
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

from mlsyslab.nn import cpu_kernels
from mlsyslab.serve.grammar import constrain
from mlsyslab.serve.sampling_params import Sampled, SamplingParams


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
