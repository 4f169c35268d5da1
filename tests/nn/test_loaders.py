"""GGUF conversion (names, llama.cpp's Q/K permutation, the cache) and the real model's files."""

import logging
import time
from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch

from mlsyslab.errors import InvalidValue
from mlsyslab.nn.gguf_loader import (
    cached_hf_folder,
    hf_tensor_name,
    permute_qk,
    unpermute_qk,
)
from mlsyslab.nn.hf_loader import load_hf_folder
from mlsyslab.nn.llama import Llama, LlamaConfig
from mlsyslab.nn.pretrained import load_pretrained, resolve_folder
from mlsyslab.nn.rope import RopeScaling, base_frequencies
from tests.nn.hf_logits import assert_as_exact_as_hf

CONFIG = LlamaConfig(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, ffn_hidden=48,
                     rope_theta=50000.0, rms_norm_eps=1e-5, tied_embeddings=False, max_seq=128)
GGUF_NAMES = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}
LAYER_PARTS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def write_llama_gguf(model: Llama, path, rope_freqs: np.ndarray | None = None, end_ids: dict | None = None,
                     phi3: bool = False, extra: dict[str, np.ndarray] | None = None):
    """A GGUF as llama.cpp's converter writes one: its names, Q/K rows permuted, fp32 tensors (and Llama 3.x's
    scaled frequencies as `rope_freqs`, or a linear scaling as keys; special token ids as `end_ids` names them).
    A model with q/k/v biases is written as Qwen2's: architecture "qwen2", the biases, no permutation; one with head
    norms as Qwen3's (and its head size as `attention.key_length`); with `phi3`, as Phi-3's: q|k|v as one `attn_qkv`
    and gate|up as one `ffn_up`, no permutation. `extra`: more tensors, by GGUF name."""
    config = model.config
    architecture = "phi3" if phi3 else "qwen3" if config.qk_norm else "qwen2" if config.qkv_bias else "llama"
    writer = gguf.GGUFWriter(str(path), architecture)
    if config.rope_scaling is not None and config.rope_scaling.rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_scaling.factor)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.add_block_count(config.layers)
    writer.add_context_length(config.max_seq)
    writer.add_embedding_length(config.hidden)
    writer.add_feed_forward_length(config.ffn_hidden)
    writer.add_head_count(config.heads)
    writer.add_head_count_kv(config.kv_heads)
    writer.add_rope_dimension_count(config.head_dim)
    if architecture != "llama":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab)
    state = {name: tensor.numpy().astype(np.float32) for name, tensor in model.state_dict().items()}
    if phi3:
        writer.add_sliding_window(0)  # none, as llama.cpp writes it
        end_ids = {"padding": 0, "bos": 1, "eos": 2, **(end_ids or {})}  # else Phi3Config's 32000s, outside the vocabulary
        for layer in range(config.layers):
            for fused, parts in (("attn_qkv", ("q_proj", "k_proj", "v_proj")), ("ffn_up", ("gate_proj", "up_proj"))):
                where = "self_attn" if fused == "attn_qkv" else "mlp"
                writer.add_tensor(f"blk.{layer}.{fused}.weight", np.concatenate(
                    [state.pop(f"layers.{layer}.{where}.{part}.weight") for part in parts]))
    for name, token_id in (end_ids or {}).items():
        writer.add_uint32(f"tokenizer.ggml.{name}_token_id", token_id)
    for name, array in state.items():
        if name.startswith("layers."):
            stem, suffix = name.rsplit(".", 1)
            _, layer, part = stem.split(".", 2)
            gguf_name = f"blk.{layer}.{LAYER_PARTS[part]}.{suffix}"
            if architecture == "llama" and part == "self_attn.q_proj":
                array = permute_qk(array, config.heads)
            elif architecture == "llama" and part == "self_attn.k_proj":
                array = permute_qk(array, config.kv_heads)
        else:
            gguf_name = GGUF_NAMES[name.removesuffix(".weight")] + ".weight"
        writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# Qwen3's head size 128 (hidden / heads = 8): transformers' GGUF loader takes Qwen3Config's default there, not the file's
@pytest.mark.parametrize("family", [{}, {"phi3": True}, {"qkv_bias": True}, {"qk_norm": True, "head_dim": 128}])
def test_gguf_round_trip_restores_every_weight(tmp_path, family):
    """Llama, Phi-3 (q|k|v and gate|up fused), Qwen2 (its biases) and Qwen3 (its head norms; the last three's Q/K rows
    as they are), back from the GGUF llama.cpp would write: every weight
    equal; and the logits transformers' own GGUF loader gives on the same file (an independent reading of llama.cpp's
    layout: which rows it permutes, for which architecture)."""
    from transformers import AutoModelForCausalLM

    phi3 = family.pop("phi3", False)
    config = replace(CONFIG, **family)
    model = Llama(config).initialize(0.5, torch.Generator().manual_seed(0)).eval()
    with torch.no_grad():  # norms not all ones, so that a norm read as another's shows
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(1, 0.3, generator=torch.Generator().manual_seed(len(name)))
    write_llama_gguf(model, tmp_path / "tiny.gguf", phi3=phi3)
    folder = cached_hf_folder(tmp_path / "tiny.gguf", tmp_path / "cache")
    loaded = load_hf_folder(folder)
    assert loaded.config == replace(config, rms_norm_eps=float(np.float32(CONFIG.rms_norm_eps)))  # GGUF stores fp32
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert cached_hf_folder(tmp_path / "tiny.gguf", tmp_path / "cache") == folder  # converted once
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32).eval()
    ids = torch.randint(CONFIG.vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    assert_as_exact_as_hf(loaded, theirs, ids)


@pytest.mark.parametrize("scaling", [RopeScaling("llama3", 8.0), RopeScaling("linear", 4.0)])
def test_gguf_scaled_rope_becomes_rope_scaling(tmp_path, scaling):
    """Llama 3.x's `rope_freqs` (computed as llama.cpp's converter does) and a linear scaling's keys come back as the
    config's rope_scaling; divisors no llama3 parameters give are refused by name."""
    config = replace(CONFIG, rope_theta=500000.0, rope_scaling=scaling)  # wavelengths 6, 167, 4443, 118k
    model = Llama(config).initialize(0.5, torch.Generator().manual_seed(0))
    freqs = base_frequencies(config.head_dim, config.rope_theta)
    divisors = scaling.divisors(freqs).numpy() if scaling.rope_type == "llama3" else None
    if divisors is not None:
        assert divisors.min() == 1.0 and divisors.max() == 8.0 and ((divisors > 1) & (divisors < 8)).sum() == 1
    write_llama_gguf(model, tmp_path / "scaled.gguf", divisors)
    loaded = load_hf_folder(cached_hf_folder(tmp_path / "scaled.gguf", tmp_path / "cache"))
    assert loaded.config.rope_scaling == scaling
    if divisors is not None:
        write_llama_gguf(model, tmp_path / "odd.gguf", divisors * [1.0, 1.0, 1.5, 1.0])
        with pytest.raises(InvalidValue, match="rope_freqs"):
            cached_hf_folder(tmp_path / "odd.gguf", tmp_path / "cache")


def test_phi3_long_context_gguf_is_refused_by_name(tmp_path):
    """Phi-3's 128k models scale their frequencies by `rope_factors_long` / `_short` tensors (longrope): not built."""
    model = Llama(CONFIG).initialize(0.5, torch.Generator().manual_seed(0))
    factors = np.ones(CONFIG.head_dim // 2, dtype=np.float32)
    write_llama_gguf(model, tmp_path / "long.gguf", phi3=True,
                     extra={"rope_factors_long.weight": factors, "rope_factors_short.weight": factors})
    with pytest.raises(InvalidValue, match="rope_scaling='longrope'"):
        cached_hf_folder(tmp_path / "long.gguf", tmp_path / "cache")


def test_gguf_end_of_generation_ids_become_eos_token_ids(tmp_path):
    """llama.cpp ends a generation at EOS, EOT and EOM (Llama 3.x Instruct's <|end_of_text|>, <|eot_id|>,
    <|eom_id|>): config.json lists them all, as transformers' generate and our tokenizer read it."""
    import json

    from mlsyslab.nn.tokenizer import generation_eos

    model = Llama(CONFIG).initialize(0.5, torch.Generator().manual_seed(0))
    write_llama_gguf(model, tmp_path / "ends.gguf", end_ids={"eos": 60, "eot": 61, "eom": 62, "bos": 59})
    folder = cached_hf_folder(tmp_path / "ends.gguf", tmp_path / "cache")
    config = json.loads((folder / "config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"]) == ([60, 61, 62], 59)
    assert generation_eos(folder) == [60, 61, 62]


def test_unpermute_inverts_llama_cpp_permutation():
    weights = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    assert np.array_equal(unpermute_qk(permute_qk(weights, 6), 6), weights)
    # llama.cpp interleaves: row 1 of a permuted head is row d/2 of the HF head
    assert np.array_equal(permute_qk(weights, 6)[1], weights[4])


def test_tensor_names_and_errors(tmp_path):
    assert hf_tensor_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    with pytest.raises(InvalidValue, match="tensor"):
        hf_tensor_name("blk.0.attn_qkv.weight")
    with pytest.raises(InvalidValue, match="model"):
        resolve_folder(tmp_path / "missing.gguf")
    with pytest.raises(InvalidValue, match="model"):
        resolve_folder(tmp_path)


def test_files_that_are_not_whole_ggufs_or_configs_are_refused_by_name(tmp_path):
    """An empty, cut or foreign .gguf, and a config.json without the shape, are errors naming them (not tracebacks
    from gguf's reader or from arithmetic on a missing field)."""
    whole = tmp_path / "whole.gguf"
    write_llama_gguf(Llama(CONFIG).initialize(generator=torch.Generator().manual_seed(0)), whole)
    for name, content in (("empty.gguf", b""), ("cut.gguf", whole.read_bytes()[:4000]), ("text.gguf", b"not a gguf\n")):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(InvalidValue, match=r"model=.*a whole GGUF file \(gguf cannot read it"):
            resolve_folder(tmp_path / name, tmp_path / "cache")
    assert resolve_folder(whole, tmp_path / "cache").is_dir()
    shape = CONFIG.to_hf()
    for key in ("num_attention_heads", "hidden_size"):
        with pytest.raises(InvalidValue, match=f"{key}=None.*missing: {key}"):
            LlamaConfig.from_hf({name: value for name, value in shape.items() if name != key})


def test_default_model_loads_from_cache_in_about_a_second():
    load_pretrained("default")  # converts on first use on a fresh machine
    start = time.perf_counter()
    model, tokenizer, name = load_pretrained("default")
    assert time.perf_counter() - start < 3.0
    assert name == "SmolLM2-135M-Instruct" and model.config.rope_theta == 100000.0 and model.config.tied_embeddings
    assert tokenizer.eos_token_ids == {2}
    text = "Paged attention, 世界 🎉!"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_a_gguf_conversion_is_announced_once(tmp_path, caplog):
    """Converting takes ~20 s for SmolLM2: the first use logs what it converts into where; the cached folder is
    silent."""
    write_llama_gguf(Llama(CONFIG).initialize(0.5, torch.Generator().manual_seed(0)), tmp_path / "tiny.gguf")
    with caplog.at_level(logging.INFO, logger="mlsyslab"):
        folder = cached_hf_folder(tmp_path / "tiny.gguf", tmp_path / "cache")
        cached_hf_folder(tmp_path / "tiny.gguf", tmp_path / "cache")
    assert [record.getMessage() for record in caplog.records] == [
        f"converting {tmp_path / 'tiny.gguf'} into {folder} (first use only: later starts load the folder)"]
