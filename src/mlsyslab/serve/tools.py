"""Tool calls on the chat API, by constrained decoding: the model's reply is made to be a call.

OpenAI's `tools` (functions with a JSON schema of their parameters) and `tool_choice`, as vLLM serves them without a
model-specific parser: the tools go to the model's chat template (`tools`, as transformers renders them; a template
that ignores them, as SmolLM2's does, shows the model nothing of them), and the reply is decoded under a grammar
(`serve.grammar`) so that it is a call:
- a named function (`{"type": "function", "function": {"name": ...}}`): the reply is that function's arguments, a JSON
  object matching its parameters' schema;
- "required": the reply is a JSON array of one or more {"name": ..., "parameters": {...}}, each name one of the
  tools' and each parameters object matching that tool's schema (one item if `parallel_tool_calls` is false).
The reply comes back as the message's `tool_calls` (content null, finish_reason "tool_calls"); one cut by
max_tokens comes back as it is, with finish_reason "length". "none" ignores the tools. "auto" (OpenAI's default when
tools are given) lets the model decide, with no grammar: its reply is parsed in its family's call syntax
(`serve.tool_parser`), on a server started with a parser; without one it is a 400, as are the legacy `functions`.
Tested in tests/serve/test_server.py.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from mlsyslab.errors import InvalidValue
from mlsyslab.serve.grammar import StructuredOutput


@dataclass(frozen=True)
class ToolCalls:
    """How a call's replies become tool calls: a named function's arguments, an array of calls ("required"), or
    whatever calls the model chose to write ("auto", parsed afterwards)."""

    function: str | None  # the named function; None: "required" or "auto"
    auto: bool = False

    def structured_output(self, tools: dict[str, dict], parallel: bool) -> StructuredOutput:
        """The grammar of the reply: the named function's parameters, or an array of calls of any tool."""
        if self.function is not None:
            return StructuredOutput("json", json.dumps(tools[self.function]))
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
             "required": ["name", "parameters"], "additionalProperties": False} for name, schema in tools.items()]}}
        if not parallel:
            calls["maxItems"] = 1
        return StructuredOutput("json", json.dumps(calls))

    def calls(self, text: str) -> list[dict]:
        """OpenAI's `tool_calls` of a complete reply."""
        if self.function is not None:
            return [tool_call(self.function, text)]
        return [tool_call(call["name"], json.dumps(call["parameters"])) for call in json.loads(text)]


def tool_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


def resolve(tools: list | None, tool_choice) -> tuple[dict[str, dict], ToolCalls | None]:
    """The tools by name (each its parameters' schema) and how replies become calls (None: no tool call)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidValue("tool_choice", tool_choice, "null or 'none' without tools")
        return {}, None
    schemas = {}
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name or name in schemas:
            raise InvalidValue(f"tools[{index}]", str(tool)[:80], "{'type': 'function', 'function': {'name': a unique "
                               "non-empty string, 'parameters': a JSON schema}}")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise InvalidValue(f"tools[{index}].function.parameters", str(parameters)[:80], "a JSON schema object")
        schemas[name] = parameters
    if tool_choice == "none":
        return schemas, None
    if tool_choice in (None, "auto"):
        return schemas, ToolCalls(None, auto=True)
    if tool_choice == "required":
        return schemas, ToolCalls(None)
    named = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if named not in schemas:
        raise InvalidValue("tool_choice", tool_choice, f"'none', 'auto', 'required' or a named function, one of "
                           f"{sorted(schemas)}")
    return schemas, ToolCalls(named)
