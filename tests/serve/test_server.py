"""The HTTP server with the official `openai` client: completions and chat, streamed and not, errors,
metrics, and a client that disconnects."""

import copy
import json
import re
import time

import httpx
import openai
import pytest

from mlsyslab.nn.pretrained import loaders
from mlsyslab.serve.config import EngineConfig
from mlsyslab.serve.metrics import EngineMetrics
from mlsyslab.serve.output import RequestOutput
from mlsyslab.serve.protocol import best_choices
from mlsyslab.serve.sampling_params import Sampled
from mlsyslab.serve.server import ServerThread, build_server, create_app

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    """As `mlsys serve` starts it: the engine process loads the weights and its tokenizer from loaders."""
    load_model, load_tokenizer, name = loaders("default")
    # one request runs and two wait at a time, so a call of three choices beside a running one finds the queue
    # full (test_queue_bound_gives_503_and_admits_a_call_whole_or_not_at_all)
    config = EngineConfig(kv_cache_bytes=200_000_000, max_running=1, max_waiting=2)
    app, engine = build_server(load_model, load_tokenizer, name, config, threads=2, tool_parser="hermes")
    tokenizer = load_tokenizer()
    with ServerThread(app) as url:
        yield url, engine, tokenizer
    engine.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", timeout=60, max_retries=0)


def test_chat_completion(client):
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=20, temperature=0)
    assert reply.choices[0].message.content == "The capital of France is Paris."
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == 8 and reply.usage.prompt_tokens > 20


def test_chat_streaming_equals_non_streaming(client):
    chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=20,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == 8


def test_completion_streamed_and_not_with_logprobs(client, server):
    prompt = "The three primary colours are"
    plain = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12, temperature=0,
                                      logprobs=2)
    choice = plain.choices[0]
    assert choice.finish_reason == "length" and plain.usage.completion_tokens == 12
    assert "".join(choice.logprobs.tokens) == choice.text
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs) and len(choice.logprobs.top_logprobs[0]) == 2
    streamed = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_seeded_sampling_is_reproducible(client):
    def ask():
        return client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=16,
                                              temperature=1.0, top_p=0.95, seed=7).choices[0].message.content
    assert ask() == ask()


def test_logit_bias_bans_and_forces_tokens(client, server):
    tokenizer = server[2]
    paris = tokenizer.encode(" Paris")
    assert len(paris) == 1

    def answer(bias):
        return client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=12,
                                              temperature=0, logit_bias=bias).choices[0].message.content
    assert "Paris" not in answer({str(paris[0]): -100})
    assert answer({str(paris[0]): 100}) == " Paris" * 12
    for bias in ({"Paris": 1}, {str(paris[0]): 101}, {"999999": 1}):
        with pytest.raises(openai.BadRequestError, match="logit_bias"):
            answer(bias)


def test_min_tokens_holds_back_the_end(client):
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=20,
                                           temperature=0, extra_body={"min_tokens": 12})
    assert reply.usage.completion_tokens >= 12 and reply.choices[0].message.content.startswith(
        "The capital of France is Paris.")
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=4,
                                       extra_body={"min_tokens": 5})


def test_skip_special_tokens_false_shows_them_in_the_text(client):
    """vLLM's extension: with EOS ignored the reply goes on past <|im_end|>, which shows only when asked."""
    def reply(**extra):
        return client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=12,
                                              temperature=0, extra_body={"ignore_eos": True, **extra})
    shown = reply(skip_special_tokens=False).choices[0].message.content
    assert shown.startswith("The capital of France is Paris.<|im_end|>")
    assert "<|im_end|>" not in reply().choices[0].message.content


def test_models_health_metrics(client, server):
    """After a chat, idle: the KV blocks in use are the ones the prefix cache keeps (its prompt's two full blocks)."""
    url, engine, _ = server
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=1)
    wait_until_idle(engine)
    metrics = httpx.get(url + "/metrics").text
    for name in ("mlsys_requests_waiting", "mlsys_kv_blocks_used", "mlsys_prefix_cache_hit_rate",
                 "mlsys_time_to_first_token_seconds_bucket", "mlsys_time_per_output_token_seconds_count",
                 "mlsys_spec_accepted_tokens"):
        assert name in metrics
    cached = engine.check().prefix_cache_blocks
    assert gauge(url, "mlsys_kv_blocks_used") == gauge(url, "mlsys_kv_blocks_prefix_cache") == cached >= 2


def test_a_model_is_retrieved_by_its_name(client):
    """OpenAI's GET /v1/models/{model} (the client's `models.retrieve`): the card /v1/models lists, or a 404."""
    assert client.models.retrieve("SmolLM2-135M-Instruct") == client.models.list().data[0]
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.body["code"] == "model_not_found"


def test_tokenize_gives_the_ids_the_endpoints_run_and_detokenize_their_text(client, server):
    """vLLM's /tokenize counts a prompt as the endpoints count it (their usage.prompt_tokens), a chat through the
    model's template with or without its generation prompt; /detokenize gives transformers' decode of the ids."""
    url, _, tokenizer = server
    tokenized = httpx.post(url + "/tokenize", json={"messages": QUESTION, "return_token_strs": True}).json()
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=1)
    assert tokenized["count"] == len(tokenized["tokens"]) == reply.usage.prompt_tokens
    assert tokenized["tokens"] == tokenizer.chat_ids(QUESTION) and tokenized["max_model_len"] == 8192
    assert tokenized["token_strs"] == [tokenizer.token_string(i) for i in tokenized["tokens"]]
    assert tokenized["token_strs"][:3] == ["<|im_start|>", "system", "Ċ"]
    closed = httpx.post(url + "/tokenize", json={"messages": QUESTION, "add_generation_prompt": False}).json()
    assert closed["tokens"] == tokenizer.chat_ids(QUESTION, add_generation_prompt=False) != tokenized["tokens"]
    prompt = "The three primary colours are"
    counted = httpx.post(url + "/tokenize", json={"model": "SmolLM2-135M-Instruct", "prompt": prompt}).json()
    completion = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=1)
    assert counted["count"] == completion.usage.prompt_tokens and counted["token_strs"] is None
    text = httpx.post(url + "/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"]
    assert text == tokenizer.decode(tokenized["tokens"], skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    for route, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        unknown = httpx.post(url + route, json={**body, "model": "gpt-4"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("route, body, param", [
    ("/tokenize", {"prompt": "hi", "messages": QUESTION}, "prompt"), ("/tokenize", {}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"), ("/detokenize", {"tokens": [1, 49152]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"), ("/detokenize", {"tokens": "hi"}, "tokens"),
])
def test_tokenize_and_detokenize_refuse_bad_input_by_name(server, route, body, param):
    answer = httpx.post(server[0] + route, json=body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.json()


def test_errors_are_openai_shaped(client, server):
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4", messages=QUESTION)
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=-1)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=0)
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt=[1] * 9000, max_tokens=1)
    response = httpx.post(server[0] + "/v1/completions", json={"model": "SmolLM2-135M-Instruct", "max_tokens": "many"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    response = httpx.post(server[0] + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


@pytest.mark.parametrize("field, value", [("tool_choice", "auto"), ("functions", [{"name": "f", "parameters": {}}])])
def test_chat_fields_we_cannot_honour_are_refused(client, field, value):
    """Asked for a tool call, the server says it cannot rather than return free text."""
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=2,
                                       extra_body={field: value})
    assert bad.value.body["param"] == field
    plain = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=2,
                                           response_format={"type": "text"}, tool_choice="none")
    assert plain.choices[0].message.content


COUNTRY = {"type": "object", "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
           "required": ["country", "capital"], "additionalProperties": False}


def test_response_format_json_schema_and_json_object_streamed_and_not(client):
    """OpenAI's structured outputs: the reply parses as JSON with the schema's keys; streamed equals not."""
    schema_format = {"type": "json_schema", "json_schema": {"name": "country", "schema": COUNTRY, "strict": True}}
    question = [{"role": "user", "content": "Which country is Paris in? Answer in JSON."}]
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question, max_tokens=40,
                                           temperature=0, response_format=schema_format)
    assert reply.choices[0].finish_reason == "stop"
    assert set(json.loads(reply.choices[0].message.content)) == {"country", "capital"}
    chunks = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question, max_tokens=40,
                                            temperature=0, response_format=schema_format, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    any_object = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question, max_tokens=40,
                                                temperature=0.7, seed=3, n=2, response_format={"type": "json_object"})
    for choice in any_object.choices:
        assert choice.finish_reason == "length" or isinstance(json.loads(choice.message.content), dict)


def test_vllm_structured_outputs_on_completions(client):
    """vLLM's extension: a regex, a choice and an EBNF grammar, on the legacy completions API."""
    for structured, check in [({"regex": r"\d{3}-\d{4}"}, lambda text: re.fullmatch(r"\d{3}-\d{4}", text)),
                              ({"choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
                              ({"grammar": 'root ::= ("yes" | "no") ", " [a-z]{1,5} "."'},
                               lambda text: re.fullmatch(r"(yes|no), [a-z]{1,5}\.", text))]:
        reply = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Is Paris in France?", max_tokens=12,
                                          temperature=0, extra_body={"structured_outputs": structured})
        assert reply.choices[0].finish_reason == "stop" and check(reply.choices[0].text), (structured, reply.choices[0].text)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos")])
def test_a_structured_output_that_cannot_be_honoured_is_a_400_naming_its_field(server, body, param):
    refused_leaving_nothing(server, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2, **body}, param)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"timezone": {"enum": ["UTC", "CET"]}},
                                       "required": ["timezone"], "additionalProperties": False}}}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def streamed_tool_calls(chunks) -> tuple[list[dict], str]:
    """Tool calls put together from stream chunks as a client does (by index), and the last finish_reason."""
    calls, reason = {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for part in choice.delta.tool_calls or []:
                call = calls.setdefault(part.index, {"name": "", "arguments": ""})
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
    return [calls[i] for i in sorted(calls)], reason


def test_a_named_tool_choice_returns_that_functions_arguments_streamed_and_not(client):
    options = dict(model="SmolLM2-135M-Instruct", messages=WEATHER_QUESTION, tools=[WEATHER, CLOCK], max_tokens=40,
                   temperature=0, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = client.chat.completions.create(**options).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    calls, reason = streamed_tool_calls(client.chat.completions.create(**options, stream=True))
    assert calls == [{"name": "get_weather", "arguments": call.function.arguments}] and reason == "tool_calls"


@pytest.mark.parametrize("parallel", [False, True])
def test_required_tool_calls_call_the_given_tools_streamed_and_not(client, parallel):
    options = dict(model="SmolLM2-135M-Instruct", messages=WEATHER_QUESTION, tools=[WEATHER, CLOCK], max_tokens=80,
                   temperature=0, tool_choice="required", parallel_tool_calls=parallel)
    choice = client.chat.completions.create(**options).choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert len(calls) >= 1 and (parallel or len(calls) == 1)
    required = {"get_weather": {"city", "unit"}, "get_time": {"timezone"}}
    for call in calls:
        assert set(json.loads(call.function.arguments)) == required[call.function.name]
    streamed, reason = streamed_tool_calls(client.chat.completions.create(**options, stream=True))
    assert streamed == [{"name": c.function.name, "arguments": c.function.arguments} for c in calls]
    assert reason == "tool_calls"


def test_a_conversation_with_a_tool_result_goes_on_in_text(client):
    messages = WEATHER_QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, tools=[WEATHER],
                                           tool_choice="none", max_tokens=16, temperature=0)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls


CALL = {"city": "Paris", "unit": "celsius"}
WRITTEN = {  # parser -> (what the model is made to write, the content that comes back)
    "hermes": ("Let me check. <tool_call>" + json.dumps({"name": "get_weather", "arguments": CALL}) + "</tool_call>",
               "Let me check. "),
    "llama3_json": ("<|python_tag|>" + json.dumps({"name": "get_weather", "parameters": CALL}), None),
    "mistral": ("[TOOL_CALLS]" + json.dumps([{"name": "get_weather", "arguments": CALL}]), None)}


@pytest.mark.parametrize("parser", list(WRITTEN))
def test_auto_tool_choice_parses_the_calls_the_model_writes_streamed_and_not(server, parser):
    """"auto" (OpenAI's default with tools): a reply without a call is the answer given without tools (SmolLM2's
    template shows it none); a reply that writes a call in the parser's syntax — made to here by a choice, as this
    model does not of itself — comes back as content and `tool_calls`, streamed as non-streamed."""
    url, engine, tokenizer = server
    with ServerThread(create_app(engine, tokenizer, "SmolLM2-135M-Instruct", EngineMetrics(), parser)) as parsing:
        client = openai.OpenAI(base_url=parsing + "/v1", api_key="none", timeout=60, max_retries=0)
        plain = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=20,
                                               temperature=0, tools=[WEATHER, CLOCK])
        assert plain.choices[0].message.content == "The capital of France is Paris."
        assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "stop"
        written, content = WRITTEN[parser]
        options = dict(model="SmolLM2-135M-Instruct", messages=WEATHER_QUESTION, tools=[WEATHER, CLOCK],
                       max_tokens=120, temperature=0, tool_choice="auto",
                       extra_body={"structured_outputs": {"choice": [written]}})
        choice = client.chat.completions.create(**options).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == content
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == CALL
        chunks = list(client.chat.completions.create(**options, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (content or "")
        calls, reason = streamed_tool_calls(chunks)
        assert calls == [{"name": "get_weather", "arguments": call.function.arguments}] and reason == "tool_calls"


def test_an_api_key_guards_the_routes_and_the_served_name_is_the_models(server):
    """As `mlsys serve --api-key secret --served-model-name smol`: /v1 and /tokenize ask for the key (401 in OpenAI's shape),
    /health and /metrics do not; the model answers to its served name (and "default")."""
    url, engine, tokenizer = server
    with ServerThread(create_app(engine, tokenizer, "smol", EngineMetrics(), api_key="secret")) as guarded:
        stranger = openai.OpenAI(base_url=guarded + "/v1", api_key="wrong", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as refused:
            stranger.models.list()
        assert refused.value.body["code"] == "invalid_api_key"
        assert httpx.post(guarded + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 401
        assert httpx.post(guarded + "/tokenize", json={"prompt": "hi"}).status_code == 401
        assert httpx.post(guarded + "/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer secret"}
                          ).json()["tokens"] == tokenizer.encode("hi")
        assert httpx.get(guarded + "/health").status_code == 200 and httpx.get(guarded + "/metrics").status_code == 200
        client = openai.OpenAI(base_url=guarded + "/v1", api_key="secret", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["smol"]
        reply = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=20, temperature=0)
        assert reply.model == "smol" and reply.choices[0].message.content == "The capital of France is Paris."
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=2)


def test_chat_template_kwargs_reach_the_template(server):
    """vLLM's `chat_template_kwargs` (Qwen3's {"enable_thinking": false}): on a template that reads it, the prompt
    grows by the empty think block; a name the renderer uses is a 400 naming the field."""
    url, engine, tokenizer = server
    thinking = copy.copy(tokenizer)
    thinking.chat_template = tokenizer.chat_template + (
        "{%- if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
        "<think>\n\n</think>\n\n{%- endif %}")
    with ServerThread(create_app(engine, thinking, "SmolLM2-135M-Instruct", EngineMetrics())) as qwen_like:
        client = openai.OpenAI(base_url=qwen_like + "/v1", api_key="none", max_retries=0, timeout=60)
        prompt_tokens = []
        for kwargs in (None, {"enable_thinking": True}, {"enable_thinking": False}):
            extra = {} if kwargs is None else {"extra_body": {"chat_template_kwargs": kwargs}}
            reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=2,
                                                   temperature=0, **extra)
            prompt_tokens.append(reply.usage.prompt_tokens)
        without = len(tokenizer.chat_ids(QUESTION))
        assert prompt_tokens == [without, without, len(thinking.chat_ids(QUESTION, template_kwargs={
            "enable_thinking": False}))] and prompt_tokens[2] > without + 4
        refused_leaving_nothing((qwen_like, engine, thinking), "/v1/chat/completions", {
            "messages": QUESTION, "max_tokens": 2, "chat_template_kwargs": {"add_generation_prompt": False}},
            "chat_template_kwargs")


@pytest.mark.parametrize("parser, opened", [("qwen3", "<think>"), ("deepseek_r1", "")])
def test_a_reasoning_parser_returns_the_think_block_apart_streamed_and_not(server, parser, opened):
    """As `mlsys serve --reasoning-parser`: a reply written as a reasoning model writes it (forced here by a regex:
    SmolLM2 does not reason) comes back as reasoning_content and content, streamed as not; with tools under "auto" the
    answer after the block is what the tool-call parser reads."""
    url, engine, tokenizer = server
    reply_regex = opened + "[A-Za-z ]{5,40}</think>\n\nParis\\."
    with ServerThread(create_app(engine, tokenizer, "SmolLM2-135M-Instruct", EngineMetrics(), "hermes",
                                 reasoning_parser=parser)) as thinking:
        client = openai.OpenAI(base_url=thinking + "/v1", api_key="none", max_retries=0, timeout=60)
        ask = dict(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=40, temperature=0,
                   extra_body={"structured_outputs": {"regex": reply_regex}})
        whole = client.chat.completions.create(**ask).choices[0]
        thought = whole.message.model_extra["reasoning_content"]
        assert re.fullmatch("[A-Za-z ]{5,40}", thought) and whole.message.content == "\n\nParis."
        chunks = list(client.chat.completions.create(**ask, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == thought
        assert "".join(d.content or "" for d in deltas) == "\n\nParis."
        tooled = client.chat.completions.create(**ask, tools=[WEATHER]).choices[0]  # "auto": no call in the answer
        assert tooled.message.model_extra["reasoning_content"] == thought and tooled.message.content == "\n\nParis."
        plain = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=20,
                                               temperature=0).choices[0].message
        sentence = "The capital of France is Paris."  # no block written: answer (qwen3), or reasoning cut short
        expected = (None, sentence) if parser == "qwen3" else (sentence, "")
        assert ((plain.model_extra or {}).get("reasoning_content"), plain.content) == expected


def test_auto_tool_choice_needs_a_server_with_a_parser(server):
    url, engine, tokenizer = server
    without = create_app(engine, tokenizer, "SmolLM2-135M-Instruct", EngineMetrics())
    with ServerThread(without) as plain_url:
        for body in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):
            refused_leaving_nothing((plain_url, engine, tokenizer), "/v1/chat/completions",
                                    {"messages": QUESTION, "max_tokens": 2, **body}, "tool_choice")


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}], "tool_choice": "required"}, "tools[0]"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools[1]"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools")])
def test_tool_requests_that_cannot_be_honoured_are_a_400_naming_the_field(server, body, param):
    refused_leaving_nothing(server, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2, **body}, param)


def test_completion_suffix_is_refused(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="def f(", suffix="return x", max_tokens=2)
    assert bad.value.body["param"] == "suffix"


def test_queue_bound_gives_503_and_admits_a_call_whole_or_not_at_all(server):
    """max_waiting 2, one request running and one waiting: a call of two choices does not fit now (503, neither stays
    queued); one of three never can (400)."""
    url, engine, _ = server
    body = {"prompt": "Count to a thousand:", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url + "/v1/completions", json=body) as running:
            lines = running.iter_lines()  # held: dropping the iterator would close the stream (an abort)
            next(line for line in lines if line.startswith("data:"))  # running now
            with http.stream("POST", url + "/v1/completions", json=body) as waiting:
                assert waiting.status_code == 200 and engine.check().waiting == 1
                two = http.post(url + "/v1/completions", json={**body, "stream": False, "n": 2})
                assert engine.check().waiting == 1  # neither of the two stayed queued
                three = http.post(url + "/v1/completions", json={**body, "stream": False, "n": 3})
    assert two.status_code == 503 and two.json()["error"]["code"] == "queue_full"
    assert three.status_code == 400 and three.json()["error"]["param"] == "prompts × n", three.json()
    wait_until_idle(engine)


def test_n_choices_and_lists_of_prompts(client):
    """Greedy choices each equal the call with one; a list of prompts (text or token ids) answers each in
    order; usage counts each prompt once and every completion."""
    def complete(prompt, **options):
        return client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=8, temperature=0,
                                         **options)
    prompts = ["The three primary colours are", "Paris is the capital of"]
    singles = [complete(prompt) for prompt in prompts]
    both = complete(prompts)
    assert [(c.index, c.text) for c in both.choices] == [(0, singles[0].choices[0].text), (1, singles[1].choices[0].text)]
    assert both.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert both.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    as_ids = complete([[504, 2365, 4226], [504, 2365]])
    assert [c.text for c in as_ids.choices] == [complete([504, 2365, 4226]).choices[0].text,
                                                 complete([504, 2365]).choices[0].text]
    twice = complete(prompts[0], n=2)
    assert [(c.index, c.text) for c in twice.choices] == [(0, singles[0].choices[0].text), (1, singles[0].choices[0].text)]
    assert twice.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert twice.usage.completion_tokens == 2 * singles[0].usage.completion_tokens


def test_seeded_choices_are_each_reproducible_streamed_or_not(client):
    """With a seed, choice j samples as a call with seed + j would (as vLLM's parallel sampling)."""
    def ask(**options):
        return client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=12,
                                              temperature=1.0, **options)
    several = ask(n=2, seed=7)
    texts = [c.message.content for c in several.choices]
    assert texts == [ask(seed=7).choices[0].message.content, ask(seed=8).choices[0].message.content]
    assert texts[0] != texts[1]
    streamed = {0: "", 1: ""}
    chunks = list(ask(n=2, seed=7, stream=True, stream_options={"include_usage": True}))
    for piece in chunks:
        for choice in piece.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert [streamed[0], streamed[1]] == texts
    assert chunks[-1].usage.completion_tokens == several.usage.completion_tokens


def test_echo_scores_the_prompt_as_evaluation_harnesses_ask(client):
    """lm-evaluation-harness's log-likelihood request (`echo`, `logprobs`, a batch of token-id prompts), and
    `max_tokens: 0`: the prompt comes back first, its first token unscored, the rest scored as the engine's
    prompt_logprobs (equal to transformers', tests/nn/test_llama_vs_hf.py); streamed equals not."""
    def complete(prompt, **options):
        return client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, temperature=0, echo=True,
                                         **options)
    prompt = "The three primary colours are"
    plain = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=3, temperature=0,
                                      logprobs=1)
    scored = complete(prompt, max_tokens=3, logprobs=1).choices[0]
    assert scored.text == prompt + plain.choices[0].text
    tokens = scored.logprobs.tokens
    assert "".join(tokens) == scored.text and len(tokens) == plain.usage.prompt_tokens + 3
    assert scored.logprobs.token_logprobs[0] is None and scored.logprobs.top_logprobs[0] is None
    # (the last bits may differ: `plain` found the prompt's blocks in the prefix cache, echo recomputes them)
    assert scored.logprobs.token_logprobs[-3:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert all(lp <= 0 for lp in scored.logprobs.token_logprobs[1:])
    assert scored.logprobs.text_offset == [len("".join(tokens[:i])) for i in range(len(tokens))]

    only = complete(prompt, max_tokens=0, logprobs=1)
    assert only.choices[0].text == prompt and only.usage.completion_tokens == 0
    assert only.choices[0].logprobs.token_logprobs == scored.logprobs.token_logprobs[:-3]
    batch = complete([[504, 1296, 3003], [504, 2365]], max_tokens=1, logprobs=1)
    assert [len(c.logprobs.tokens) for c in batch.choices] == [4, 3]
    streamed = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=3, temperature=0,
                                         echo=True, logprobs=1, stream=True)
    pieces = [c.choices[0] for c in streamed]
    assert "".join(c.text for c in pieces) == scored.text
    assert sum((c.logprobs.token_logprobs for c in pieces if c.logprobs), []) == scored.logprobs.token_logprobs


@pytest.mark.parametrize("body, param", [({"prompt": "hi", "n": 0}, "n"), ({"prompt": "hi", "n": 129}, "n"),
                                         ({"prompt": []}, "prompt"), ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
                                         ({"prompt": "hi", "max_tokens": 0, "echo": True}, "max_tokens"),
                                         ({"prompt": ["hi", "x " * 9000]}, "prompt tokens"),
                                         ({"prompt": "hi", "n": 2, "best_of": 1}, "best_of"),
                                         ({"prompt": "hi", "best_of": 129}, "best_of"),
                                         ({"prompt": "hi", "best_of": 2, "stream": True}, "best_of"),
                                         ({"prompt": "hi", "n": 2, "seed": 2**63 - 1}, "seed"),  # choice 1: 2^63
                                         ({"prompt": "hi", "stop_token_ids": [49152]}, "stop_token_ids"),
                                         ({"prompt": ["hi", "a lone \ud800 surrogate"]}, "prompt"),
                                         # each of these once took the engine down, or was a 500 or taken as another
                                         ({"prompt": "hi", "top_k": 2**63}, "top_k"),
                                         ({"prompt": "hi", "temperature": 1e300}, "temperature"),
                                         ({"prompt": "hi", "logit_bias": {"\u00b2": 1}}, "logit_bias"),
                                         ({"prompt": "hi", "logit_bias": {"01": 1, "1": 2}}, "logit_bias"),
                                         ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
                                         ({"prompt": "hi", "temperature": True}, "temperature"),
                                         ({"prompt": [0, -5]}, "prompt token id")])
def test_a_bad_choice_refuses_the_whole_call(server, body, param):
    refused_leaving_nothing(server, "/v1/completions", {"max_tokens": 2, **body}, param)


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": QUESTION, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": QUESTION, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": QUESTION, "n": True}, "n")])
def test_a_bad_chat_field_is_a_400_naming_it(server, body, param):
    refused_leaving_nothing(server, "/v1/chat/completions", body, param)


def test_a_temperature_under_1e_5_is_greedy(client):
    """As vLLM's: 1e-300 is 0 in fp32 (it once stopped the engine), and logits / T overflows fp32 below ~1e-38."""
    def complete(temperature):
        return client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is",
                                         max_tokens=6, temperature=temperature, seed=1).choices[0].text
    assert complete(1e-300) == complete(1e-40) == complete(0)


def test_text_no_tokenizer_can_read_is_a_400(server):
    """JSON's "\\ud800" without its pair decodes to a lone surrogate, which is not Unicode a tokenizer reads."""
    refused_leaving_nothing(server, "/v1/chat/completions", {"max_tokens": 2, "messages": [
        {"role": "user", "content": "a lone \ud800 surrogate"}]}, "messages")
    answer = httpx.post(server[0] + "/tokenize", content=json.dumps({"prompt": "\udfff"}),
                        headers={"content-type": "application/json"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt"


def test_best_of_returns_the_candidate_with_the_highest_logprob_per_token(client):
    """best_of's candidates are drawn as n choices are (seed + j); the one with the highest mean log-probability
    comes back, without logprobs unless asked; usage counts every candidate's tokens."""
    def complete(**options):
        return client.completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=8,
                                         temperature=1.0, seed=2, **options)
    candidates = complete(n=2, logprobs=0)
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in candidates.choices]
    assert means[1] > means[0]  # the second wins: a server returning the first candidate fails below
    best = complete(best_of=2)
    assert [c.text for c in best.choices] == [candidates.choices[1].text] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == candidates.usage.completion_tokens
    scored = complete(best_of=2, logprobs=1).choices[0]
    assert scored.logprobs.token_logprobs == pytest.approx(candidates.choices[1].logprobs.token_logprobs, abs=1e-4)


def test_best_choices_keeps_each_prompts_n_best_best_first():
    def output(name: str, logprobs: list[float]):
        return RequestOutput(name, [1], [2] * len(logprobs), name, "length", [Sampled(2, lp) for lp in logprobs],
                             None, 0, None, 0.0, 0)
    first = [output("a", [-1.0, -3.0]), output("b", [-0.5]), output("c", [-1.0, -1.0, -1.0])]
    second = [output("d", [-2.0]), output("e", [-4.0]), output("f", [-2.0, -2.0])]
    assert [o.text for o in best_choices(first + second, candidates=3, n=2)] == ["b", "c", "d", "f"]


def refused_leaving_nothing(server, route: str, body: dict, param: str) -> None:
    """The call is a 400 naming `param` (and none of xgrammar's log prefix: "[08:09:42] /project/x.cc:4944: "), and
    the engine holds nothing of it: no request, no block but the cache's."""
    url, engine, _ = server
    response = httpx.post(url + route, content=json.dumps(body), headers={"content-type": "application/json"})  # ASCII
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.json()
    assert ".cc:" not in response.json()["error"]["message"], response.json()
    stats = engine.check()
    assert stats.idle and stats.kv_blocks_used == stats.prefix_cache_blocks


def test_client_disconnect_aborts_and_frees_blocks(server):
    """Leaving a stream after its first token, and timing out on a non-streamed request, both abort."""
    url, engine, _ = server
    body = {"prompt": "Once upon a time", "max_tokens": 500, "temperature": 0, "ignore_eos": True}
    aborted = aborts(url)
    with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/completions",
                                                       json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                assert json.loads(line[5:])["choices"][0]["finish_reason"] is None
                break  # leave after the first token
    wait_until_idle(engine)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={**body, "n": 2}, timeout=1.0)
    wait_until_idle(engine)
    assert aborts(url) == aborted + 3  # the stream's one, and the timed-out call's two choices
    stats = engine.check()  # the child's block pool invariant holds
    assert stats.kv_blocks_used == stats.prefix_cache_blocks  # only the prefix cache holds blocks


def gauge(url: str, name: str) -> float:
    return next(float(line.split()[1]) for line in httpx.get(url + "/metrics").text.splitlines()
                if line.startswith(name + " "))


def aborts(url: str) -> float:
    prefix = 'mlsys_requests_finished_total{finish_reason="abort"}'
    found = [line for line in httpx.get(url + "/metrics").text.splitlines() if line.startswith(prefix)]
    return float(found[0].split()[-1]) if found else 0.0


def wait_until_idle(engine, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not engine.check().idle and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.check().idle, "the request was not aborted"


def test_load_generator_counts_whole_completions_without_streaming(server):
    """For servers that cannot stream: whole completions give throughput and latency; TTFT and TPOT
    are unknown (nan), not made up."""
    import math

    from mlsyslab.serve.loadgen import Workload, run_benchmark

    url, engine, _ = server
    wait_until_idle(engine)
    # one at a time: this server queues a single request beside the running one
    report = run_benchmark(url + "/v1", "default", Workload(requests=3, concurrency=1, prompt_tokens=12,
                                                            output_tokens=5), stream=False)
    assert report.completed == 3 and report.failed == 0 and report.output_tokens_per_s > 0
    assert report.latency_p50_s > 0 and math.isnan(report.ttft_p50_s) and math.isnan(report.tpot_p50_s)


def test_engine_process_exits_quietly_when_its_parent_goes():
    """SIGTERM kills `mlsys serve` without its `finally` (uvicorn re-raises the signal): the engine
    process then reads end-of-file on its command pipe and must stop with exit code 0, not a traceback."""
    from mlsyslab.serve.engine_process import EngineProcess
    from tests.serve.tiny import block_bytes, tiny_model

    engine = EngineProcess(tiny_model(), None, EngineConfig(kv_cache_bytes=64 * block_bytes(), block_size=4), threads=1)
    engine.wait_started()
    engine.commands.close()  # what the parent's death does to the pipe
    engine.process.join(30)
    assert engine.process.exitcode == 0
    engine.stop()


def test_bench_serve_asks_the_server_for_its_model(server, capsys, monkeypatch):
    """`mlsys bench serve --url`: the model name comes from GET /models; a name the server does not list, a URL
    where no server answers, or requests longer than the model's context are refused before any load is sent (exit 2)."""
    from tests.cli.test_cli import run

    url, engine, _ = server
    wait_until_idle(engine)
    load = ("--requests", "2", "--concurrency", "1", "--prompt-tokens", "8", "--output-tokens", "3")
    code, out, err = run(capsys, monkeypatch, "bench", "serve", "--url", url + "/v1", *load, "--json")
    assert code == 0, err
    assert json.loads(out)["server"]["completed"] == 2
    code, _, err = run(capsys, monkeypatch, "bench", "serve", "--url", url + "/v1", "--served-name", "gpt-4", *load)
    assert code == 2 and "--served-name='gpt-4'" in err and "SmolLM2-135M-Instruct" in err
    code, _, err = run(capsys, monkeypatch, "bench", "serve", "--url", "http://127.0.0.1:9/v1", *load)
    assert code == 2 and "--url=" in err and "ConnectError" in err
    # a workload whose longest request (6,000 + 3,000 tokens at spread 0.5) would not fit the server's 8,192: before
    # any load (it once ran, half its requests failing with a 400, and exited 0)
    code, _, err = run(capsys, monkeypatch, "bench", "serve", "--url", url + "/v1", "--requests", "2",
                       "--prompt-tokens", "4000", "--prompt-spread", "0.5", "--output-tokens", "2000", "--output-spread",
                       "0.5")
    assert code == 2 and "--prompt-tokens=4000" in err and "9000" in err and "8192" in err, err


def test_calls_in_flight_when_the_engine_dies_get_a_503_and_the_server_says_it_is_down():
    """The engine process killed (as the OOM killer would) while a stream and a non-streamed call run: the stream
    ends with an error event and [DONE], the call gets a 503 OpenAI-shaped error (once a plain-text 500, the stream
    cut off), and from then on /health is a 503 and /metrics says mlsys_engine_up 0."""
    import threading

    import torch

    from mlsyslab.nn.llama import Llama, LlamaConfig

    # vocab of the tiny tests, wide enough that 400 fp64 steps take a second or more
    config = LlamaConfig(vocab=96, hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, ffn_hidden=1024, max_seq=512)
    model = Llama(config).to(torch.float64).initialize(0.5, torch.Generator().manual_seed(0)).eval()
    app, engine = build_server(model, loaders("default")[1], "tiny", EngineConfig(kv_cache_bytes=32 << 20), threads=1)
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    answers = []
    with ServerThread(app) as url:
        waiting = threading.Thread(target=lambda: answers.append(httpx.post(url + "/v1/completions", json=body,
                                                                            timeout=60)))
        waiting.start()
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
            events = (line[5:].strip() for line in response.iter_lines() if line.startswith("data:"))
            assert "choices" in json.loads(next(events))
            while engine.stats.running < 2:
                time.sleep(0.01)
            engine.process.kill()
            rest = list(events)
        waiting.join(60)
        assert "error" in json.loads(rest[-2]) and rest[-1] == "[DONE]", rest[-3:]
        assert answers[0].status_code == 503 and answers[0].json()["error"]["type"] == "server_error", answers[0].text
        assert httpx.get(url + "/health").status_code == 503 and gauge(url, "mlsys_engine_up") == 0
    engine.stop()
