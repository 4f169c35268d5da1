"""The real model (SmolLM2-135M-Instruct, GGUF) against Hugging Face transformers' own GGUF loader.

transformers dequantises the same GGUF with the same `gguf` routine, so both hold the same fp32
weights; greedy decoding must then agree token for token — at batch 1 and inside a mixed batch whose
prompts arrive in chunks alongside other requests' decodes.
"""

import json
import re

import pytest
import torch

from mlsyslab.nn.pretrained import default_gguf_path, load_pretrained
from mlsyslab.serve.config import EngineConfig
from mlsyslab.serve.engine import LLM
from mlsyslab.serve.grammar import StructuredOutput
from mlsyslab.serve.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain gravity to a child.",
    "List three uses of a paperclip.", "Why is the sky blue?", "Give me a recipe for pancakes.",
    "What does a compiler do?", "Tell me a short story about a robot who learns to paint.",
    "How do vaccines work?", "Summarise the plot of Romeo and Juliet.",
]


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    ours, tokenizer, _ = load_pretrained("default")
    path = default_gguf_path()
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return ours, tokenizer, theirs


@pytest.fixture(scope="module")
def hf_tokenizer():
    """transformers' tokenizer from the same GGUF (~9 s to read here: once for the module)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_gguf_path().parent), gguf_file=default_gguf_path().name)


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy decoding with transformers' own forward and KV cache (EOS does not stop it)."""
    out, tokens = [], torch.tensor([prompt])
    past = None
    with torch.no_grad():
        for _ in range(new_tokens):
            result = model(input_ids=tokens, past_key_values=past, use_cache=True)
            past = result.past_key_values
            out.append(int(result.logits[0, -1].argmax()))
            tokens = torch.tensor([[out[-1]]])
    return out


def test_weights_equal_transformers_gguf_loader(models):
    ours, _, theirs = models
    reference = theirs.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, reference[name if name.startswith("lm_head") else "model." + name]), name


def test_chat_template_equals_transformers(models, hf_tokenizer):
    _, tokenizer, _ = models
    reference = hf_tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTIONS[0]}]
    expected = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert tokenizer.chat_ids(messages) == list(expected)


def check_greedy(models, questions: list[str], new_tokens: int, batch_one: int):
    ours, tokenizer, theirs = models
    prompts = [tokenizer.chat_ids([{"role": "user", "content": q}]) for q in questions]
    expected = [hf_greedy(theirs, prompt, new_tokens) for prompt in prompts]
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    # a step budget of 48 tokens splits every prompt into chunks that share steps with other requests' decodes
    mixed = LLM(ours, tokenizer, config=EngineConfig(kv_cache_bytes=200_000_000, max_batched_tokens=48))
    for index, output in enumerate(mixed.generate(prompts, params)):
        assert output.output_ids == expected[index], f"mixed batch, prompt {index}: {questions[index]!r}"
    single = LLM(ours, tokenizer, config=EngineConfig(kv_cache_bytes=200_000_000, max_batched_tokens=512))
    for index in range(batch_one):
        assert single.generate([prompts[index]], params)[0].output_ids == expected[index], f"batch 1, prompt {index}"
    mixed.engine.check()


def test_greedy_equals_transformers_10_prompts_x_64_tokens(models):
    """10 prompts x 64 tokens in one mixed batch, 3 of them also at batch 1 (~40 s on 2 quiet cores,
    most of it transformers' own decoding)."""
    check_greedy(models, QUESTIONS, 64, batch_one=3)


@pytest.mark.slow
def test_greedy_equals_transformers_10_prompts_x_64_tokens_each_at_batch_1(models):
    """Every one of the 10 prompts at batch 1 too (~60 s)."""
    check_greedy(models, QUESTIONS, 64, batch_one=len(QUESTIONS))


def test_prompt_logprobs_equal_transformers(models):
    """Scoring prompts (what `echo` with `logprobs` serves): each token's log-probability and the top 5 equal
    the log-softmax of transformers' logits, through prefill chunks of 16 tokens beside other requests."""
    ours, tokenizer, theirs = models
    prompts = [tokenizer.encode(q) for q in QUESTIONS[:4]]
    llm = LLM(ours, tokenizer, config=EngineConfig(kv_cache_bytes=100_000_000, max_batched_tokens=16))
    outputs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=5))
    for prompt, output in zip(prompts, outputs):
        assert output.output_ids == [] and output.finish_reason == "length"
        with torch.no_grad():
            expected = torch.log_softmax(theirs(input_ids=torch.tensor([prompt])).logits[0].float(), dim=-1)
        for position, scored in enumerate(output.prompt_logprobs[1:]):
            assert scored.token == prompt[position + 1]
            assert scored.logprob == pytest.approx(float(expected[position, scored.token]), abs=1e-3)
            top = expected[position].topk(5)
            assert [value for _, value in scored.top] == pytest.approx(top.values.tolist(), abs=1e-3)
    llm.engine.check()


def test_min_tokens_equals_transformers_min_new_tokens(models):
    """EOS held back until `min_tokens`, as transformers' `min_new_tokens` holds it back; a stop string too."""
    ours, tokenizer, theirs = models
    prompts = [tokenizer.chat_ids([{"role": "user", "content": q}]) for q in QUESTIONS[:3]]
    llm = LLM(ours, tokenizer, config=EngineConfig(kv_cache_bytes=100_000_000))
    assert len(llm.generate(prompts[:1], SamplingParams(max_tokens=24, temperature=0))[0].output_ids) < 16  # EOS early
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, min_tokens=16, temperature=0))
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            expected = theirs.generate(torch.tensor([prompt]), do_sample=False, min_new_tokens=16, max_new_tokens=24,
                                       eos_token_id=sorted(tokenizer.eos_token_ids))[0, len(prompt):].tolist()
        assert output.output_ids == expected
    (cut,) = llm.generate(prompts[:1], SamplingParams(max_tokens=24, min_tokens=16, temperature=0, stop=["."]))
    assert cut.text.startswith("The capital of France is Paris.") and len(cut.output_ids) >= 16
    llm.engine.check()


STRUCTURED = [  # (question, the output's grammar, a check of a complete output)
    ("Describe France as JSON.", StructuredOutput("json", json.dumps(
        {"type": "object", "properties": {"country": {"type": "string"}, "capital": {"type": "string"},
                                          "population_millions": {"type": "integer", "maximum": 1000}},
         "required": ["country", "capital", "population_millions"]})),
     lambda text: set(json.loads(text)) == {"country", "capital", "population_millions"}),
    ("Give me a phone number.", StructuredOutput("regex", r"\(\d{3}\) \d{3}-\d{4}"),
     lambda text: re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", text) is not None),
    ("Is the sky blue?", StructuredOutput.choice(["yes", "no", "it depends"]), lambda text: text in ("yes", "no", "it depends")),
    ("Return JSON with your name.", StructuredOutput("json_object"), lambda text: isinstance(json.loads(text), dict)),
]


def test_structured_outputs_equal_transformers_with_xgrammars_logits_processor(models, hf_tokenizer):
    """Greedy decoding under a grammar (a JSON schema, a regex, a choice, any JSON object) equals transformers'
    `generate` with xgrammar's own logits processor on the same weights, its vocabulary read from transformers'
    tokenizer; each request in a mixed batch with the others, through prefill chunks; every output complete. With
    speculative decoding (drafts of what the grammar forces), one request at a time, the same tokens."""
    import xgrammar
    from xgrammar.contrib.hf import LogitsProcessor

    ours, tokenizer, theirs = models
    info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=ours.config.vocab)
    compiler = xgrammar.GrammarCompiler(info)
    llm = LLM(ours, tokenizer, config=EngineConfig(kv_cache_bytes=100_000_000, max_batched_tokens=24))
    speculating = LLM(ours, tokenizer, config=EngineConfig(kv_cache_bytes=100_000_000, speculative_tokens=4))
    prompts = [tokenizer.chat_ids([{"role": "user", "content": question}]) for question, _, _ in STRUCTURED]
    params = [SamplingParams(max_tokens=48, temperature=0, structured_output=structured) for _, structured, _ in STRUCTURED]
    outputs = llm.generate(prompts, params)
    one_at_a_time = [speculating.generate([prompt], p)[0] for prompt, p in zip(prompts, params)]
    assert [o.output_ids for o in one_at_a_time] == [o.output_ids for o in outputs]  # drafts of the forced text
    assert speculating.engine.accepted_draft_tokens > 20
    for prompt, (question, structured, complete), output in zip(prompts, STRUCTURED, outputs):
        theirs_compiled = {  # the same grammar, compiled on their vocabulary
                           "json": lambda: compiler.compile_json_schema(structured.spec, any_whitespace=False),
                           "json_object": lambda: compiler.compile_json_schema('{"type": "object"}', any_whitespace=False),
                           "regex": lambda: compiler.compile_regex(structured.spec),
                           "choice": lambda: compiler.compile_grammar('root ::= "yes" | "no" | "it depends"'),
                           }[structured.kind]()
        with torch.no_grad():
            expected = theirs.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=48,
                                       logits_processor=[LogitsProcessor(theirs_compiled)],
                                       eos_token_id=sorted(tokenizer.eos_token_ids))[0, len(prompt):].tolist()
        assert output.output_ids == expected, question
        assert output.finish_reason == "stop" and complete(output.text), (question, output.text)
    llm.engine.check()


COPY_TASKS = [  # outputs that copy their prompts, where n-gram drafts are kept
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
    "Correct the spelling and repeat the text: Paged atention stores the KV cache in fixed-size blocks of memmory.",
    "Copy this list: apples, oranges, bananas, grapes, pears, plums, cherries.",
]


def test_speculative_greedy_equals_transformers_prompt_lookup_decoding(models):
    """Greedy with n-gram drafts of 4 tokens, in a mixed batch with prefill chunks, equals transformers' `generate`
    with `prompt_lookup_num_tokens=4` (its prompt lookup decoding, whose greedy output is plain greedy's), token for
    token; most steps keep some of their draft."""
    ours, tokenizer, theirs = models
    prompts = [tokenizer.chat_ids([{"role": "user", "content": task}]) for task in COPY_TASKS]
    llm = LLM(ours, tokenizer, config=EngineConfig(kv_cache_bytes=100_000_000, max_batched_tokens=32,
                                                   speculative_tokens=4))
    outputs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0))
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            expected = theirs.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40,
                                       prompt_lookup_num_tokens=4,
                                       eos_token_id=sorted(tokenizer.eos_token_ids))[0, len(prompt):].tolist()
        assert output.output_ids == expected, tokenizer.decode(output.output_ids)
    generated = sum(len(output.output_ids) for output in outputs)
    assert llm.engine.accepted_draft_tokens > generated / 3, (llm.engine.accepted_draft_tokens, llm.engine.draft_tokens)
    llm.engine.check()
