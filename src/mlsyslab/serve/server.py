"""An OpenAI-compatible HTTP server: a thin FastAPI layer over `serve.engine_process.EngineProcess`
(the engine runs in a process of its own).

Routes: POST /v1/completions and /v1/chat/completions (JSON, or server-sent events with
`"stream": true`), GET /v1/models and /v1/models/{model}, /health, /metrics (Prometheus), and vLLM's POST
/tokenize and /detokenize (`serve.protocol.TokenizeRequest`). Errors use OpenAI's body
`{"error": {"message", "type", "param", "code"}}`: 400 for an invalid parameter or a prompt over the
context length, 404 for another model name, 503 when the queue is full or the engine has failed.
A call's choices (`n`, and the completions API's list of prompts; `serve.protocol`) are engine requests
admitted together or not at all, and stream back merged. Where `tool_choice` asks for a call (`serve.tools`), the
reply is rendered as `tool_calls`. A client that disconnects — mid-stream, or
while waiting for a non-streamed answer — aborts its requests, which frees their KV blocks. Tested with
the official `openai` client in tests/serve/test_server.py.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlsyslab.errors import InvalidValue, MlsysError, QueueFull
from mlsyslab.nn.tokenizer import Tokenizer
from mlsyslab.serve import reasoning_parser as reasoning
from mlsyslab.serve.engine_process import EngineProcess
from mlsyslab.serve.metrics import EngineMetrics
from mlsyslab.serve.output import RequestOutput
from mlsyslab.serve.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    best_choices,
    chat_logprobs,
    completion_logprobs,
    echoed,
    envelope,
    new_id,
    usage,
)
from mlsyslab.serve.sampling_params import SamplingParams
from mlsyslab.serve.tool_parser import PARSERS, ToolCallStream
from mlsyslab.serve.tools import tool_call

OPEN_ROUTES = ("/health", "/metrics")  # without the API key: probes and scrapers


def build_server(model, tokenizer, model_name: str, config, threads: int | None = None,
                 tool_parser: str | None = None, api_key: str | None = None, reasoning_parser: str | None = None
                 ) -> tuple[FastAPI, EngineProcess]:
    """An engine process for `model` with `config` (`EngineConfig`) and `threads` torch threads (None:
    torch's default), started, and the app serving it (reading tool_choice "auto" replies with `tool_parser`,
    one of `serve.tool_parser.PARSERS`; None: "auto" is refused; chat replies' think blocks with `reasoning_parser`,
    one of `serve.reasoning_parser.PARSERS`), asking for `api_key` if given. `model` and
    `tokenizer` are a loaded `Llama` and `Tokenizer`, or their loaders (`nn.pretrained.loaders`): then the engine
    process loads its own while this one loads the tokenizer and the chat template renderer, on the two cores at
    once (`mlsys serve` started in 10-11 s one after the other on a 2-core AVX2 host, 2026-11-24)."""
    if tool_parser not in (None, *PARSERS):
        raise InvalidValue("tool_parser", tool_parser, f"null or one of {', '.join(PARSERS)}")
    if reasoning_parser not in (None, *reasoning.PARSERS):
        raise InvalidValue("reasoning_parser", reasoning_parser, f"null or one of {', '.join(reasoning.PARSERS)}")
    metrics = EngineMetrics()
    engine = EngineProcess(model, tokenizer, config, threads, on_finish=metrics.observe)
    tokenizer = tokenizer() if callable(tokenizer) else tokenizer
    tokenizer.prepare_chat()
    engine.wait_started()
    metrics.watch(lambda: engine.stats, lambda: engine.healthy)
    return create_app(engine, tokenizer, model_name, metrics, tool_parser, api_key, reasoning_parser), engine


def create_app(engine: EngineProcess, tokenizer: Tokenizer, model_name: str, metrics: EngineMetrics,
               tool_parser: str | None = None, api_key: str | None = None, reasoning_parser: str | None = None
               ) -> FastAPI:
    """The FastAPI app serving `engine` under the model name `model_name`. With `api_key`, every route asks for it as
    OpenAI's clients send it (`Authorization: Bearer <key>`; a 401 otherwise, as vLLM's `--api-key`) but /health and
    /metrics, which stay open to probes and scrapers."""
    app = FastAPI(title="mlsyslab", version="0.1.0")

    if api_key:
        @app.middleware("http")
        async def authorize(http: Request, call_next):
            given = http.headers.get("authorization", "")
            if http.url.path not in OPEN_ROUTES and not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error_response(401, "a missing or wrong API key (send it as 'Authorization: Bearer <key>')",
                                      "invalid_request_error", None, "invalid_api_key")
            return await call_next(http)

    max_seq, capacity = engine.stats.max_seq, engine.stats.capacity_tokens
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {"loc": ("body",), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            reason = first.get("ctx", {}).get("error", first["msg"])
            return error_response(400, f"the request body is not valid JSON ({reason})", "invalid_request_error")
        # OpenAI's `param` is the request's field; pydantic's loc goes on into union branches ("prompt.str")
        param = next((str(part) for part in first["loc"] if part != "body"), None)
        value = repr(first.get("input"))
        value = value if len(value) <= 60 else value[:57] + "..."
        return error_response(400, f"{param or 'body'}={value} is invalid ({first['msg']})", "invalid_request_error",
                              param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, error: StarletteHTTPException):  # an unknown route (404), a wrong method (405)
        return error_response(error.status_code, str(error.detail), "invalid_request_error")

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return error_response(503, f"engine is not running: {engine.error!r}", "server_error")
        return {"status": "ok"}

    card = {"id": model_name, "object": "model", "created": created, "owned_by": "mlsyslab", "max_model_len": max_seq}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model}")
    async def model(model: str):
        return answer(lambda: check_model(model, model_name) or card)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return answer(lambda: check_model(body.model, model_name) or body.response(tokenizer, max_seq))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return answer(lambda: check_model(body.model, model_name) or body.response(tokenizer))

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    async def admit(body, prefix: str) -> Call:
        """Check the model name, translate the body, and queue its choices, all or none."""
        check_model(body.model, model_name)
        choices = body.to_engine(tokenizer, max_seq, capacity)
        call = Call(new_id(prefix), int(time.time()), body.candidates, [prompt_ids for prompt_ids, _ in choices],
                    choices[0][1])
        requests = [(call.engine_id(index), prompt_ids, params) for index, (prompt_ids, params) in enumerate(choices)]
        try:
            call.stream = await engine.submit(requests)
        except InvalidValue as error:  # the engine compiles a structured output's grammar: name the API's field
            if not error.field.startswith("structured_output"):
                raise
            raise InvalidValue(body.structured_field, error.value, error.valid) from None
        return call

    async def events(call: Call, body, kind: str, render, first: dict | None = None):
        """Server-sent events: `first` for each choice, then `render(delta, index)` gives each delta's choices;
        usage last if asked; then [DONE]."""
        if first is not None:
            yield sse(envelope(kind, call.request_id, model_name, call.created,
                               [{"index": index, **first} for index in range(len(call.prompts))]))
        try:
            async for item in call.stream:
                index = call.index(item.request_id)
                if isinstance(item, RequestOutput):
                    call.outputs[index] = item
                else:
                    for choice in render(item, index):
                        yield sse(envelope(kind, call.request_id, model_name, call.created, [{"index": index, **choice}]))
        except RuntimeError as error:  # the engine failed mid-stream: say so, as vLLM does, and end the stream
            yield sse({"error": {"message": str(error), "type": "server_error", "param": None, "code": 503}})
            yield "data: [DONE]\n\n"
            return
        if body.stream_options and body.stream_options.include_usage:
            yield sse({**envelope(kind, call.request_id, model_name, call.created, []), "usage": call.usage()})
        yield "data: [DONE]\n\n"

    async def respond(body, http: Request, prefix: str, kind: str, render_delta, render_output, first=None):
        try:
            call = await admit(body, prefix)
        except MlsysError as error:
            return error_for(error)
        except RuntimeError as error:  # the engine process has failed
            return error_response(503, str(error), "server_error")
        if body.stream:
            return StreamingResponse(events(call, body, kind + ".chunk" if first else kind,
                                            lambda delta, index: render_delta(delta, index, call), first),
                                     media_type="text/event-stream")
        try:
            if not await collect(call, http):
                return Response(status_code=499)  # the client left; its requests were aborted
        except RuntimeError as error:  # the engine failed while the call waited
            return error_response(503, str(error), "server_error")
        outputs = [output for _, output in sorted(call.outputs.items())]
        if body.ranked:
            outputs = best_choices(outputs, body.candidates, body.n)
        choices = [{"index": index, **render_output(output, call)} for index, output in enumerate(outputs)]
        return {**envelope(kind, call.request_id, model_name, call.created, choices), "usage": call.usage()}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        offsets: dict[int, int] = {}  # each choice's characters sent so far

        def render_delta(delta, index, call):
            choices = []
            text, sampled = delta.text, delta.logprobs
            if body.echo and index not in offsets:  # a choice's first delta carries its prompt first
                text, sampled = echo(call.prompts[index], delta.prompt_logprobs, text, sampled)
            offset = offsets.get(index, 0)
            if text or sampled or delta.finish_reason:
                choices.append(completion_choice(text, delta.finish_reason, sampled, offset))
            offsets[index] = offset + len(text)
            return choices

        def render_output(output, call):
            text, sampled = output.text, output.logprobs or []
            if body.echo:
                text, sampled = echo(output.prompt_ids, output.prompt_logprobs, text, sampled)
            return completion_choice(text, output.finish_reason, sampled, 0)

        def echo(prompt_ids, prompt_logprobs, text, sampled):
            """The prompt before the completion, and its scored tokens before the completion's."""
            return (tokenizer.decode(prompt_ids, skip_special_tokens=False) + text,
                    echoed(prompt_ids, prompt_logprobs) + sampled)

        def completion_choice(text, reason, sampled, text_offset):
            logprobs = completion_logprobs(tokenizer, sampled, text_offset) if body.logprobs is not None else None
            return {"text": text, "logprobs": logprobs, "finish_reason": reason}

        return await respond(body, http, "cmpl", "text_completion", render_delta, render_output)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: Request):
        try:
            schemas, tools = body.tool_calls()
            if tools is not None and tools.auto and tool_parser is None:
                raise InvalidValue("tool_choice", body.tool_choice or "auto (the default with tools)",
                                   "'none', 'required' or a named function ('auto' needs a server started with "
                                   f"--tool-call-parser, one of {', '.join(PARSERS)})")
        except MlsysError as error:
            return error_for(error)
        parser = PARSERS[tool_parser] if tools is not None and tools.auto else None  # "auto": replies read for calls
        # think blocks, where the model decides what it writes (a named or "required" tool choice decodes calls only)
        thinker = reasoning.PARSERS[reasoning_parser] if reasoning_parser and (tools is None or tools.auto) else None
        names = set(schemas)
        replies: dict[int, str] = {}  # each choice's text so far, where replies are tool calls
        streams: dict[int, ToolCallStream] = {}  # each choice's reply so far, where the model may write calls
        thoughts: dict[int, reasoning.ReasoningStream] = {}  # each choice's reply so far, where it may reason

        def logprobs_of(sampled, call):
            return chat_logprobs(tokenizer, sampled) if call.params.logprobs is not None else None

        def render_delta(delta, index, call):
            if thinker is None:
                return answer_deltas(delta, index, call)
            thought, answer = thoughts.setdefault(index, thinker.stream()).add(delta.text, bool(delta.finish_reason))
            choices = [{"delta": {"reasoning_content": thought}, "logprobs": None, "finish_reason": None}] if thought else []
            return choices + answer_deltas(replace(delta, text=answer), index, call)

        def answer_deltas(delta, index, call):
            if parser is not None:
                return parsed_deltas(delta, index, call)
            if tools is not None:
                return tool_call_deltas(delta, index)
            choices = []
            if delta.text or delta.logprobs:
                choices.append({"delta": {"content": delta.text}, "logprobs": logprobs_of(delta.logprobs, call),
                                "finish_reason": None})
            if delta.finish_reason:
                choices.append({"delta": {}, "logprobs": None, "finish_reason": delta.finish_reason})
            return choices

        def tool_call_deltas(delta, index):
            """A named function's arguments stream as they come (its id and name first); "required" calls come
            whole once the array is complete."""
            choices, first = [], index not in replies
            replies[index] = replies.get(index, "") + delta.text
            if tools.function is not None and (delta.text or first):
                call = {"index": 0, "function": {"arguments": delta.text}}
                if first:
                    call = {**tool_call(tools.function, delta.text), "index": 0}
                choices.append({"delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": None})
            if delta.finish_reason:
                message, reason = tool_message(replies[index], delta.finish_reason)
                if tools.function is None and message["tool_calls"]:
                    choices.append(calls_chunk(message["tool_calls"]))
                elif tools.function is None:
                    choices.append({"delta": {"content": message["content"]}, "logprobs": None, "finish_reason": None})
                choices.append({"delta": {}, "logprobs": None, "finish_reason": reason})
            return choices

        def parsed_deltas(delta, index, call):
            """"auto": content as it comes (held where it may open a call), the calls the model wrote whole at the
            end."""
            if index not in streams:
                streams[index] = ToolCallStream(parser, names)
            stream = streams[index]
            content, calls = stream.add(delta.text), []
            if delta.finish_reason:
                rest, calls = stream.finish()
                content += rest
            choices = []
            if content or delta.logprobs:
                choices.append({"delta": {"content": content}, "logprobs": logprobs_of(delta.logprobs, call),
                                "finish_reason": None})
            if calls:
                choices.append(calls_chunk(calls))
            if delta.finish_reason:
                choices.append({"delta": {}, "logprobs": None, "finish_reason": called(delta.finish_reason, calls)})
            return choices

        def calls_chunk(calls):
            return {"delta": {"tool_calls": [{**c, "index": i} for i, c in enumerate(calls)]}, "logprobs": None,
                    "finish_reason": None}

        def called(reason, calls):
            """A reply that ended with calls written finishes with "tool_calls" (one cut by max_tokens: "length")."""
            return "tool_calls" if calls and reason == "stop" else reason

        def tool_message(text, reason):
            """The reply as tool calls when the grammar completed it; cut by max_tokens, as text."""
            if reason == "stop":
                return {"role": "assistant", "content": None, "tool_calls": tools.calls(text)}, "tool_calls"
            if tools.function is not None:
                return {"role": "assistant", "content": None, "tool_calls": [tool_call(tools.function, text)]}, reason
            return {"role": "assistant", "content": text, "tool_calls": []}, reason

        def render_output(output, call):
            if thinker is not None:
                thought, answer = thinker.split(output.text)
                rendered = render_answer(replace(output, text=answer), call)
                if thought is not None:
                    rendered["message"]["reasoning_content"] = thought
                return rendered
            return render_answer(output, call)

        def render_answer(output, call):
            if parser is not None:
                content, calls = parser.parse(output.text, names)
                return {"message": {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})},
                        "logprobs": logprobs_of(output.logprobs or [], call),
                        "finish_reason": called(output.finish_reason, calls)}
            if tools is not None:
                message, reason = tool_message(output.text, output.finish_reason)
                return {"message": message, "logprobs": logprobs_of(output.logprobs or [], call), "finish_reason": reason}
            return {"message": {"role": "assistant", "content": output.text},
                    "logprobs": logprobs_of(output.logprobs or [], call), "finish_reason": output.finish_reason}

        first = {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return await respond(body, http, "chatcmpl", "chat.completion", render_delta, render_output, first)

    return app


@dataclass
class Call:
    """One API call: its id and creation time, n engine requests a prompt (its choices, or best_of's candidates),
    each one's prompt and their shared params, their merged engine stream (engine request `{request_id}-{index}`
    is request `index`), and the outputs as they end."""

    request_id: str
    created: int
    n: int
    prompts: list[list[int]]
    params: SamplingParams
    stream: AsyncIterator | None = None
    outputs: dict[int, RequestOutput] = field(default_factory=dict)

    def engine_id(self, index: int) -> str:
        return f"{self.request_id}-{index}"

    def index(self, engine_id: str) -> int:
        return int(engine_id.rpartition("-")[2])

    def usage(self) -> dict:
        return usage([self.outputs[index] for index in sorted(self.outputs)], self.n)


async def collect(call: Call, http: Request) -> bool:
    """Wait for every choice of a non-streamed call; False (and the requests aborted) if the client left."""
    async def drain():
        async for item in call.stream:
            if isinstance(item, RequestOutput):
                call.outputs[call.index(item.request_id)] = item

    task = asyncio.ensure_future(drain())
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            task.result()
            return True
        if await http.is_disconnected():
            task.cancel()  # the stream's `finally` aborts the unfinished requests
            return False


def answer(respond):
    """respond()'s body, or the OpenAI-style error for the input error it raised."""
    try:
        return respond()
    except MlsysError as error:
        return error_for(error)


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested not in (served, "default"):
        raise ModelNotFound(requested, served)


class ModelNotFound(MlsysError):
    def __init__(self, requested: str, served: str):
        super().__init__(f"model {requested!r} does not exist; this server serves {served!r}")


def error_for(error: MlsysError) -> JSONResponse:
    if isinstance(error, ModelNotFound):
        return error_response(404, str(error), "invalid_request_error", "model", "model_not_found")
    if isinstance(error, QueueFull):
        return error_response(503, str(error), "server_error", None, "queue_full")
    return error_response(400, str(error), "invalid_request_error", getattr(error, "field", None))


def error_response(status: int, message: str, kind: str, param: str | None = None, code: str | None = None):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class ServerThread:
    """uvicorn in a background thread (tests, benchmarks): `with ServerThread(app) as url: ...`."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, name="mlsys-http", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("HTTP server did not start")
            time.sleep(0.02)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
