"""Tool calls the model chose to make (tool_choice "auto"), read from its reply in its family's own syntax.

With "auto" the model decides: it sees the tools through its chat template and either answers or writes calls,
and nothing constrains which. Its reply is parsed afterwards, as vLLM does under `--enable-auto-tool-choice
--tool-call-parser`; `mlsys serve --tool-call-parser NAME` turns it on (without it, "auto" is a 400). Three syntaxes:
- hermes — NousResearch's Hermes 2 Pro format, which Qwen 2.5 / 3 and SmolLM2 / 3 were trained on: each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and SmolLM2's put a JSON list of such calls in one
  tag. The text before the first tag is the message's content (null when only whitespace).
- llama3_json — Meta's Llama 3.1 / 3.2 / 3.3 JSON tool calling: the reply is the call itself,
  `{"name": ..., "parameters": {...}}` (several separated by ";"), maybe after `<|python_tag|>`; content null.
- mistral — Mistral's (7B v0.3, Nemo, Small): the reply is `[TOOL_CALLS]` and a JSON list of calls; content null.
Either reads "parameters" where "arguments" is missing. A reply that does not hold such calls of the given tools —
JSON that does not parse, a name not among the tools, a call cut off by max_tokens — comes back as it is, as content:
nothing the model wrote is dropped or made up.

Streaming (`ToolCallStream`): content goes out as it comes, except a tail that could be the start of a call; once a
call starts, the rest waits for the reply's end and the calls come whole. The content streamed is the content the
same reply gets unstreamed. Tested in tests/serve/test_tool_parser.py and, through the server, test_server.py.
"""

from __future__ import annotations

import json
import re

from mlsyslab.serve.tools import tool_call


def openai_call(call, tools: set[str]) -> dict | None:
    """A parsed {"name", "arguments" or "parameters"} as OpenAI's tool call; None unless it calls one of `tools`."""
    if not isinstance(call, dict):
        return None
    name, arguments = call.get("name"), call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, (dict, str)) or not isinstance(name, str) or name not in tools:
        return None
    return tool_call(name, arguments if isinstance(arguments, str) else json.dumps(arguments))


def may_begin(marker: str, text: str) -> int:
    """Characters at the end of `text` that may begin `marker` (sent once the next token shows they do not)."""
    return next((size for size in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-size:])), 0)


class Hermes:
    """`<tool_call>{...}</tool_call>` tags, anywhere after the content."""

    START, END = "<tool_call>", "</tool_call>"
    TAGGED = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|\Z)", re.S)

    def parse(self, text: str, tools: set[str]) -> tuple[str | None, list[dict]]:
        """(content, OpenAI `tool_calls`) of a whole reply; the reply as content and no calls if its tags do not
        hold calls of `tools`."""
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for tagged in self.TAGGED.findall(text, start):
            try:
                found = json.loads(tagged)
            except json.JSONDecodeError:
                return text, []
            for call in found if isinstance(found, list) else [found]:
                calls.append(openai_call(call, tools))
        if not calls or None in calls:
            return text, []
        return (text[:start] if text[:start].strip() else None), calls

    def call_start(self, text: str, sent: int) -> int | None:
        """Where a call begins in `text` past the `sent` characters (None: not yet)."""
        start = text.find(self.START, sent)
        return None if start < 0 else start

    def held_back(self, text: str) -> int:
        return may_begin(self.START, text)


class Llama3Json:
    """The whole reply is the calls: JSON objects separated by ";", maybe after `<|python_tag|>`."""

    TAG, OPEN = "<|python_tag|>", "{"

    def parse(self, text: str, tools: set[str]) -> tuple[str | None, list[dict]]:
        body = text.strip().removeprefix(self.TAG).lstrip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                call, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return text, []
            calls.append(openai_call(call, tools))
            while at < len(body) and (body[at].isspace() or body[at] == ";"):
                at += 1
        return (None, calls) if None not in calls else (text, [])

    def call_start(self, text: str, sent: int) -> int | None:
        """A call only opens the reply: its first characters past whitespace, once they show it."""
        body = text.lstrip()
        return len(text) - len(body) if sent == 0 and body.startswith((self.OPEN, self.TAG)) else None

    def held_back(self, text: str) -> int:
        return len(text) if self.TAG.startswith(text.lstrip()) else 0  # nothing yet, or part of the tag


class Mistral(Llama3Json):
    """The whole reply is a JSON list of calls after `[TOOL_CALLS]` (a control token: dropped from the text unless
    skip_special_tokens is false, so the list alone is read too); where a call may start, as llama3_json's."""

    TAG, OPEN = "[TOOL_CALLS]", "["

    def parse(self, text: str, tools: set[str]) -> tuple[str | None, list[dict]]:
        body = text.strip().removeprefix(self.TAG).lstrip()
        try:
            found = json.loads(body) if body.startswith("[") else None
        except json.JSONDecodeError:
            found = None
        calls = [openai_call(call, tools) for call in found] if isinstance(found, list) else []
        return (None, calls) if calls and None not in calls else (text, [])


PARSERS = {"hermes": Hermes(), "llama3_json": Llama3Json(), "mistral": Mistral()}


class ToolCallStream:
    """One streamed reply: `add` gives the content to send now, `finish` the rest and the calls."""

    def __init__(self, parser, tools: set[str]):
        self.parser, self.tools = parser, tools
        self.text = ""
        self.sent = 0  # characters of `text` sent as content
        self.in_call = False  # a call has begun: hold everything until the end

    def add(self, piece: str) -> str:
        self.text += piece
        if self.in_call:
            return ""
        start = self.parser.call_start(self.text, self.sent)
        if start is not None:
            self.in_call = True
            end = start if self.text[:start].strip() else self.sent  # whitespace alone before a call is not content
        else:
            end = len(self.text) - self.parser.held_back(self.text)
            end = end if self.text[:end].strip() else self.sent  # whitespace alone may yet precede a call
        release, self.sent = self.text[self.sent:end], max(self.sent, end)
        return release

    def finish(self) -> tuple[str, list[dict]]:
        """The content not yet sent, and the calls (none: the rest of the reply is content)."""
        _, calls = self.parser.parse(self.text, self.tools)
        return ("" if calls else self.text[self.sent:]), calls
