"""Constrained decoding (`serve.grammar`): every output matches its grammar, and equals the batch-1 truth — the
training path with the grammar's mask applied by hand — in a mixed batch, through prefill chunks and preemption.
A random model with SmolLM2's vocabulary and tokenizer; the real model against transformers is in
tests/nn/test_llama_vs_hf.py, the HTTP API in tests/serve/test_server.py."""

import json
import re

import pytest
import torch
import xgrammar

from mlsyslab.errors import InvalidValue
from mlsyslab.nn.llama import Llama, LlamaConfig
from mlsyslab.nn.pretrained import resolve_folder
from mlsyslab.nn.tokenizer import Tokenizer
from mlsyslab.serve.config import EngineConfig
from mlsyslab.serve.engine import LLM
from mlsyslab.serve.grammar import StructuredOutput
from mlsyslab.serve.sampling_params import SamplingParams

CONFIG = LlamaConfig(vocab=49152, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, ffn_hidden=64,
                     rope_theta=1000.0, max_seq=192)
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                                           "size": {"enum": [1, 2, 3]}},
          "required": ["colour", "ok", "size"], "additionalProperties": False}
GRAMMARS = [  # each with a check that an output is complete
    (StructuredOutput("json", json.dumps(SCHEMA)), lambda text: set(json.loads(text)) == {"colour", "ok", "size"}),
    (StructuredOutput("regex", r"[a-c]{2}-[0-9]{3}"), lambda text: re.fullmatch(r"[a-c]{2}-[0-9]{3}", text)),
    (StructuredOutput.choice(["alpha", "beta gamma", 'say "hi"']), lambda text: text in ("alpha", "beta gamma", 'say "hi"')),
    (StructuredOutput("grammar", 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'),
     lambda text: re.fullmatch(r"\((\d|x)(,(\d|x))*\)", text)),
]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    model = Llama(CONFIG).to(torch.float64).initialize(0.5, torch.Generator().manual_seed(0)).eval()
    return model, Tokenizer(resolve_folder("default"))


def constrained_greedy(model: Llama, compiled, prompt: list[int], max_tokens: int, eos: int) -> list[int]:
    """Greedy tokens from the training path (no cache), each step's forbidden tokens set to -inf by hand."""
    matcher, bitmask, ids = xgrammar.GrammarMatcher(compiled), xgrammar.allocate_token_bitmask(1, CONFIG.vocab), list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids]))[0, -1:].float()
            matcher.fill_next_token_bitmask(bitmask)
            xgrammar.apply_token_bitmask_inplace(logits, bitmask)
            ids.append(int(logits.argmax()))
            assert matcher.accept_token(ids[-1])
            if ids[-1] == eos:
                break
    return ids[len(prompt):]


@pytest.mark.parametrize("speculative", [0, 4])
def test_outputs_match_their_grammars_and_the_batch_1_truth_through_chunks_and_preemption(model_and_tokenizer,
                                                                                          speculative):
    """... with speculative decoding too: drafts of what the grammar forces next, each position masked by the
    grammar's state there (`serve.grammar.grammar_draft`, `constrain_draft`)."""
    model, tokenizer = model_and_tokenizer
    (eos,) = tokenizer.eos_token_ids
    prompts = [tokenizer.encode(text) for text in ("Pick a colour:", "A code please", "Say something.", "A tuple:",
                                                   "Another colour, maybe green or blue?", "Code:")]
    grammars = [GRAMMARS[i % len(GRAMMARS)] for i in range(len(prompts))]
    # 8 requests of up to 40 tokens in a pool of 10 blocks of 8 tokens, prompts split into chunks of 8: preemption
    llm = LLM(model, tokenizer, config=EngineConfig(kv_cache_bytes=10 * 8 * CONFIG.kv_elements_per_token * 8,
                                                    block_size=8, max_batched_tokens=8, speculative_tokens=speculative,
                                                    speculative_max_rows=64))
    plain = SamplingParams(max_tokens=30, temperature=0)
    params = [SamplingParams(max_tokens=30, temperature=0, structured_output=structured) for structured, _ in grammars]
    outputs = llm.generate(prompts + prompts[:2], params + [plain, plain])
    assert llm.engine.scheduler.preemptions > 0
    for prompt, (structured, complete), output in zip(prompts, grammars, outputs):
        expected = constrained_greedy(model, llm.engine.grammars.compile(structured), prompt, 30, eos)
        assert output.output_ids == expected, structured.kind
        assert output.finish_reason == "stop" and complete(output.text), (structured.kind, output.text)
    assert outputs[-1].output_ids != outputs[1].output_ids  # without its grammar the model says something else
    assert (llm.engine.accepted_draft_tokens > 10) == bool(speculative)  # the schema's keys, at least
    llm.engine.check()


@pytest.mark.parametrize("speculative", [0, 4])
def test_a_seeded_constrained_draw_is_the_same_alone_and_in_a_crowd(model_and_tokenizer, speculative):
    model, tokenizer = model_and_tokenizer
    llm = LLM(model, tokenizer, config=EngineConfig(kv_cache_bytes=10_000_000, speculative_tokens=speculative,
                                                    speculative_max_rows=64))
    prompt = tokenizer.encode("Pick a colour:")
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=7, structured_output=GRAMMARS[0][0])
    alone = llm.generate([prompt], params)[0]
    crowd = llm.generate([[5, 6, 7]] * 3 + [prompt] + [[8, 9]] * 2,
                         [SamplingParams(max_tokens=12, temperature=1.0)] * 3 + [params]
                         + [SamplingParams(max_tokens=20, temperature=0.5, structured_output=GRAMMARS[1][0])] * 2)
    assert crowd[3].output_ids == alone.output_ids and GRAMMARS[0][1](alone.text)
    assert all(GRAMMARS[1][1](output.text) for output in crowd[4:])
    llm.engine.check()


@pytest.mark.parametrize("structured, field", [
    (StructuredOutput("regex", "[a-"), "structured_output.regex"),
    (StructuredOutput("json", "{not json"), "structured_output.json"),
    (StructuredOutput("grammar", "root ::= missing_rule"), "structured_output.grammar"),
])
def test_a_grammar_that_does_not_compile_is_refused_before_it_is_queued(model_and_tokenizer, structured, field):
    model, tokenizer = model_and_tokenizer
    llm = LLM(model, tokenizer, config=EngineConfig(kv_cache_bytes=10_000_000))
    with pytest.raises(InvalidValue, match=re.escape(field)):
        llm.generate([[1, 2, 3]], SamplingParams(structured_output=structured))
    assert not llm.engine.has_work()


@pytest.mark.parametrize("options, field", [
    ({"ignore_eos": True}, "ignore_eos"), ({"min_tokens": 2}, "min_tokens")])
def test_options_that_fight_the_grammars_end_are_refused(options, field):
    with pytest.raises(InvalidValue, match=field):
        SamplingParams(structured_output=StructuredOutput("json_object"), **options)
    with pytest.raises(InvalidValue, match="structured_output"):
        StructuredOutput("yaml", "a: 1")
    with pytest.raises(InvalidValue, match="structured_output.choice"):
        StructuredOutput.choice([])


def test_an_engine_without_a_tokenizer_refuses_a_grammar(model_and_tokenizer):
    llm = LLM(model_and_tokenizer[0], config=EngineConfig(kv_cache_bytes=10_000_000))
    with pytest.raises(InvalidValue, match="no tokenizer"):
        llm.generate([[1, 2, 3]], SamplingParams(structured_output=StructuredOutput("json_object")))
