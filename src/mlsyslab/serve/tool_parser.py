"""Tool calls the model chose to make (tool_choice "auto"), read from its reply in its family's own syntax.

With "auto" the model decides: it sees the tools through its chat template and either answers or writes calls,
and nothing constrains which. Its reply is parsed afterwards, as vLLM does under `--enable-auto-tool-choice
--tool-call-parser`; `mlsys serve --tool-call-parser hermes` turns it on (without it, "auto" is a 400).

hermes — NousResearch's Hermes 2 Pro format, which Qwen 2.5 / 3 and SmolLM2 / 3 were trained on: each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and SmolLM2's put a JSON list of such calls in one tag
("parameters" is read where "arguments" is missing). The text before the first tag is the message's content (null
when only whitespace). A reply whose tags do not hold such calls of the given tools — JSON that does not parse, a
name not among the tools, a tag cut off by max_tokens — comes back as it is, as content: nothing the model wrote is
dropped or made up.

Streaming (`ToolCallStream`): content goes out as it comes, except a tail that could be the start of a tag; once a
tag opens, the rest waits for the reply's end and the calls come whole. The content streamed is the content the
same reply gets unstreamed. Tested in tests/serve/test_tool_parser.py and, through the server, test_server.py.
"""

from __future__ import annotations

import json
import re

from mlsyslab.serve.tools import tool_call

PARSERS = ("hermes",)
START, END = "<tool_call>", "</tool_call>"
TAGGED = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|\Z)", re.S)


def parse(text: str, tools: set[str]) -> tuple[str | None, list[dict]]:
    """(content, OpenAI `tool_calls`) of a whole reply; the reply as content and no calls if its tags do not
    hold calls of `tools`."""
    start = text.find(START)
    if start < 0:
        return text, []
    calls = []
    for tagged in TAGGED.findall(text, start):
        try:
            found = json.loads(tagged)
        except json.JSONDecodeError:
            return text, []
        for call in found if isinstance(found, list) else [found]:
            if not isinstance(call, dict):
                return text, []
            name, arguments = call.get("name"), call.get("arguments", call.get("parameters", {}))
            if not isinstance(arguments, (dict, str)) or not isinstance(name, str) or name not in tools:
                return text, []
            calls.append(tool_call(name, arguments if isinstance(arguments, str) else json.dumps(arguments)))
    if not calls:
        return text, []
    return (text[:start] if text[:start].strip() else None), calls


class ToolCallStream:
    """One streamed reply: `add` gives the content to send now, `finish` the rest and the calls."""

    def __init__(self, tools: set[str]):
        self.tools = tools
        self.text = ""
        self.sent = 0  # characters of `text` sent as content
        self.in_call = False  # a tag has opened: hold everything until the end

    def add(self, piece: str) -> str:
        self.text += piece
        if self.in_call:
            return ""
        start = self.text.find(START, self.sent)
        if start >= 0:
            self.in_call = True
            end = start if self.text[:start].strip() else self.sent  # whitespace alone before a call is not content
        else:
            end = len(self.text) - held_back(self.text)
            end = end if self.text[:end].strip() else self.sent  # whitespace alone may yet precede a call
        release, self.sent = self.text[self.sent:end], max(self.sent, end)
        return release

    def finish(self) -> tuple[str, list[dict]]:
        """The content not yet sent, and the calls (none: the rest of the reply is content)."""
        _, calls = parse(self.text, self.tools)
        return ("" if calls else self.text[self.sent:]), calls


def held_back(text: str) -> int:
    """Characters at the end of `text` that may begin a tag (sent once the next token shows they do not)."""
    return next((size for size in range(min(len(START) - 1, len(text)), 0, -1) if START.startswith(text[-size:])), 0)
