"""Tool calls read from a reply (tool_choice "auto"; the hermes, llama3_json and mistral formats): whole, and streamed
in any pieces."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlsyslab.serve.tool_parser import PARSERS, ToolCallStream

TOOLS = {"get_weather", "get_time"}
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CLOCK = '{"name": "get_time", "parameters": {"zone": "UTC"}}'
PARIS, UTC = ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})
PLAIN = ["The capital of France is Paris.", "a <toolbox> and a <tool_cal", "", "  {not a call} but text"]
# reply -> (content, calls); content None: the reply was calls only
HERMES = {
    f"<tool_call>\n{WEATHER}\n</tool_call>": (None, [PARIS]),
    f"\n\n<tool_call>{WEATHER}</tool_call>": (None, [PARIS]),
    f"Let me look.\n<tool_call>{WEATHER}</tool_call>\n<tool_call>{CLOCK}</tool_call>": ("Let me look.\n", [PARIS, UTC]),
    f"<tool_call>[{CLOCK}, {WEATHER}]</tool_call>": (None, [UTC, PARIS]),  # SmolLM2's list in one tag
    f"<tool_call>{WEATHER}": (None, [PARIS]),  # ended (EOS) before the closing tag
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>': "as text",  # not JSON
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>': "as text",  # not one of the tools
    "<tool_call>[]</tool_call>": "as text",
    '<tool_call>["get_weather"]</tool_call>': "as text",
    '<tool_call>{"name": ["get_weather"], "arguments": {}}</tool_call>': "as text",
    **{reply: "as text" for reply in PLAIN},
}
LLAMA3 = {
    CLOCK: (None, [UTC]),
    f"  {WEATHER}; {CLOCK}": (None, [PARIS, UTC]),
    f"<|python_tag|>{WEATHER}": (None, [PARIS]),
    f"{WEATHER} and then some": "as text",
    '{"name": "get_weather", "parameters": {"city": "Pa': "as text",  # cut by max_tokens
    '{"name": "rm_rf", "parameters": {}}': "as text",
    f"I will call it: {WEATHER}": "as text",  # a call only opens the reply
    "<|python_tag|>print(1)": "as text",
    **{reply: "as text" for reply in PLAIN},
}
MISTRAL = {
    f"[TOOL_CALLS][{WEATHER}, {CLOCK}]": (None, [PARIS, UTC]),
    f" [TOOL_CALLS] [{CLOCK}]": (None, [UTC]),
    f"[{WEATHER}]": (None, [PARIS]),  # the control token dropped from the text
    f"[TOOL_CALLS]{WEATHER}": "as text",  # not a list
    f"[TOOL_CALLS][{WEATHER}": "as text",  # cut by max_tokens
    "[TOOL_CALLS][]": "as text",
    '[TOOL_CALLS][{"name": "rm_rf", "arguments": {}}]': "as text",
    "[1, 2, 3] are numbers": "as text",
    f"Sure. [TOOL_CALLS][{WEATHER}]": "as text",  # calls only open the reply
    **{reply: "as text" for reply in PLAIN},
}
CASES = [(parser, reply, expected) for parser, table in (("hermes", HERMES), ("llama3_json", LLAMA3), ("mistral", MISTRAL))
         for reply, expected in table.items()]


def functions(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls]


@pytest.mark.parametrize("parser, reply, expected", CASES)
def test_a_whole_reply_is_its_calls_or_its_text_unaltered(parser, reply, expected):
    content, calls = PARSERS[parser].parse(reply, TOOLS)
    assert (content, functions(calls)) == ((reply, []) if expected == "as text" else expected)
    assert all(call["type"] == "function" and call["id"].startswith("call_") for call in calls)


def test_string_arguments_pass_as_they_are():
    (call,) = PARSERS["hermes"].parse('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}'
                                      '</tool_call>', TOOLS)[1]
    assert call["function"]["arguments"] == '{"zone": "UTC"}'


@settings(max_examples=300, deadline=None)
@given(index=st.integers(0, len(CASES) - 1), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_streamed_in_any_pieces_equals_whole(index, cuts):
    """Content streamed plus what `finish` gives is the whole reply's content; the calls are the same."""
    parser, reply, _ = CASES[index]
    bounds = sorted({min(cut, len(reply)) for cut in cuts} | {0, len(reply)})
    stream = ToolCallStream(PARSERS[parser], TOOLS)
    sent = "".join(stream.add(reply[a:b]) for a, b in zip(bounds, bounds[1:]))
    rest, calls = stream.finish()
    content, expected = PARSERS[parser].parse(reply, TOOLS)
    assert sent + rest == (content or "") and functions(calls) == functions(expected)


def test_what_may_open_a_call_is_held_until_it_does_not():
    stream = ToolCallStream(PARSERS["hermes"], TOOLS)
    assert stream.add("See the <tool") == "See the "
    assert stream.add("box>") == "<toolbox>"
    assert stream.add(" now <tool_call>") == " now "
    assert stream.add(WEATHER) == ""
    assert stream.finish()[0] == ""
    stream = ToolCallStream(PARSERS["llama3_json"], TOOLS)
    assert stream.add(" <|py") == ""  # whitespace, then maybe the tag
    assert stream.add("thon") == ""
    assert stream.add(" is a language") == " <|python is a language"
    assert stream.add(" {") == " {"  # a call only opens the reply
