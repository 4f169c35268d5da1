"""Our tokenizer (HF `tokenizers` on the folder's tokenizer.json, transformers' chat renderer) gives what
transformers' AutoTokenizer gives on the same folder: ids, text, vocabulary, EOS and chat prompts."""

import json
import random

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers, processors

from mlsyslab.errors import InvalidValue
from mlsyslab.nn.pretrained import resolve_folder
from mlsyslab.nn.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = ["", "Hello, world!", "  leading spaces and trailing  ", "naïve café — 東京 🚀🚀", "x = [i**2 for i in range(10)]\n",
         "<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "1234567890 3.14159", "tabs\tand\nnew\r\nlines"]
CHATS = [[{"role": "user", "content": "Why is the sky blue?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello! 👋"}, {"role": "user", "content": "Name a colour."}]]


@pytest.fixture(scope="module")
def pair():
    from transformers import AutoTokenizer

    folder = resolve_folder("default")
    return Tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))


def test_ids_text_vocabulary_and_eos_equal_transformers(pair):
    ours, theirs = pair
    for text in TEXTS:
        assert ours.encode(text) == list(theirs.encode(text)), text
    generator = random.Random(0)
    for _ in range(50):
        ids = [generator.randrange(ours.vocab_size) for _ in range(generator.randrange(1, 12))] + [0, 1, 2]
        generator.shuffle(ids)
        for skip in (True, False):
            assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip), ids
    assert ours.vocab_size == len(theirs)
    assert ours.eos_token_ids == {theirs.eos_token_id}
    assert ours.token_text(2) == theirs.decode([2])
    ids = ours.encode(TEXTS[3])
    assert [ours.token_string(i) for i in ids] == theirs.convert_ids_to_tokens(ids)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_prompts_equal_transformers(pair, add_generation_prompt):
    ours, theirs = pair
    for chat in CHATS:
        expected = theirs.apply_chat_template(chat, tokenize=True, add_generation_prompt=add_generation_prompt)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert ours.chat_ids(chat, add_generation_prompt) == list(expected)


def test_incremental_detokenizer_streams_the_whole_text(pair):
    ours, _ = pair
    ids = ours.encode(TEXTS[3] + " " + TEXTS[4])
    stream = IncrementalDetokenizer(ours, [])
    assert "".join(stream.add(i) for i in ids) == ours.decode(ids)


def test_a_template_kept_in_tokenizer_config_and_named_special_tokens(tmp_path):
    """Older folders keep the template in tokenizer_config.json (here as named templates); the template
    sees the named special tokens, as transformers passes them. A tokenizer that adds BOS itself (as Llama's and
    Mistral's do) adds it to a plain prompt, not again to a chat the template began with one; the ids generation
    stops at include generation_config.json's."""
    from transformers import AutoTokenizer

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hi": 3, "there": 4, "user": 5}
    backend = Backend(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>", "</s>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4]}))
    backend.save(str(tmp_path / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }}{{ eos_token }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>"},
        "unk_token": "[UNK]", "chat_template": [{"name": "default", "template": template}]}))
    ours, theirs = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    chat = [{"role": "user", "content": "hi there"}]
    expected = theirs.apply_chat_template(chat, tokenize=True)
    assert ours.chat_ids(chat, add_generation_prompt=False) == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert ours.chat_ids(chat, add_generation_prompt=False) == [1, 5, 3, 4, 2]
    assert ours.encode("hi there") == list(theirs.encode("hi there")) == [1, 3, 4]
    assert ours.eos_token_ids == {2, 4}


def word_folder(folder, words: list[str], template: str):
    """A tokenizer folder of whole words (ids 2.. in order; 0 unknown, 1 "</s>") with the chat template given."""
    vocab = {word: index for index, word in enumerate(["[UNK]", "</s>", *words])}
    backend = Backend(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              "eos_token": "</s>", "chat_template": template}))


def test_tools_and_earlier_tool_calls_reach_the_template_as_transformers_passes_them(tmp_path):
    """A template that shows the tools (by name) and an assistant's earlier calls: the same ids as transformers'."""
    from transformers import AutoTokenizer

    word_folder(tmp_path, ["tools", "weather", "clock", "user", "hi", "assistant", "calls", "tool", "sunny"],
                "{% if tools %}tools {% for t in tools %}{{ t['function']['name'] }} {% endfor %}{% endif %}"
                "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% if m['tool_calls'] %}calls "
                "{% for c in m['tool_calls'] %}{{ c['function']['name'] }} {% endfor %}{% endif %}{% endfor %}")
    tools = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
             for name in ("weather", "clock")]
    chat = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "weather",
                                                                                                   "arguments": "{}"}}]},
            {"role": "tool", "content": "sunny"}]
    expected = AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(chat, tools=tools, tokenize=True)
    ours = Tokenizer(tmp_path).chat_ids(chat, add_generation_prompt=False, tools=tools)
    assert ours == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert ours[:3] == [2, 3, 4] and 8 in ours


def test_template_kwargs_reach_the_template_as_transformers_passes_them(tmp_path):
    """Qwen3's switch (`enable_thinking`: false writes an empty think block after the generation prompt), passed as
    transformers' apply_chat_template passes extra keywords: the same ids; names the renderer or the special tokens
    use are refused by name."""
    from transformers import AutoTokenizer

    word_folder(tmp_path, ["user", "hi", "assistant", "think", "endthink"],
                "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}"
                "assistant {% if enable_thinking is defined and enable_thinking is false %}think endthink {% endif %}"
                "{% endif %}")
    chat, ours, theirs = [{"role": "user", "content": "hi"}], Tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    for kwargs in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
        expected = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, **kwargs)
        got = ours.chat_ids(chat, template_kwargs=kwargs)
        assert got == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        assert (got[-2:] == [5, 6]) == (kwargs == {"enable_thinking": False})
    for name in ("add_generation_prompt", "tools", "messages", "eos_token", "not a name"):
        with pytest.raises(InvalidValue, match="chat_template_kwargs"):
            ours.chat_ids(chat, template_kwargs={name: False})


def test_refuses_a_folder_without_tokenizer_json_or_a_chat_without_template(tmp_path):
    with pytest.raises(InvalidValue, match="model folder.*tokenizer.json"):
        Tokenizer(tmp_path)
    Backend(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(InvalidValue, match="a model whose tokenizer has a chat template"):
        Tokenizer(tmp_path).chat_ids([{"role": "user", "content": "hi"}])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    with pytest.raises(InvalidValue, match=r"messages\[0\]"):
        Tokenizer(tmp_path).chat_ids([{"role": "user"}])
