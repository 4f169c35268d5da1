"""Speculative decoding with n-gram drafts (`serve.speculative`): drafts as transformers' prompt lookup finds them,
kept tokens distributed exactly as without speculation, greedy outputs unchanged through chunks, preemption, stops
and aborts (also in the scheduler's hypothesis test, tests/serve/test_scheduler.py); the real model against
transformers' prompt lookup decoding is in tests/nn/test_llama_vs_hf.py."""

import random

import pytest
import torch

from mlsyslab.errors import InvalidValue
from mlsyslab.serve.config import EngineConfig
from mlsyslab.serve.engine import LLM
from mlsyslab.serve.sampling import SamplerInput
from mlsyslab.serve.sampling_params import SamplingParams
from mlsyslab.serve.speculative import propose, verify
from tests.serve.tiny import block_bytes, greedy_reference, tiny_model


def test_drafts_follow_the_earliest_occurrence_of_the_longest_ngram():
    ids = [1, 2, 3, 9, 2, 3, 4, 5, 7, 2, 3]
    assert propose(ids, 3, 3, 1) == [9, 2, 3]  # "2 3" first occurs at 1: what followed it
    assert propose(ids + [4], 2, 3, 1) == [5, 7]  # "2 3 4" at 4 beats "3 4" and "4"
    assert propose(ids + [4], 2, 1, 1) == [5, 7]
    assert propose([1, 2, 3, 1], 4, 3, 1) == [2, 3, 1]  # the continuation may run into the tail itself
    assert propose([1, 2, 3, 4], 4, 3, 1) == []  # the last token never occurred before
    assert propose([5, 6, 5, 6], 4, 3, 2) == [5, 6]  # only n-grams of 2 or 3 tokens, as asked



def test_drafts_equal_transformers_prompt_lookup_candidates():
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    theirs = PromptLookupCandidateGenerator(num_output_tokens=4, max_matching_ngram_size=3, max_length=1000)
    rng = random.Random(0)
    for _ in range(300):  # a 6-token vocabulary: many repeats
        ids = [rng.randrange(6) for _ in range(rng.randrange(2, 40))]
        candidates, _ = theirs.get_candidates(torch.tensor([ids]))
        assert propose(ids, 4, 3, 1) == candidates[0, len(ids):].tolist(), ids


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kept_tokens_are_distributed_as_the_model_says(temperature):
    """The rejection rule for a one-hot draft: the first token ~ p0 whatever the draft; given the first draft token
    kept, the second ~ p1. Total-variation distance of 20,000 draws from the exact distributions."""
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0], [0.0, 1.5, 0.3, 0.2, -1.0], [0.4, 0.3, 0.2, 0.1, 0.0]])
    probs = torch.softmax(logits / temperature, dim=-1)
    draft = [0, 1]  # p0(0) ~ 0.24 and p1(1) ~ 0.55 at temperature 1: both kept and refused often
    params = SamplingParams(temperature=temperature)
    firsts, seconds = torch.zeros(5), torch.zeros(5)
    lengths = set()
    for seed in range(20_000):
        tokens = [s.token for s in verify(logits, draft, SamplerInput(params, [], [], torch.Generator().manual_seed(seed)))]
        lengths.add(len(tokens))
        firsts[tokens[0]] += 1
        if tokens[0] == draft[0]:
            seconds[tokens[1]] += 1
    assert lengths == {1, 2, 3}
    assert 0.5 * (firsts / firsts.sum() - probs[0]).abs().sum() < 0.015
    assert 0.5 * (seconds / seconds.sum() - probs[1]).abs().sum() < 0.025


def test_greedy_keeps_the_draft_while_it_is_the_largest_logit():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    greedy = SamplerInput(SamplingParams(temperature=0), [], [], torch.Generator())
    assert [s.token for s in verify(logits, [1, 0], greedy)] == [1, 0, 2]  # both kept, then the model's own
    assert [s.token for s in verify(logits, [1, 2], greedy)] == [1, 0]  # the second refused: the model's token
    assert [s.token for s in verify(logits, [2, 0], greedy)] == [1]


def repetitive_prompts() -> list[list[int]]:
    """Prompts that repeat themselves, so drafts are found from the first step."""
    return [[5, 6, 7, 8] * 4 + [5, 6], [9, 10, 11] * 5, list(range(20, 30)) * 2 + [20], [40, 41, 42, 40, 41]]


def test_greedy_outputs_are_unchanged_through_chunks_preemption_and_stops():
    """A random model rarely repeats itself, so few drafts are kept (13 of 343 here): each one checks that the kept
    positions' K/V, computed in the verifying step, are what one step at a time computes."""
    model = tiny_model()
    prompts = repetitive_prompts()
    expected = [greedy_reference(model, prompt, 60) for prompt in prompts]
    roomy = LLM(model, config=EngineConfig(kv_cache_bytes=200 * block_bytes(16), speculative_tokens=4, ngram_min=1,
                                           speculative_max_rows=64))
    assert [output.output_ids for output in roomy.generate(prompts, SamplingParams(max_tokens=60, temperature=0))] == expected
    assert roomy.engine.accepted_draft_tokens > 0 and roomy.engine.steps < 60
    # a pool of 24 blocks of 4 for four requests of up to 81 tokens, and 7-token chunks: preemption
    tight = LLM(model, config=EngineConfig(kv_cache_bytes=24 * block_bytes(4), block_size=4, max_batched_tokens=7,
                                           speculative_tokens=4, ngram_min=1, speculative_max_rows=64))
    assert [output.output_ids for output in tight.generate(prompts, SamplingParams(max_tokens=60, temperature=0))] == expected
    assert tight.engine.scheduler.preemptions > 0 and tight.engine.draft_tokens > 0
    stop = expected[1][5]  # a stop token ends the output at its first occurrence, drafted or not
    (stopped,) = roomy.generate(prompts[1:2], SamplingParams(max_tokens=60, temperature=0, stop_token_ids=[stop]))
    assert stopped.output_ids == expected[1][:expected[1].index(stop) + 1] and stopped.finish_reason == "stop"
    roomy.engine.check()
    tight.engine.check()


def test_a_seeded_speculative_draw_is_the_same_alone_and_in_a_crowd():
    model = tiny_model()
    llm = LLM(model, config=EngineConfig(kv_cache_bytes=200 * block_bytes(16), speculative_tokens=3, ngram_min=1))
    prompt = repetitive_prompts()[0]
    params = SamplingParams(max_tokens=24, temperature=0.3, seed=11)
    alone = llm.generate([prompt], params)[0].output_ids
    crowd = llm.generate([[1, 2]] * 3 + [prompt] + repetitive_prompts()[1:],
                         [SamplingParams(max_tokens=9, temperature=1.0)] * 3 + [params]
                         + [SamplingParams(max_tokens=20, temperature=0.5, top_k=5)] * 3)
    assert crowd[3].output_ids == alone and llm.engine.accepted_draft_tokens > 0
    llm.engine.check()


def test_drafts_only_while_the_step_has_few_rows():
    model = tiny_model()
    prompts = repetitive_prompts()
    for max_rows, speculates in ((4, False), (12, True)):  # four decodes: a step of 4 rows has no room for a draft
        llm = LLM(model, config=EngineConfig(kv_cache_bytes=200 * block_bytes(16), speculative_tokens=4, ngram_min=1,
                                             speculative_max_rows=max_rows))
        llm.generate(prompts, SamplingParams(max_tokens=30, temperature=0))
        assert (llm.engine.draft_tokens > 0) == speculates


def test_bad_speculative_settings_name_the_field():
    with pytest.raises(InvalidValue, match="speculative_tokens"):
        LLM(tiny_model(), config=EngineConfig(kv_cache_bytes=10 * block_bytes(16), speculative_tokens=-1))
    with pytest.raises(InvalidValue, match="ngram_min"):
        LLM(tiny_model(), config=EngineConfig(kv_cache_bytes=10 * block_bytes(16), ngram_min=3, ngram_max=2))
