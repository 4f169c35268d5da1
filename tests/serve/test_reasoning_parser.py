"""Think blocks read out of replies (serve/reasoning_parser.py): whole, and streamed in any pieces."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlsyslab.serve.reasoning_parser import PARSERS

CASES = [  # parser, reply, (reasoning, answer)
    ("deepseek_r1", "Paris is in France.</think>\n\nParis.", ("Paris is in France.", "\n\nParis.")),
    ("deepseek_r1", "<think>\nhmm</think>Paris.", ("\nhmm", "Paris.")),  # the block opened again: the tag dropped
    ("deepseek_r1", "still thinking, cut by max_tokens", ("still thinking, cut by max_tokens", "")),
    ("deepseek_r1", "</think>Paris.", ("", "Paris.")),
    ("deepseek_r1", "", ("", "")),
    ("deepseek_r1", "a < b and </thin", ("a < b and </thin", "")),  # a tag's start at the end of a whole reply: text
    ("qwen3", "<think>\nThe user asks.\n</think>\n\nParis.", ("\nThe user asks.\n", "\n\nParis.")),
    ("qwen3", "<think>\n\n</think>\n\nParis.", ("\n\n", "\n\nParis.")),
    ("qwen3", "Paris.", (None, "Paris.")),  # no block (enable_thinking false: the template wrote it)
    ("qwen3", "<think>cut", ("cut", "")),
    ("qwen3", "<thin", (None, "<thin")),
    ("qwen3", " <think>x</think>y", (None, " <think>x</think>y")),  # a block not at the start is answer
    ("qwen3", "<think>a</think>b</think>c", ("a", "b</think>c")),  # only the first end closes it
]


@pytest.mark.parametrize("parser, reply, expected", CASES)
def test_replies_split_into_reasoning_and_answer(parser, reply, expected):
    assert PARSERS[parser].split(reply) == expected


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 60), max_size=8))
def test_streamed_in_any_pieces_equals_whole(case, cuts):
    """Pieces as the engine's deltas come (any cut, tags split across them): what goes out adds up to the whole
    split, and no piece shows part of a tag that a later piece completes."""
    parser, reply, (reasoning, answer) = case
    points = sorted({min(cut, len(reply)) for cut in cuts} | {0, len(reply)})
    pieces = [reply[a:b] for a, b in zip(points, points[1:])] or [""]
    stream = PARSERS[parser].stream()
    sent = [stream.add(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    assert "".join(r for r, _ in sent) == (reasoning or "") and "".join(a for _, a in sent) == answer
