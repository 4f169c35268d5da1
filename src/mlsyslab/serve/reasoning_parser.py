"""A reasoning model's think block read out of its reply (`mlsys serve --reasoning-parser`, as vLLM's flag).

Reasoning models write their chain of thought between `<think>` and `</think>` before the answer. The chat API
returns it apart, as `message.reasoning_content` (streamed: `delta.reasoning_content`), the answer as `content` —
DeepSeek's API field, and vLLM's. Two conventions, one parser each (`PARSERS`):
- deepseek_r1 (DeepSeek-R1 and its distills): the chat template opens the block in the prompt, so the reply is
  reasoning up to `</think>` (an opening `<think>` the model writes anyway is dropped), the answer after it; a reply
  without `</think>` (cut by max_tokens) is all reasoning.
- qwen3 (Qwen3, QwQ): the model writes `<think>...</think>` itself, or no block at all (with `enable_thinking: false`
  the template writes an empty one into the prompt): a reply that begins with `<think>` is reasoning up to
  `</think>` (or its end), any other reply all answer.
Streamed (`ReasoningStream`), each piece goes out as it comes, except a tail that may be the start of a tag, which
waits for the next piece; the pieces add up to the whole reply's split (tests/serve/test_reasoning_parser.py).
The answer goes on to the tool-call parser where one reads it (`serve.tool_parser`).
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """opens_in_prompt: the template opened the think block, so the reply starts inside it (deepseek_r1)."""

    opens_in_prompt: bool

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole reply as (reasoning, answer); reasoning None where the reply has no think block."""
        return self.decided(text, final=True)

    def decided(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning, answer) of the reply so far, leaving out what a later piece may still change (`final`: nothing
        comes after). Each grows as `text` does: what was decided stays."""
        if not final and START.startswith(text):  # maybe the opening tag, not yet whole
            return ("" if self.opens_in_prompt else None), ""
        if text.startswith(START):
            text = text[len(START):]
        elif not self.opens_in_prompt:
            return None, text
        end = text.find(END)
        if end >= 0:
            return text[:end], text[end + len(END):]
        return (text if final else text[:len(text) - partial_tag(text, END)]), ""

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (and is not all of it)."""
    return next((n for n in range(min(len(text), len(tag) - 1), 0, -1) if tag.startswith(text[-n:])), 0)


class ReasoningStream:
    """One streamed reply: `add(piece, final)` -> the (reasoning, answer) text decided since the last call."""

    def __init__(self, parser: ReasoningParser):
        self.parser, self.text, self.sent = parser, "", ("", "")

    def add(self, piece: str, final: bool = False) -> tuple[str, str]:
        self.text += piece
        reasoning, answer = self.parser.decided(self.text, final)
        reasoning = reasoning or ""
        new = reasoning[len(self.sent[0]):], answer[len(self.sent[1]):]
        self.sent = reasoning, answer
        return new


PARSERS = {"deepseek_r1": ReasoningParser(opens_in_prompt=True), "qwen3": ReasoningParser(opens_in_prompt=False)}
