"""The engine on the real model: stop conditions, streaming deltas, prefix reuse, abort."""

import pytest
import torch

from mlsyslab.serve.config import EngineConfig
from mlsyslab.serve.engine import LLM, Engine
from mlsyslab.serve.sampling_params import SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(2)
    return LLM("default", config=EngineConfig(kv_cache_bytes=300_000_000), keep_source=True)  # tests build engines of
    # its source model


def test_greedy_answer_and_stop_conditions(llm):
    (answer,) = llm.chat([QUESTION], SamplingParams(max_tokens=24, temperature=0))
    assert answer.text == "The capital of France is Paris." and answer.finish_reason == "stop"
    assert answer.output_ids[-1] in llm.tokenizer.eos_token_ids  # the EOS token is in the ids, not the text
    (cut,) = llm.chat([QUESTION], SamplingParams(max_tokens=24, temperature=0, stop=["Paris", "Rome"]))
    assert cut.text == "The capital of France is " and cut.finish_reason == "stop"
    (short,) = llm.chat([QUESTION], SamplingParams(max_tokens=3, temperature=0))
    assert short.finish_reason == "length" and len(short.output_ids) == 3 and answer.text.startswith(short.text)
    capital = llm.tokenizer.encode(" capital")[0]
    (by_token,) = llm.chat([QUESTION], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[capital]))
    assert by_token.output_ids[-1] == capital and by_token.finish_reason == "stop"


def test_streamed_deltas_add_up_and_never_leak_a_stop_string(llm):
    engine = llm.engine
    prompt = llm.tokenizer.chat_ids(QUESTION)
    engine.add_request("s", prompt, SamplingParams(max_tokens=24, temperature=0, stop=["of France is Paris"]))
    pieces, finished = [], []
    while engine.has_work():
        deltas, done = engine.step()
        pieces += [d.text for d in deltas]
        finished += done
    assert "".join(pieces) == finished[0].text == "The capital "
    assert not any("of" in piece for piece in pieces)


def test_prefix_cache_skips_a_shared_system_prompt(llm):
    system = {"role": "system", "content": "You are a terse assistant. " * 12}
    questions = ["Name a colour.", "Name a fruit.", "Name an animal."]
    params = SamplingParams(max_tokens=8, temperature=0)
    conversations = [[system, {"role": "user", "content": q}] for q in questions]
    uncached = LLM(llm.engine.source_model, llm.tokenizer, config=EngineConfig(kv_cache_bytes=300_000_000, prefix_cache=False))
    expected = uncached.chat(conversations, params)
    first = llm.chat(conversations[:1], params)
    before = llm.engine.prefill_tokens
    rest = llm.chat(conversations[1:], params)
    assert [o.output_ids for o in first + rest] == [o.output_ids for o in expected]
    system_tokens = len(llm.tokenizer.chat_ids([system], add_generation_prompt=False))
    assert all(o.cached_prompt_tokens >= system_tokens - llm.engine.kv.block_size for o in rest)
    assert llm.engine.prefill_tokens - before < sum(len(o.prompt_ids) for o in rest) - system_tokens
    assert llm.engine.scheduler.radix.hit_rate() > 0


def test_abort_frees_every_block(llm):
    engine = Engine(llm.engine.source_model, llm.tokenizer, EngineConfig(kv_cache_bytes=100_000_000, prefix_cache=False))
    engine.add_request("a", llm.tokenizer.chat_ids(QUESTION), SamplingParams(max_tokens=50))
    engine.add_request("b", llm.tokenizer.chat_ids(QUESTION), SamplingParams(max_tokens=50))
    engine.step()
    assert engine.kv.num_used > 0
    assert engine.abort("a").finish_reason == "abort"
    engine.abort("b")
    assert engine.kv.num_used == 0 and not engine.has_work() and engine.abort("a") is None


def test_stream_gives_the_deltas_then_the_output_and_leaving_early_aborts(llm):
    prompt = llm.tokenizer.chat_ids(QUESTION)
    *deltas, output = llm.stream(prompt, SamplingParams(max_tokens=24, temperature=0))
    assert "".join(d.text for d in deltas) == output.text == "The capital of France is Paris."
    assert output.output_ids == llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0].output_ids
    stream = llm.stream(prompt, SamplingParams(max_tokens=24, temperature=0))
    next(stream)
    stream.close()
    assert not llm.engine.has_work()
    llm.engine.check()
    assert llm.engine.kv.num_used == llm.engine.scheduler.radix.num_nodes  # only the prefix cache holds blocks


def test_requests_added_together_are_queued_all_or_none():
    from mlsyslab.errors import InvalidValue
    from mlsyslab.errors import QueueFull
    from tests.serve.tiny import block_bytes, tiny_model

    engine = Engine(tiny_model(), config=EngineConfig(kv_cache_bytes=64 * block_bytes(), block_size=4, max_waiting=2))
    good = ("a", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidValue, match="prompt tokens"):
        engine.add_requests([good, ("b", [1] * 500, SamplingParams(max_tokens=4))])
    with pytest.raises(InvalidValue, match="prompts × n=3"):  # more than max_waiting: could never be queued
        engine.add_requests([good, ("b", [4, 5], SamplingParams()), ("c", [6], SamplingParams())])
    engine.add_requests([good])
    with pytest.raises(QueueFull):  # two fit the bound, not beside the one waiting: neither stays
        engine.add_requests([("b", [4, 5], SamplingParams()), ("c", [6], SamplingParams())])
    assert list(engine.trackers) == ["a"] and engine.kv.num_used == 0
    engine.add_requests([("b", [4, 5], SamplingParams(max_tokens=4))])
    finished = []
    while engine.has_work():
        finished += engine.step()[1]
    assert sorted(o.request_id for o in finished) == ["a", "b"]
    engine.check()


def test_packed_fp32_mixed_batch_equals_batch_1():
    """The serving fast path (oneDNN-prepacked, fused weights) gives the same greedy tokens in a
    chunked, mixed batch as one request at a time (fp32, tiny random model)."""
    from tests.serve.tiny import block_bytes, tiny_model

    model = tiny_model(dtype=torch.float32)
    prompts = [[(5 * i + 3 * j) % 96 for j in range(3 + 7 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0)
    config = EngineConfig(kv_cache_bytes=400 * block_bytes(16) // 2, max_batched_tokens=16)
    mixed = LLM(model, config=config)
    assert type(mixed.engine.model.lm_head).__name__ == "PackedLinear"
    together = [o.output_ids for o in mixed.generate(prompts, params)]
    alone = [LLM(model, config=config).generate([p], params)[0].output_ids for p in prompts]
    assert together == alone


def test_refresh_weights_serves_the_updated_model():
    """RLHF changes the weights in place; the prepacked serving copy is re-read on refresh_weights()."""
    from tests.serve.tiny import block_bytes, greedy_reference, tiny_model

    model = tiny_model(dtype=torch.float32)
    llm = LLM(model, config=EngineConfig(kv_cache_bytes=100 * block_bytes(16)))
    params = SamplingParams(max_tokens=8, temperature=0)
    before = llm.generate([[1, 2, 3]], params)[0].output_ids
    with torch.no_grad():
        for layer in model.layers:
            layer.mlp.down_proj.weight.mul_(-3.0)
    assert llm.generate([[1, 2, 3]], params)[0].output_ids == before  # the prepacked linears are a snapshot
    llm.engine.refresh_weights()
    after = llm.generate([[1, 2, 3]], params)[0].output_ids
    assert after == greedy_reference(model, [1, 2, 3], 8) and after != before


def test_bf16_weights_run_wide_steps_on_their_exact_fp32_copy():
    """A 16-bit CPU engine sends steps of many tokens to an fp32 copy of the same weights (faster GEMMs on
    CPUs without a bf16 dot product); the copy holds the bf16 values exactly, so all-wide generation is the
    fp32 model's."""
    import copy

    from mlsyslab.measure.host import cpu_has_bf16_dot
    from tests.serve.tiny import block_bytes, greedy_reference, tiny_model

    model = tiny_model(dtype=torch.bfloat16)
    config = EngineConfig(kv_cache_bytes=100 * block_bytes(16))
    default = Engine(model, config=config)
    assert default.wide_from == (0 if cpu_has_bf16_dot() else 16) and (default.wide_model is None) == cpu_has_bf16_dot()
    assert Engine(model, config=EngineConfig(kv_cache_bytes=config.kv_cache_bytes, fp32_steps_from=0)).wide_model is None
    always = LLM(model, config=EngineConfig(kv_cache_bytes=config.kv_cache_bytes, fp32_steps_from=1))
    wide = always.engine.wide_model
    assert torch.equal(wide.embed_tokens.weight, model.embed_tokens.weight.float())
    prompt = [5, 17, 3, 60, 41]
    expected = greedy_reference(copy.deepcopy(model).float(), prompt, 8)
    assert always.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0].output_ids == expected
    assert Engine(tiny_model(dtype=torch.float32), config=config).wide_model is None  # fp32 needs no copy
    if default.wide_model is not None:  # its steps never stream: it widens the bf16 table's rows, holding no fp32 one
        from mlsyslab.nn.packed_linear import WidenedEmbedding

        table = default.wide_model.embed_tokens
        assert isinstance(table, WidenedEmbedding) and table.embedding.weight is model.embed_tokens.weight
        long_prompt = list(range(3, 23))  # 20 tokens: one wide step, whose last row gives the first token
        first = LLM(model, config=config).generate([long_prompt], SamplingParams(max_tokens=1, temperature=0))
        assert first[0].output_ids == greedy_reference(copy.deepcopy(model).float(), long_prompt, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_engine_that_owns_its_model_holds_one_copy_of_each_matrix(dtype):
    """keep_source=False (the server's engine, `mlsys generate`, LLM of a path): the source model keeps only what the
    serving copies share with it (embedding, norms); a bf16 engine with an fp32 copy for wide steps prepares no
    16-bit kernel for those; the outputs are those of an engine that keeps everything, wide steps and narrow, and
    refreshing weights it no longer has is refused. (Once a bf16 SmolLM2 engine held its matrices four times over:
    2.05 GB resident with a 64 MB KV pool, 1.13 GB now.)"""
    import copy

    from mlsyslab.nn.packed_linear import PackedLinear
    from tests.serve.tiny import block_bytes, tiny_model

    model = tiny_model(dtype=dtype)
    config = EngineConfig(kv_cache_bytes=100 * block_bytes(16), fp32_steps_from=4)
    prompts, params = [[5, 17, 3, 60, 41, 9], [7, 2]], SamplingParams(max_tokens=6, temperature=0)
    kept = LLM(copy.deepcopy(model), config=config)
    expected = [output.output_ids for output in kept.generate(prompts, params)]
    owner = LLM(model, config=config, keep_source=False)
    assert [output.output_ids for output in owner.generate(prompts, params)] == expected
    held = {name for name, parameter in model.named_parameters() if parameter.device.type != "meta"}
    assert held and all("norm" in name or "embed" in name for name in held), held
    assert all(p.device.type != "meta" for p in kept.engine.source_model.parameters())
    narrow = [m for m in owner.engine.model.modules() if isinstance(m, PackedLinear)]
    if owner.engine.wide_model is not None:  # its steps from 4 tokens on run the fp32 copy: no kernel only for those
        assert narrow and all(low < 4 for m in narrow for low in [0] + [below for below, _ in m.plan[:-1]])
    with pytest.raises(RuntimeError, match="keep_source"):
        owner.engine.refresh_weights()


def test_prompt_logprobs_equal_the_training_paths_through_chunks_cache_and_preemption():
    """Each prompt token's log-probability (and the top 3) as one forward pass of the training path gives them
    (an fp64 model, scored in fp32 as the sampler's logprobs are): across prefill chunks of 5 tokens, for a prompt whose blocks the prefix cache already holds, and
    for requests preempted and recomputed in a pool too small for all of them at once."""
    from tests.serve.tiny import block_bytes, tiny_model

    model = tiny_model()
    prompts = [[(7 * i + 3 * j) % 96 for j in range(11 + 6 * i)] for i in range(4)]
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            logprobs = torch.log_softmax(model(torch.tensor([prompt]))[0], dim=-1)
            expected.append([(prompt[p + 1], float(logprobs[p, prompt[p + 1]]),
                              list(zip(logprobs[p].topk(3).indices.tolist(), logprobs[p].topk(3).values.tolist())))
                             for p in range(len(prompt) - 1)])
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, prompt_logprobs=3)

    def check(outputs, wanted_each):
        for output, wanted in zip(outputs, wanted_each):
            assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(output.prompt_ids)
            for got, (token, logprob, top) in zip(output.prompt_logprobs[1:], wanted):
                assert got.token == token and got.logprob == pytest.approx(logprob, abs=1e-5)
                assert [t for t, _ in got.top] == [t for t, _ in top]
                assert [v for _, v in got.top] == pytest.approx([v for _, v in top], abs=1e-5)

    roomy = LLM(model, config=EngineConfig(kv_cache_bytes=64 * block_bytes(), block_size=4, max_batched_tokens=5))
    assert roomy.generate([prompts[3]])[0].prompt_logprobs is None  # not asked for
    check(roomy.generate([prompts[3]], params), expected[3:])  # its blocks were in the prefix cache
    assert roomy.generate([prompts[3]], SamplingParams(max_tokens=1))[0].cached_prompt_tokens == 28
    tight = LLM(model, config=EngineConfig(kv_cache_bytes=16 * block_bytes(), block_size=4, max_batched_tokens=5))
    check(tight.generate(prompts, params), expected)
    assert tight.engine.scheduler.preemptions > 0
    for llm in (roomy, tight):
        llm.engine.check()


def test_a_llama3_style_folder_chats_as_transformers_generates(tmp_path):
    """A folder shaped as Llama 3.x's (llama3 rotary scaling, a 131,072-token context, a tokenizer that adds BOS
    itself, generation_config.json's EOS list), random weights, SmolLM2's vocabulary and template: our chat prompt
    and greedy reply equal transformers' apply_chat_template and generate on the same folder."""
    import json
    import shutil
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mlsyslab.nn.hf_loader import save_hf_folder
    from mlsyslab.nn.llama import Llama, LlamaConfig
    from mlsyslab.nn.pretrained import resolve_folder
    from mlsyslab.nn.rope import RopeScaling

    config = LlamaConfig(vocab=49152, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, ffn_hidden=256,
                         rope_theta=500000.0, rope_scaling=RopeScaling("llama3", 32.0), max_seq=131072)
    save_hf_folder(Llama(config).initialize(0.5, torch.Generator().manual_seed(0)).eval(), tmp_path)
    for file in resolve_folder("default").iterdir():
        if file.name.startswith(("tokenizer", "special_tokens")) or file.suffix == ".jinja":
            shutil.copy(file, tmp_path / file.name)
    tokenizer_json = json.loads((tmp_path / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    tokenizer_json["post_processor"] = {
        "type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))

    llm = LLM(str(tmp_path))
    assert llm.engine.source_model.config.rope_scaling == config.rope_scaling and llm.tokenizer.eos_token_ids == {0, 2}
    # the weights were read from the file's mapping; the engine keeps none of it (its pages were all resident)
    assert str(tmp_path / "model.safetensors") not in Path("/proc/self/maps").read_text()
    (ours,) = llm.chat([QUESTION], SamplingParams(max_tokens=16, temperature=0))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    prompt = theirs.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert ours.prompt_ids == prompt["input_ids"][0].tolist() and ours.prompt_ids[:2] != [1, 1]
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    expected = model.generate(**prompt, max_new_tokens=16, do_sample=False)[0, len(ours.prompt_ids):].tolist()
    assert ours.output_ids == expected


@pytest.mark.parametrize("family", ["phi3", "qwen2", "qwen3"])
def test_phi3_and_qwen_folders_serve_transformers_greedy_tokens(tmp_path, family):
    """A Phi-3 checkpoint (q|k|v and gate|up fused, split at load), a Qwen2 one (biases on Q, K and V) or a Qwen3 one
    (q and k head norms, a head size of its own: 32 against hidden / heads = 16) written as transformers writes one,
    θ 1e6, tied embeddings, random weights: prompts of
    several lengths in one batch — prefill in chunks beside decodes, then the fused decode step — give transformers'
    greedy tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mlsyslab.nn.hf_loader import load_hf_folder

    torch.manual_seed(4)
    theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        family, vocab_size=512, hidden_size=64 if family == "qwen3" else 128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        rope_theta=1000000.0, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()
    with torch.no_grad():
        for name, parameter in theirs.named_parameters():
            parameter.normal_(1, 0.3) if name.endswith("norm.weight") else parameter.normal_(0, 0.3)
    theirs.save_pretrained(tmp_path)
    prompts = [[(37 * i + 11 * j) % 512 for j in range(3 + 13 * i)] for i in range(5)]
    llm = LLM(load_hf_folder(tmp_path), config=EngineConfig(kv_cache_bytes=4_000_000, max_batched_tokens=16))
    config = llm.engine.source_model.config
    assert (config.qkv_bias, config.qk_norm) == (family == "qwen2", family == "qwen3")
    assert llm.engine.fused_decode is not None and config.head_dim == 32
    ours = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for prompt, output in zip(prompts, ours):
        expected = theirs.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, len(prompt):]
        assert output.output_ids == expected.tolist()
    llm.engine.check()
