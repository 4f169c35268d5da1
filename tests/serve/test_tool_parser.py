"""Tool calls read from a reply (tool_choice "auto", the hermes format): whole, and streamed in any pieces."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlsyslab.serve.tool_parser import ToolCallStream, parse

TOOLS = {"get_weather", "get_time"}
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
REPLIES = [
    "The capital of France is Paris.",
    f"<tool_call>\n{WEATHER}\n</tool_call>",
    f"\n\n<tool_call>{WEATHER}</tool_call>",
    f"Let me look.\n<tool_call>{WEATHER}</tool_call>\n<tool_call>" '{"name": "get_time", "arguments": {}}</tool_call>',
    '<tool_call>[{"name": "get_time", "parameters": {"zone": "UTC"}}, ' f"{WEATHER}]</tool_call>",  # SmolLM2's list
    f"<tool_call>{WEATHER}",  # ended (EOS) before the closing tag
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # not JSON
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not one of the tools
    "<tool_call>[]</tool_call>",
    '<tool_call>["get_weather"]</tool_call>',
    '<tool_call>{"name": ["get_weather"], "arguments": {}}</tool_call>',
    "a <toolbox> and a <tool_cal",
    "",
]


def functions(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls]


@pytest.mark.parametrize("reply, content, calls", [
    (REPLIES[0], REPLIES[0], []),
    (REPLIES[1], None, [("get_weather", {"city": "Paris"})]),
    (REPLIES[2], None, [("get_weather", {"city": "Paris"})]),
    (REPLIES[3], "Let me look.\n", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    (REPLIES[4], None, [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Paris"})]),
    (REPLIES[5], None, [("get_weather", {"city": "Paris"})]),
    *[(reply, reply, []) for reply in REPLIES[6:]],
])
def test_a_whole_reply_is_its_calls_or_its_text_unaltered(reply, content, calls):
    found_content, found = parse(reply, TOOLS)
    assert found_content == content and functions(found) == calls
    assert all(call["type"] == "function" and call["id"].startswith("call_") for call in found)


def test_string_arguments_pass_as_they_are():
    (call,) = parse('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>', TOOLS)[1]
    assert call["function"]["arguments"] == '{"zone": "UTC"}'


@settings(max_examples=200, deadline=None)
@given(index=st.integers(0, len(REPLIES) - 1), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_streamed_in_any_pieces_equals_whole(index, cuts):
    """Content streamed plus what `finish` gives is the whole reply's content; the calls are the same."""
    reply = REPLIES[index]
    bounds = sorted({min(cut, len(reply)) for cut in cuts} | {0, len(reply)})
    stream = ToolCallStream(TOOLS)
    sent = "".join(stream.add(reply[a:b]) for a, b in zip(bounds, bounds[1:]))
    rest, calls = stream.finish()
    content, expected = parse(reply, TOOLS)
    assert sent + rest == (content or "") and functions(calls) == functions(expected)


def test_what_may_open_a_tag_is_held_until_it_does_not():
    stream = ToolCallStream(TOOLS)
    assert stream.add("See the <tool") == "See the "
    assert stream.add("box>") == "<toolbox>"
    assert stream.add(" now <tool_call>") == " now "
    assert stream.add(WEATHER) == ""
    assert stream.finish()[0] == ""
