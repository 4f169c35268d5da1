"""Speculative decoding with n-gram drafts (prompt lookup decoding): several tokens per pass over the weights.

A decode step reads every weight to compute one token per sequence; at small batches it is memory-bound, so
computing a few more positions of the same sequence in the same pass costs little. Speculative decoding
(Leviathan et al. 2023, Chen et al. 2023) guesses the next k tokens cheaply (the draft), runs the last token and
the draft through the model as one chunk — k + 1 positions, k + 1 rows of logits — and keeps the draft's longest
prefix the model agrees with, plus one token of the model's own: between 1 and k + 1 tokens for one step.

The draft here needs no second model (`propose`): the request's last n tokens (n from `ngram_max` down to
`ngram_min`) are looked up earlier in its own prompt and output, and the k tokens that followed the earliest such
occurrence are the guess — transformers' prompt lookup decoding (`prompt_lookup_num_tokens`, Saxena 2023) and
vLLM's "ngram" method. It pays off where outputs copy their context (summaries, edits, extraction, code) and costs a
few positions of compute where they do not.

The kept tokens are distributed exactly as without speculation (`verify`). Greedy: the draft's tokens are kept
while each equals the largest logit at its position, then the largest logit where they part — the tokens greedy
decoding gives. Sampling: a deterministic draft d is a proposal q = one-hot(d), so the rule "keep d with
probability min(1, p(d)/q(d)), else draw from max(0, p − q) normalised" becomes: keep d with probability p(d), else
draw from p without d; after a fully kept draft, one more draw from the last position's p. A request draws its
uniforms from its own generator, so a seed still gives the same tokens at any batch composition (though not the
tokens of the same seed without speculation: the draws are used differently).

Only requests whose tokens the sampler picks without history (greedy, or temperature without top-k / top-p /
min-p, penalties or logprobs: `speculates`) speculate; under a grammar the draft is what the grammar forces next and
each position is masked by the grammar's state there (`serve.grammar.grammar_draft`, `constrain_draft`); the K/V of rejected positions are
left behind the request's computed count and overwritten as it grows, in blocks it already owns (taken from free
blocks only: nothing is preempted or evicted for a guess). Engine: `EngineConfig.speculative_tokens`. Tested in
tests/serve/test_speculative.py (greedy equal to plain greedy and to transformers' prompt lookup on the real model;
the sampled distribution equal to plain sampling; through chunks, preemption, stops and aborts).
"""

from __future__ import annotations

import numpy as np
import torch

from dataclasses import replace

from mlsyslab.serve.sampling import SamplerInput, inverse_cdf, picked_in_step, softmax
from mlsyslab.serve.sampling_params import Sampled, SamplingParams


def speculates(params: SamplingParams) -> bool:
    """Whether a request may verify drafts: one whose tokens the sampler picks without history
    (`sampling.picked_in_step`), under a grammar or not."""
    return picked_in_step(params if params.structured_output is None else replace(params, structured_output=None))


def propose(ids: list[int], k: int, ngram_max: int, ngram_min: int) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of the last n tokens of `ids`, for the largest n
    in ngram_max..ngram_min that has one with a non-empty continuation (transformers' PromptLookupCandidateGenerator)."""
    tokens = np.asarray(ids)
    for n in range(min(ngram_max, len(tokens) - 1), ngram_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # occurrences ending before the last token
        starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(starts):
            follow = starts[0] + n
            return tokens[follow:follow + k].tolist()
    return []


def verify(logits: torch.Tensor, draft: list[int], row: SamplerInput) -> list[Sampled]:
    """The tokens one speculative step keeps: logits [len(draft) + 1, vocab], row i scoring the position after the
    last token and the draft's first i tokens. Between 1 and len(draft) + 1 tokens."""
    if row.params.greedy:
        largest = logits.max(dim=-1).indices.tolist()  # the first maximum, as `sampling.pick` takes it
        kept = 0
        while kept < len(draft) and draft[kept] == largest[kept]:
            kept += 1
        return [Sampled(token) for token in draft[:kept] + [largest[kept]]]
    probs = softmax(logits, torch.full((len(logits),), row.params.temperature))
    tokens = []
    for position, guess in enumerate(draft):
        if float(torch.rand(1, generator=row.generator, dtype=torch.float64)) < float(probs[position, guess]):
            tokens.append(guess)
            continue
        residual = probs[position:position + 1].clone()
        residual[0, guess] = 0
        return [Sampled(token) for token in tokens] + [Sampled(draw(residual, row))]
    return [Sampled(token) for token in tokens] + [Sampled(draw(probs[-1:], row))]


def draw(probs: torch.Tensor, row: SamplerInput) -> int:
    """One token from one row of (unnormalised) probabilities, with one uniform of the request's generator."""
    return int(inverse_cdf(probs, torch.rand(1, 1, generator=row.generator, dtype=torch.float64))[0])
