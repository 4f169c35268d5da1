"""GGUF -> a Hugging Face safetensors folder, once; later loads read the folder in about a second.

A GGUF file (llama.cpp's format) holds quantised tensors (here Q4_1, Q8_0), the model's
hyper-parameters and its tokenizer with the chat template. We dequantise every tensor with the
`gguf` package (the same routine transformers uses), undo llama.cpp's Q/K row permutation, and
write an ordinary HF folder: config.json, model.safetensors (HF tensor names) and the tokenizer
files. `nn.hf_loader` then loads it like any HF checkpoint, and so can transformers or vLLM.
Scaled rotary frequencies become config.json's `rope_scaling`: "linear" from the `llama.rope.scaling.*` keys, and
Llama 3.x's "llama3" from the `rope_freqs` tensor llama.cpp writes for it (`llama3_scaling`).
Four architectures (`general.architecture`): "llama", "phi3" (Phi-3: q|k|v as one `attn_qkv` matrix and gate|up as
one `ffn_up`, written as HF's `qkv_proj` / `gate_up_proj`, which `nn.hf_loader` splits; its window from
`attention.sliding_window`; the long-context models' `rope_factors_*` refused), "qwen2" (Qwen2 / Qwen2.5: the same
tensors as llama plus the `attn_q/k/v.bias` vectors) and "qwen3" (plus the `attn_q_norm` / `attn_k_norm` head norms,
and a head size of its own, `attention.key_length`); each one's keys under its own name, and for all but llama no Q/K
permutation: llama.cpp rotates their pairs in HF's own "rotate half" layout (its NEOX rope type), so the converter
leaves the rows as they are.

The Q/K permutation: llama.cpp's converter reorders each head's rows of W_q and W_k from HF's
"rotate half" layout (channel i pairs with i + d/2) to interleaved pairs (2i, 2i+1):
`w.reshape(heads, 2, d/2, hidden).swapaxes(1, 2)`; we apply the inverse
`w.reshape(heads, d/2, 2, hidden).swapaxes(1, 2)` (for W_k with kv_heads).

Cost: dequantising SmolLM2-135M takes a few seconds and writes 538 MB of fp32; the folder is
keyed by the GGUF's name, size and mtime. Tested in tests/nn/test_loaders.py (round trip of the
permutation) and tests/nn/test_llama_vs_hf.py (greedy tokens equal transformers' own GGUF loader).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from mlsyslab.errors import InvalidValue

log = logging.getLogger(__name__)

LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
PHI3_LAYER_NAMES = {**LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def cached_hf_folder(gguf_path: str | Path, cache_dir: str | Path) -> Path:
    """The HF folder converted from `gguf_path` under `cache_dir`, converting it on first use."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise InvalidValue("model", str(gguf_path), "an existing .gguf file")
    stat = gguf_path.stat()
    folder = Path(cache_dir) / f"{gguf_path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (folder / "model.safetensors").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting %s into %s (first use only: later starts load the folder)", gguf_path, folder)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        convert_gguf(gguf_path, staging)
        os.replace(staging, folder)  # atomic: a concurrent or killed conversion never leaves half a folder
    except OSError:
        if not (folder / "model.safetensors").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def convert_gguf(gguf_path: str | Path, folder: str | Path) -> None:
    """Write config.json, model.safetensors and the tokenizer of a llama, phi3, qwen2 or qwen3 GGUF into `folder`."""
    import gguf
    import torch
    from safetensors.torch import save_file

    from mlsyslab.nn.llama import HF_FAMILIES  # here, not at the top: a cached folder's lookup needs no torch

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except ValueError as error:  # gguf's reader on an empty, cut or foreign file: bad magic, short arrays
        raise InvalidValue("model", str(gguf_path), f"a whole GGUF file (gguf cannot read it: {error})") from None
    metadata = {name: field.contents() for name, field in reader.fields.items()
                if not name.startswith("tokenizer.ggml.") or name.endswith("_id")}
    architecture = metadata.get("general.architecture")
    if architecture not in HF_FAMILIES:  # llama.cpp's architecture names are the HF model_types here
        raise InvalidValue("general.architecture", architecture, " or ".join(HF_FAMILIES), f"in {gguf_path}")
    config = hf_config_from_gguf(metadata, architecture)
    tensors = {}
    for tensor in reader.tensors:
        weights = gguf.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        weights = weights.reshape([int(n) for n in reversed(tensor.shape)])
        if tensor.name == "rope_freqs.weight":
            config["rope_scaling"] = llama3_scaling(weights, config)
            continue
        if tensor.name.startswith("rope_factors_"):  # Phi-3's long-context frequencies
            raise InvalidValue("rope_scaling", "longrope", "none, linear or llama3", f"in {gguf_path}")
        if architecture == "llama" and ".attn_q." in tensor.name:
            weights = unpermute_qk(weights, config["num_attention_heads"])
        elif architecture == "llama" and ".attn_k." in tensor.name:
            weights = unpermute_qk(weights, config["num_key_value_heads"])
        tensors[hf_tensor_name(tensor.name, architecture)] = torch.from_numpy(np.require(weights, requirements=["C", "W"]))
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt", "source": Path(gguf_path).name})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if "tokenizer.ggml.tokens" in reader.fields:
        save_tokenizer(Path(gguf_path), folder)


def hf_config_from_gguf(metadata: dict, architecture: str = "llama") -> dict:
    """HF LlamaConfig (or Phi3Config, Qwen2Config, Qwen3Config) fields from GGUF `llama.*` (`phi3.*`, ...) keys."""
    from mlsyslab.nn.llama import HF_FAMILIES

    def key(name, default=None):
        value = metadata.get(f"{architecture}.{name}", default)
        if value is None:
            raise InvalidValue(f"{architecture}.{name}", None, "present in the GGUF metadata")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(metadata.get(f"{architecture}.attention.key_length") or key("rope.dimension_count", hidden // heads))
    config = {
        **HF_FAMILIES[architecture],
        "vocab_size": int(key("vocab_size", None) or len(metadata.get("tokenizer.ggml.tokens", []))),
        "hidden_size": hidden, "num_hidden_layers": int(key("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)), "head_dim": head_dim,
        "intermediate_size": int(key("feed_forward_length")), "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)), "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length", 2048)),
    }
    if metadata.get(f"{architecture}.attention.sliding_window"):  # 0: none
        config["sliding_window"] = int(metadata[f"{architecture}.attention.sliding_window"])
    scaling = metadata.get(f"{architecture}.rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling != "none":
        raise InvalidValue(f"{architecture}.rope.scaling.type", scaling,
                           "none or linear (llama3's comes as a rope_freqs tensor)")
    for token in ("bos", "padding"):
        if f"tokenizer.ggml.{token}_token_id" in metadata:
            config[f"{'pad' if token == 'padding' else token}_token_id"] = int(metadata[f"tokenizer.ggml.{token}_token_id"])
    # every id llama.cpp ends a generation at (its end-of-generation tokens: Llama 3.x Instruct's <|eot_id|> and
    # <|eom_id|> besides EOS), as transformers reads config.json's eos_token_id: one id, or a list
    ends = list(dict.fromkeys(int(metadata[f"tokenizer.ggml.{name}_token_id"]) for name in ("eos", "eot", "eom")
                              if f"tokenizer.ggml.{name}_token_id" in metadata))
    if ends:
        config["eos_token_id"] = ends[0] if len(ends) == 1 else ends
    return config


def llama3_scaling(divisors: np.ndarray, config: dict) -> dict:
    """The `rope_scaling` of a `rope_freqs` tensor: llama.cpp's converter writes Llama 3.x's scaled frequencies as
    each frequency's divisor, from the checkpoint's factor and Meta's low_freq_factor 1, high_freq_factor 4 and
    original context 8192. Read back as those parameters, checked to give the same divisors."""
    from mlsyslab.nn.rope import RopeScaling, base_frequencies

    scaling = RopeScaling("llama3", float(divisors.max()))
    expected = scaling.divisors(base_frequencies(config["head_dim"], config["rope_theta"])).numpy()
    if divisors.shape != expected.shape or not np.allclose(divisors, expected, rtol=1e-5):
        raise InvalidValue("rope_freqs", np.array2string(divisors, precision=3, threshold=8),
                           f"llama3's divisors for factor {scaling.factor:g} (low 1, high 4, original context 8192)")
    return scaling.to_hf()


def hf_tensor_name(gguf_name: str, architecture: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (phi3's `ffn_up` is gate|up)."""
    stem, suffix = gguf_name.rsplit(".", 1)
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        names = PHI3_LAYER_NAMES if architecture == "phi3" else LAYER_NAMES
        if part not in names:
            raise InvalidValue("tensor", gguf_name, ", ".join(names), f"not a {architecture} tensor")
        return f"model.layers.{layer}.{names[part]}.{suffix}"
    if stem not in GLOBAL_NAMES:
        raise InvalidValue("tensor", gguf_name, ", ".join(GLOBAL_NAMES), f"not a {architecture} tensor")
    return f"{GLOBAL_NAMES[stem]}.{suffix}"


def unpermute_qk(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of rotary pairs in W_q / W_k rows."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def permute_qk(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation (HF -> GGUF layout); the inverse of `unpermute_qk`."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, 2, half, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def save_tokenizer(gguf_path: Path, folder: Path) -> None:
    """The GGUF's tokenizer and chat template, saved as HF tokenizer files (transformers reads GGUF)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(folder))
