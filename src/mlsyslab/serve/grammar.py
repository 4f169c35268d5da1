"""Constrained decoding: every token a request draws keeps its output inside a grammar.

A request may ask for structured output (`StructuredOutput`): text matching a JSON schema, any JSON object, a
regular expression, one of a fixed set of strings, or an EBNF grammar. The grammar is compiled once against the
tokenizer's vocabulary by xgrammar (Dong et al. 2024, "XGrammar: flexible and efficient structured generation
engine for large language models": a pushdown automaton whose per-state token masks are mostly precomputed, so a
step's mask costs microseconds, not a pass over the 49k tokens). Each request keeps a `GrammarMatcher`, the
automaton's state; before each draw, the tokens the grammar forbids get a logit of -inf (`constrain`, after the
penalties, before temperature and the filters: `serve.sampling`), and the token drawn advances the matcher
(`Engine.deliver`). The end-of-sequence token is allowed only where the grammar may end, so an output that stops
on it is complete; one cut by max_tokens or a stop string is a prefix of a valid one (finish_reason "length" or
"stop"), as in OpenAI's and vLLM's structured outputs.

Log-probabilities stay those of the model's raw distribution (the mask changes what is drawn, not what is
reported), as vLLM reports them. A preempted request keeps its matcher: its recomputed prefill draws nothing.
JSON is produced without free whitespace (xgrammar's `any_whitespace=False`: ", " and ": " separators), so a small
model cannot wander into endless blank space; a schema's properties come in its order.

With speculative decoding on (`serve.speculative`), a constrained request's draft is the text its grammar forces next
(`grammar_draft`: SGLang's jump-forward decoding, here verified by the model in the same step rather than appended
unseen, so the tokens stay the model's), and each verified position is masked by the grammar's state there
(`constrain_draft`).

Cost: the first constrained request of a process imports xgrammar (~1-2 s here) and reads the vocabulary (~0.2 s);
each new grammar is compiled in the engine's loop (milliseconds for the schemas of tests/serve/test_grammar.py) and
kept (`Grammars.compiled`, up to `CACHED_GRAMMARS`); a constrained row is sampled off the fused multi-step path.
Tested in tests/serve/test_grammar.py (against the training path with the same mask, batch 1 and mixed, through
preemption) and tests/nn/test_llama_vs_hf.py (the real model against transformers' `generate` with xgrammar's
own logits processor).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlsyslab.errors import InvalidValue
from mlsyslab.nn.tokenizer import Tokenizer

if TYPE_CHECKING:  # StructuredOutput is read by the server's HTTP process, which imports no torch
    import torch

KINDS = ("json", "json_object", "regex", "choice", "grammar")
CACHED_GRAMMARS = 64


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match. `spec` by kind: "json" a JSON schema (as JSON text), "json_object" unused (any
    JSON object), "regex" a pattern, "choice" a JSON list of the allowed strings, "grammar" EBNF (GBNF) text with a
    `root` rule. The names are vLLM's `structured_outputs` fields."""

    kind: str
    spec: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidValue("structured_output", self.kind, f"one of {', '.join(KINDS)}")
        if not isinstance(self.spec, str) or (not self.spec and self.kind != "json_object"):
            raise InvalidValue(f"structured_output.{self.kind}", self.spec, "a non-empty string")

    @classmethod
    def choice(cls, options: list[str]) -> StructuredOutput:
        if not isinstance(options, (list, tuple)) or not options or not all(isinstance(o, str) and o for o in options):
            raise InvalidValue("structured_output.choice", options, "a non-empty list of non-empty strings")
        return cls("choice", json.dumps(options, ensure_ascii=False))


class Grammars:
    """The compiled grammars of one engine's tokenizer and vocabulary, and a matcher per constrained request."""

    def __init__(self, tokenizer: Tokenizer | None, vocab: int):
        self.tokenizer, self.vocab = tokenizer, vocab
        self.compiler = None
        self.compiled: OrderedDict[StructuredOutput, object] = OrderedDict()

    def matcher(self, structured: StructuredOutput):
        """A fresh matcher of the request's grammar (compiled here the first time; InvalidValue if it does not
        compile, before the request is queued)."""
        import xgrammar

        return xgrammar.GrammarMatcher(self.compile(structured))

    def compile(self, structured: StructuredOutput):
        if structured in self.compiled:
            self.compiled.move_to_end(structured)
            return self.compiled[structured]
        compiler = self.compiler or self.new_compiler()
        try:
            if structured.kind == "json":
                compiled = compiler.compile_json_schema(structured.spec, any_whitespace=False)
            elif structured.kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif structured.kind == "regex":
                compiled = compiler.compile_regex(structured.spec)
            elif structured.kind == "choice":
                options = json.loads(structured.spec)
                compiled = compiler.compile_grammar("root ::= " + " | ".join(json.dumps(o, ensure_ascii=False)
                                                                             for o in options))
            else:
                compiled = compiler.compile_grammar(structured.spec)
        except RuntimeError as error:  # xgrammar's parse errors: the last line says what and where
            reason = str(error).strip().splitlines()[-1]
            reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", reason)  # its log prefix: "[08:09:42] /project/x.cc:4944: "
            raise InvalidValue(f"structured_output.{structured.kind}", structured.spec[:80],
                               f"a valid {structured.kind} ({reason[:200]})") from None
        self.compiled[structured] = compiled
        if len(self.compiled) > CACHED_GRAMMARS:
            self.compiled.popitem(last=False)
        return compiled

    def new_compiler(self):
        """xgrammar's compiler over this tokenizer's vocabulary, read the way xgrammar reads a transformers fast
        tokenizer (the vocabulary's encoding and prefix-space rule detected from the tokenizer itself), padded to
        the model's vocabulary (ids past the tokenizer's are never allowed)."""
        if self.tokenizer is None:
            raise InvalidValue("structured_output", "...", "none (this engine has no tokenizer to match text)")
        import torch
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        info = xgrammar.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend),
                                                       vocab_size=self.vocab,
                                                       stop_token_ids=sorted(self.tokenizer.eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=max(1, torch.get_num_threads()))
        return self.compiler


def constrain(logits: torch.Tensor, matchers: dict[int, object]) -> None:
    """In place on fp32 logits [N, vocab]: -inf for every token row i's matcher forbids next, for the rows in
    `matchers`. One masking call for them all: xgrammar's costs ~75 µs whatever the rows (filling a row's mask ~2).
    """
    if not matchers:
        return
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(logits), logits.shape[-1])
    for row, matcher in matchers.items():
        matcher.fill_next_token_bitmask(bitmask, row)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=list(matchers))


def grammar_draft(matcher, tokenizer: Tokenizer, guess: list[int], most: int) -> list[int]:
    """A speculative draft for a constrained request (`serve.speculative`): the tokens of the string the grammar
    forces next (xgrammar's jump-forward string: a JSON schema's keys and punctuation), or else the n-gram `guess`;
    either cut to its longest prefix the grammar accepts, at most `most` tokens. The matcher is left as it was."""
    forced = matcher.find_jump_forward_string()
    tokens = tokenizer.encode(forced)[:most] if forced else guess[:most]
    trial, kept = matcher.fork(), 0
    while kept < len(tokens) and trial.accept_token(tokens[kept]):
        kept += 1
    return tokens[:kept]


def constrain_draft(logits: torch.Tensor, matcher, draft: list[int]) -> None:
    """In place on fp32 logits [len(draft) + 1, vocab] of a speculative step: row i masked by the grammar's state after
    the draft's first i tokens (the state each position would have without speculation). The matcher is left as it
    was."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(logits), logits.shape[-1])
    trial = matcher.fork()
    for row in range(len(logits)):
        trial.fill_next_token_bitmask(bitmask, row)
        if row < len(draft):
            trial.accept_token(draft[row])
    xgrammar.apply_token_bitmask_inplace(logits, bitmask)
