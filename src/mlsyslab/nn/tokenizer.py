"""The tokenizer and chat template that ship with the weights, and streaming detokenization.

Read with Hugging Face `tokenizers` from the model folder's tokenizer.json (which `nn.gguf_loader`
writes from the GGUF's own vocabulary, merges and template), with the special tokens and chat
template of tokenizer_config.json / chat_template.jinja, and rendered by transformers' own chat
template renderer — so token ids and the rendered chat prompt are what transformers'
`AutoTokenizer` produces from the same folder (tests/nn/test_tokenizer.py), without its load: here
`AutoTokenizer.from_pretrained` took 1.6 s and its import 1 s, `tokenizers` 0.1 s, on the startup path
of both server processes (`mlsys serve`). The renderer (0.7 s to import) is imported at the first
chat, or ahead of it by `prepare_chat`. `IncrementalDetokenizer` turns a growing list of ids into
text deltas without re-decoding the whole output each step and without emitting half a UTF-8
character (the method of vLLM's detokenizer: decode a short window before and after the read offset
and emit the difference).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

from mlsyslab.errors import InvalidValue


class Tokenizer:
    """Text <-> token ids, the chat template, and the ids that end a generation."""

    def __init__(self, folder: str | Path):
        from tokenizers import Tokenizer as Backend

        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise InvalidValue("model folder", str(folder), "a folder with tokenizer.json (a fast tokenizer; transformers "
                               "writes one: AutoTokenizer.from_pretrained(folder).save_pretrained(folder))")
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.backend = Backend.from_file(str(folder / "tokenizer.json"))
        if config.get("clean_up_tokenization_spaces") and type(self.backend.model).__name__ != "BPE":
            raise InvalidValue("clean_up_tokenization_spaces", True, "false (WordPiece-era clean-up is not implemented)")
        self.special_tokens = special_tokens(config)
        template_file = folder / "chat_template.jinja"
        self.chat_template = template_file.read_text() if template_file.is_file() else default_template(config)
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        eos = self.backend.token_to_id(self.special_tokens["eos_token"]) if "eos_token" in self.special_tokens else None
        self.eos_token_ids = frozenset(i for i in (eos, *generation_eos(folder)) if i is not None)

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, with the special tokens the model's tokenizer adds by default (none for SmolLM2)."""
        return self.backend.encode(encodable(text, "prompt")).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                 template_kwargs: dict | None = None) -> list[int]:
        """The prompt ids of a chat rendered with the model's own template (and the tools, where it shows them).
        template_kwargs: more variables for the template, as transformers' apply_chat_template takes them (Qwen3's
        `enable_thinking`); none may replace the renderer's own arguments or the special tokens."""
        if not self.chat_template:
            raise InvalidValue("messages", "chat", "a model whose tokenizer has a chat template")
        render = self.prepare_chat()
        reserved = {name for name, parameter in inspect.signature(render).parameters.items()  # and `messages`, which
                    if parameter.kind != parameter.VAR_KEYWORD} | {"messages"} | set(self.special_tokens)  # it passes
        for key in template_kwargs or {}:
            if not isinstance(key, str) or not key.isidentifier() or key in reserved:
                raise InvalidValue("chat_template_kwargs", key, "a template variable name other than "
                                   + ", ".join(sorted(reserved)))
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                raise InvalidValue(f"messages[{index}]", message, "{'role': str, 'content': str}")
        rendered, _ = render([messages], tools=tools, chat_template=self.chat_template,
                             add_generation_prompt=add_generation_prompt, **self.special_tokens, **(template_kwargs or {}))
        # the template writes the special tokens it wants (BOS): none added again, as transformers' apply_chat_template
        return self.backend.encode(encodable(rendered[0], "messages"), add_special_tokens=False).ids

    @staticmethod
    def prepare_chat():
        """transformers' chat template renderer (imported once, ~0.7 s: the server does it while the engine loads)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        return render_jinja_template

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (for logprobs)."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def token_string(self, token_id: int) -> str:
        """One token's entry in the vocabulary, as transformers' `convert_ids_to_tokens` gives it (SmolLM2's byte-level
        BPE: "Ġthe" for " the")."""
        return self.backend.id_to_token(token_id)


def encodable(text: str, field: str) -> str:
    """`text`, if it is Unicode a tokenizer can read: JSON's "\\ud800" decodes to a lone surrogate, which is not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidValue(field, text[max(0, error.start - 20):error.end + 20], "text without lone UTF-16 surrogates "
                           "(a \\ud800-\\udfff escape not part of a pair)") from None
    return text


def generation_eos(folder: Path) -> list[int]:
    """The ids transformers' `generate` stops at besides the tokenizer's EOS: generation_config.json's eos_token_id,
    else config.json's (Llama 3.x Instruct lists <|end_of_text|>, <|eom_id|> and <|eot_id|> there)."""
    for name in ("generation_config.json", "config.json"):
        if (folder / name).is_file():
            eos = json.loads((folder / name).read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []


def special_tokens(config: dict) -> dict:
    """The named special tokens of tokenizer_config.json (bos_token, eos_token, ...): what a chat template
    sees besides the messages, as transformers passes its `special_tokens_map`."""
    named = {key: value["content"] if isinstance(value, dict) else value for key, value in config.items()
             if key.endswith("_token") and value is not None}
    return {key: value for key, value in named.items() if isinstance(value, str)}


def default_template(config: dict) -> str | None:
    """The chat template kept inside tokenizer_config.json (older folders): a string, or named templates."""
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((item["template"] for item in template if item.get("name") == "default"), None)
    return template


class IncrementalDetokenizer:
    """Text deltas of a growing id list: O(1) tokens decoded per step, never half a character."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids = list(prompt_ids[-6:])  # a little context so the first token decodes as it would mid-text
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one id and return the new text it completes ('' while a character is incomplete)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        after = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
