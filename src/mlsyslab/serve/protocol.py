"""The OpenAI API's request and response shapes, and their translation to and from the engine's.

Requests are pydantic models that accept the fields the official `openai` client sends (unknown
ones are ignored, as OpenAI-compatible servers do); fields we cannot honour (suffix, functions) are rejected
with a 400 that names them rather than silently ignored. Tools with a named tool_choice or "required" are calls
decoded under a grammar (`serve.tools`); with "auto", calls the model chose to write (`serve.tool_parser`).
Extensions shared with vLLM: top_k, min_p, min_tokens, repetition_penalty, ignore_eos, stop_token_ids,
skip_special_tokens (false: the reply's text shows its special tokens), `structured_outputs`, and for chat
`chat_template_kwargs` (more variables for the model's chat template: Qwen3's {"enable_thinking": false}) and
`add_generation_prompt` (false: the template does not open the assistant's turn).

vLLM's /tokenize and /detokenize (`TokenizeRequest`, `DetokenizeRequest`): the ids the server would run for a
completions `prompt` or a chat's `messages` (the same template, tools and variables), to count a prompt's tokens
before sending it; and the text of a list of ids.

Structured outputs (`serve.grammar`), on both endpoints: OpenAI's `response_format` — {"type": "json_object"}
or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}} — or vLLM's `structured_outputs` with
one of "json" (a schema), "regex", "choice" (a list of strings), "grammar" (EBNF) or "json_object": true. A
grammar that does not compile is a 400 naming the field the request used.

One call may ask for several choices: `n` per prompt, and for completions a list of prompts (strings or
token-id lists). Each choice is one engine request; prompt i's choice j has index i·n + j, and with a
seed it samples with seed + j (as vLLM's parallel sampling does), so the choices differ and each is
reproducible alone. The prefix cache shares a prompt's blocks between its choices once the first has
prefilled them. Usage counts each prompt once and every choice's completion.

`best_of` (completions): each prompt gets best_of candidates (as n choices would be drawn), and the n with the
highest log-probability per token — the mean of each sampled token's log-softmax under the raw logits, OpenAI's
rule — come back, best first (`best_choices`). Usage counts every candidate's tokens, as OpenAI bills them; the
candidates cannot stream (a 400, as OpenAI's).

`echo` (completions) puts the prompt before each completion; with `logprobs` every prompt token after the
first is scored too (the engine's `prompt_logprobs`), and `max_tokens: 0` scores the prompt without
generating — the way evaluation harnesses (lm-evaluation-harness's `local-completions`) ask a served model
for log-likelihoods.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from mlsyslab.errors import InvalidValue
from mlsyslab.nn.tokenizer import Tokenizer
from mlsyslab.serve.grammar import KINDS, StructuredOutput
from mlsyslab.serve.output import RequestOutput
from mlsyslab.serve.sampling_params import MAX_TOP_LOGPROBS, Sampled, SamplingParams
from mlsyslab.serve.tools import ToolCalls, resolve

MAX_CHOICES = 128  # OpenAI's bound on n
ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's chat roles
Choice = tuple[list[int], SamplingParams]  # one engine request: prompt ids, sampling params


class StreamOptions(BaseModel):
    include_usage: bool = False


class CommonRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # strict: true is not 1, "3" not 3, 2.5 not 2

    model: str | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None
    structured_outputs: dict | None = None

    @property
    def candidates(self) -> int:
        """Engine requests a prompt: its n choices (best_of's candidates on the completions API)."""
        return self.n

    @property
    def ranked(self) -> bool:
        """Whether the choices returned are the best n of more candidates (best_of)."""
        return self.candidates > self.n

    def choices(self, prompts: list[list[int]], max_tokens: int, logprobs: int | None,
                prompt_logprobs: int | None = None) -> list[Choice]:
        """Every prompt's candidates in index order (prompt i's j-th at i·candidates + j; with a seed, seed + j)."""
        if not 1 <= self.n <= MAX_CHOICES:
            raise InvalidValue("n", self.n, f"an integer in 1..{MAX_CHOICES}")
        params = self.sampling_params(max_tokens, logprobs, prompt_logprobs)
        each = [params if params.seed is None else replace(params, seed=params.seed + j) for j in range(self.candidates)]
        return [(prompt, choice) for prompt in prompts for choice in each]

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        options = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                                          "frequency_penalty", "repetition_penalty", "min_tokens")
                   if getattr(self, name) is not None}
        return SamplingParams(max_tokens=max_tokens, seed=self.seed, logit_bias=self.bias(),
                              stop=tuple(as_list(self.stop)), stop_token_ids=tuple(self.stop_token_ids or ()),
                              ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              structured_output=self.structured_output(), **options)

    @property
    def structured_field(self) -> str:
        """The API field that asked for a structured output (what a grammar error names)."""
        return "structured_outputs" if self.structured_outputs else "response_format"

    def structured_output(self) -> StructuredOutput | None:
        """OpenAI's response_format or vLLM's structured_outputs, as the engine's `StructuredOutput` (or None)."""
        if self.response_format not in (None, {"type": "text"}) and self.structured_outputs:
            raise InvalidValue("structured_outputs", self.structured_outputs, "null when response_format is given")
        if self.structured_outputs:
            asked = {key: value for key, value in self.structured_outputs.items() if value not in (None, False)}
            if len(asked) != 1 or next(iter(asked)) not in KINDS:
                raise InvalidValue("structured_outputs", self.structured_outputs, f"one of {', '.join(KINDS)}")
            ((kind, spec),) = asked.items()
        else:
            kind, spec = self.response_format_kind()
            if kind is None:
                return None
        try:
            if kind == "choice":
                return StructuredOutput.choice(spec)
            text = spec if isinstance(spec, str) or kind == "json_object" else json.dumps(spec)
            return StructuredOutput(kind, "" if kind == "json_object" else text)
        except InvalidValue as error:
            raise InvalidValue(self.structured_field, error.value, error.valid) from None

    def response_format_kind(self) -> tuple[str | None, object]:
        """response_format as (kind, spec): text -> (None, None), json_object, json_schema -> ("json", schema)."""
        shape = "{'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', 'json_schema': {'schema': {...}}}"
        form = self.response_format
        if form is None or form.get("type") == "text":
            return None, None
        if form.get("type") == "json_object":
            return "json_object", None
        schema = (form.get("json_schema") or {}).get("schema") if form.get("type") == "json_schema" else None
        if not isinstance(schema, dict):
            raise InvalidValue("response_format", form, shape)
        return "json", schema

    def bias(self) -> tuple[tuple[int, float], ...]:
        """logit_bias's {"token id": bias} as (id, bias) pairs."""
        pairs = {}
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()) or int(key) in pairs:
                raise InvalidValue("logit_bias", key, "token ids as strings of the digits 0-9, each once, each with a "
                                   "bias in [-100, 100]")
            pairs[int(key)] = value
        return tuple(pairs.items())


class CompletionRequest(CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @property
    def candidates(self) -> int:
        return self.n if self.best_of is None else self.best_of

    def to_engine(self, tokenizer: Tokenizer, max_seq: int, capacity: int) -> list[Choice]:
        """The call's candidates; max_tokens defaults to 16 as in OpenAI's legacy API (0: echo's scoring only).
        Ranked candidates report their sampled tokens' log-probabilities (the ranking's score) whether asked or not."""
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        if max_tokens == 0 and not (self.echo and self.logprobs is not None):
            raise InvalidValue("max_tokens", 0, "an integer >= 1 (0 only with echo and logprobs: score the prompt)")
        if self.best_of is not None and not self.n <= self.best_of <= MAX_CHOICES:
            raise InvalidValue("best_of", self.best_of, f"null or an integer in n ({self.n})..{MAX_CHOICES}")
        if self.ranked and self.stream:
            raise InvalidValue("best_of", self.best_of, f"null or n ({self.n}) when streaming (candidates cannot stream)")
        logprobs = 0 if self.ranked and self.logprobs is None else self.logprobs
        return self.choices(self.prompt_ids(tokenizer), max_tokens, logprobs, self.logprobs if self.echo else None)

    def prompt_ids(self, tokenizer: Tokenizer) -> list[list[int]]:
        """Each prompt's token ids: one string or id list, or a list of them."""
        if self.suffix:
            raise InvalidValue("suffix", self.suffix[:40], "null (insertion is not supported)")
        prompt = self.prompt
        if not prompt:
            raise InvalidValue("prompt", prompt, "a string, token ids, or a non-empty list of either")
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            prompt = [prompt]
        return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]


class ChatRequest(CommonRequest):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    functions: list | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    def tool_calls(self) -> tuple[dict[str, dict], ToolCalls | None]:
        """The tools' parameter schemas by name, and how replies become calls (None: replies are text)."""
        return resolve(self.tools, self.tool_choice)

    @property
    def structured_field(self) -> str:
        calls = self.tool_calls()[1]
        return "tools" if calls is not None and not calls.auto else super().structured_field

    def structured_output(self) -> StructuredOutput | None:
        """A tool call's grammar where tool_choice asks for one, else response_format's or structured_outputs'."""
        schemas, calls = self.tool_calls()
        if calls is None or calls.auto:
            return super().structured_output()
        if self.response_format not in (None, {"type": "text"}) or self.structured_outputs:
            raise InvalidValue("tool_choice", self.tool_choice, "'none' beside response_format or structured_outputs")
        return calls.structured_output(schemas, self.parallel_tool_calls)

    def to_engine(self, tokenizer: Tokenizer, max_seq: int, capacity: int) -> list[Choice]:
        """The call's n choices; max_tokens defaults to what is left of the context."""
        prompt_ids = self.prompt_ids(tokenizer)
        if len(prompt_ids) >= max_seq:
            raise InvalidValue("messages", f"{len(prompt_ids)} tokens", f"< the context length {max_seq}")
        for name in ("max_completion_tokens", "max_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InvalidValue(name, getattr(self, name), "null or an integer >= 1")
        wanted = next((limit for limit in (self.max_completion_tokens, self.max_tokens) if limit is not None),
                      min(max_seq, capacity) - len(prompt_ids))
        top = self.top_logprobs or 0
        if top and not self.logprobs:
            raise InvalidValue("top_logprobs", top, "null unless logprobs is true")
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidValue("top_logprobs", top, f"null or an integer in 0..{MAX_TOP_LOGPROBS}")
        return self.choices([prompt_ids], wanted, top if self.logprobs else None)

    def prompt_ids(self, tokenizer: Tokenizer) -> list[int]:
        if self.functions:
            raise InvalidValue("functions", "...", "null (the legacy functions API; use tools)")
        self.tool_calls()
        messages = [chat_message(m, index) for index, m in enumerate(self.messages)]
        if not messages:
            raise InvalidValue("messages", [], "at least one message")
        return tokenizer.chat_ids(messages, self.add_generation_prompt, self.tools or None, self.chat_template_kwargs)


class TokenizeRequest(BaseModel):
    """POST /tokenize: a completions `prompt` (a string) or a chat's `messages` (with its tools and template
    variables), tokenized as the serving endpoints tokenize them."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def prompt_ids(self, tokenizer: Tokenizer) -> list[int]:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidValue("prompt", "both" if self.prompt is not None else None,
                               "exactly one of prompt (a completions prompt, a string) and messages (a chat)")
        if self.prompt is not None:
            return tokenizer.encode(self.prompt)
        chat = ChatRequest(messages=self.messages, tools=self.tools, chat_template_kwargs=self.chat_template_kwargs,
                           add_generation_prompt=self.add_generation_prompt)
        return chat.prompt_ids(tokenizer)

    def response(self, tokenizer: Tokenizer, max_seq: int) -> dict:
        ids = self.prompt_ids(tokenizer)
        strings = [tokenizer.token_string(i) for i in ids] if self.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_seq, "tokens": ids, "token_strs": strings}


class DetokenizeRequest(BaseModel):
    """POST /detokenize: the text of `tokens`, special tokens included (as transformers' `decode` gives it)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[int]

    def response(self, tokenizer: Tokenizer) -> dict:
        vocab = tokenizer.vocab_size
        outside = next((token for token in self.tokens if not 0 <= token < vocab), None)
        if outside is not None:
            raise InvalidValue("tokens", outside, f"token ids in 0..{vocab - 1}")
        return {"prompt": tokenizer.decode(self.tokens, skip_special_tokens=False)}


def chat_message(message: dict, index: int) -> dict:
    """A message as the chat template sees it: role and text content, and an assistant's earlier `tool_calls` or a
    tool result's `tool_call_id` as sent (an assistant message that only called tools has content null: "")."""
    if message.get("role") not in ROLES:
        raise InvalidValue(f"messages[{index}].role", message.get("role"), f"one of {', '.join(ROLES)}")
    calls = message.get("tool_calls")
    content = "" if message.get("content") is None and calls else text_content(message.get("content"), index)
    extra = {key: message[key] for key in ("tool_calls", "tool_call_id", "name") if message.get(key) is not None}
    return {"role": message.get("role"), "content": content, **extra}


def text_content(content, index: int) -> str:
    """A message's content: a string, or OpenAI's list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        return "".join(p["text"] for p in content)
    raise InvalidValue(f"messages[{index}].content", str(content)[:40],
                       "a string or a list of text parts ({'type': 'text', 'text': a string})")


def as_list(stop) -> list[str]:
    return [] if stop is None else [stop] if isinstance(stop, str) else list(stop)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def best_choices(outputs: list[RequestOutput], candidates: int, n: int) -> list[RequestOutput]:
    """Each prompt's n best of its `candidates` outputs (outputs in index order), by log-probability per token,
    best first (ties in index order)."""
    def per_token(output: RequestOutput) -> float:
        return sum(s.logprob for s in output.logprobs) / max(1, len(output.logprobs))

    return [best for start in range(0, len(outputs), candidates)
            for best in sorted(outputs[start:start + candidates], key=per_token, reverse=True)[:n]]


def usage(outputs: list[RequestOutput], n: int) -> dict:
    """Token counts of one call's outputs (in index order, n a prompt): each prompt counted once."""
    firsts = outputs[::n]
    prompt, completion = sum(len(o.prompt_ids) for o in firsts), sum(len(o.output_ids) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.cached_prompt_tokens for o in firsts)}}


def completion_logprobs(tokenizer: Tokenizer, sampled: list[Sampled], text_offset: int = 0) -> dict:
    """The legacy completions `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset (an echoed
    prompt's first token has no log-probability: null, as OpenAI gives it)."""
    tokens = [tokenizer.token_text(s.token) for s in sampled]
    offsets, position = [], text_offset
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {"tokens": tokens, "token_logprobs": [s.logprob for s in sampled],
            "top_logprobs": [None if s.top is None else {tokenizer.token_text(t): lp for t, lp in s.top}
                             for s in sampled],
            "text_offset": offsets}


def echoed(prompt_ids: list[int], prompt_logprobs: list[Sampled | None] | None) -> list[Sampled]:
    """An echoed prompt's tokens as `Sampled` rows: the first unscored, the rest as the engine scored them."""
    if prompt_logprobs is None:
        return [Sampled(token) for token in prompt_ids]
    return [Sampled(prompt_ids[0])] + prompt_logprobs[1:]


def chat_logprobs(tokenizer: Tokenizer, sampled: list[Sampled]) -> dict:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(s.token, s.logprob), "top_logprobs": [entry(t, lp) for t, lp in s.top]}
                        for s in sampled]}


def envelope(kind: Literal["text_completion", "chat.completion", "chat.completion.chunk"], request_id: str,
             model: str, created: int, choices: list[dict]) -> dict:
    """A response or stream chunk around its choices (each with its "index")."""
    return {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices}
