"""The Llama definition against Hugging Face's LlamaForCausalLM on tiny random configs, and its paths."""

import dataclasses

import pytest
import torch

from mlsyslab.errors import InvalidValue
from mlsyslab.nn.hf_loader import load_hf_folder, save_hf_folder
from mlsyslab.nn.llama import Llama, LlamaConfig
from mlsyslab.nn.paged_attention import PagedAttention, SequenceSlice
from mlsyslab.nn.rope import RopeScaling
from mlsyslab.specs import catalog
from tests.nn.hf_logits import assert_as_exact_as_hf

TINY = {"vocab": 96, "hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 8, "ffn_hidden": 64,
        "rope_theta": 1000.0, "rms_norm_eps": 1e-6, "max_seq": 256}


def tiny(dtype=torch.float32, seed=0, **changes) -> Llama:
    config = LlamaConfig(**{**TINY, **changes})
    return Llama(config).to(dtype).initialize(0.5, torch.Generator().manual_seed(seed)).eval()


@pytest.mark.parametrize("changes", [
    {}, {"tied_embeddings": False}, {"kv_heads": 4}, {"kv_heads": 1, "head_dim": 16},
    {"rope_scaling": RopeScaling("linear", 4.0)},
    # wavelengths 6.3, 35, 199, 1117 against 64 / 4 and 64 / 1: one kept, one interpolated, two slowed by 8
    {"rope_scaling": RopeScaling("llama3", 8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq=64)},
    # biases on q/k/v: written as a Qwen2 folder; head norms (and a head size of their own): as a Qwen3 folder
    {"qkv_bias": True}, {"qkv_bias": True, "tied_embeddings": False}, {"qk_norm": True, "head_dim": 16}])
def test_logits_equal_hf_llama_on_the_same_weights(tmp_path, changes):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ours = tiny(**changes)
    save_hf_folder(ours, tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(theirs).__name__ == ("Qwen3ForCausalLM" if ours.config.qk_norm else
                                     "Qwen2ForCausalLM" if ours.config.qkv_bias else "LlamaForCausalLM")
    assert theirs.config.tie_word_embeddings == ours.config.tied_embeddings
    assert LlamaConfig.from_hf(theirs.config) == ours.config  # the rope scaling too, as transformers read it
    ids = torch.randint(ours.config.vocab, (3, 40))
    assert_as_exact_as_hf(ours, theirs, ids)


def test_hf_checkpoint_loads_into_ours(tmp_path):
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    theirs = LlamaForCausalLM(HFConfig(**LlamaConfig(**TINY, tied_embeddings=False).to_hf())).eval()
    theirs.save_pretrained(tmp_path)
    ours = load_hf_folder(tmp_path)
    assert ours.config == LlamaConfig(**TINY, tied_embeddings=False)
    ids = torch.randint(TINY["vocab"], (2, 33))
    assert_as_exact_as_hf(ours, theirs, ids)


@pytest.mark.parametrize("window", [None, 16])
def test_a_mistral_checkpoint_loads_and_equals_hf_mistral(tmp_path, window):
    """Mistral is Llama with a sliding window: none (v0.2 on) changes nothing; one shorter than the context caps the
    context at it, where attention is plain causal attention (v0.1)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(2)
    theirs = MistralForCausalLM(MistralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rope_theta=1000.0, rms_norm_eps=1e-6,
        sliding_window=window, tie_word_embeddings=False)).eval()
    theirs.save_pretrained(tmp_path)
    ours = load_hf_folder(tmp_path)
    assert ours.config.max_seq == (window or 64)
    ids = torch.randint(96, (2, ours.config.max_seq))
    assert_as_exact_as_hf(ours, theirs, ids)


@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("family", ["phi3", "qwen2", "qwen3"])
def test_phi3_and_qwen_checkpoints_load_and_equal_transformers(tmp_path, family, window):
    """Phi-3 is Llama with q|k|v and gate|up stored as one matrix each (split at load); Qwen2 Llama with biases on
    Q, K and V (random here: transformers initialises them to zero); Qwen3 with an RMSNorm over each query and key head
    instead, and a head size of its own (16 here, against hidden / heads = 8). Their sliding window (Qwen's where
    `use_sliding_window` turns it on) caps the context at it, as Mistral's does."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(3)
    theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        family, vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16 if family == "qwen3" else 8, max_position_embeddings=64,
        rope_theta=1000000.0, rms_norm_eps=1e-6, use_sliding_window=window is not None, sliding_window=window,
        max_window_layers=0, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()
    with torch.no_grad():
        for name, parameter in theirs.named_parameters():
            parameter.normal_(1, 0.3) if name.endswith("norm.weight") else parameter.normal_(0, 0.5)
    theirs.save_pretrained(tmp_path)
    ours = load_hf_folder(tmp_path)
    assert (ours.config.qkv_bias, ours.config.qk_norm) == (family == "qwen2", family == "qwen3")
    assert ours.config.tied_embeddings and ours.config.max_seq == (window or 64)
    ids = torch.randint(96, (2, ours.config.max_seq))
    assert_as_exact_as_hf(ours, theirs, ids)


def test_packed_paged_path_equals_training_path():
    """Three sequences in chunks of uneven length, K/V through shuffled blocks, in fp64: same logits."""
    model = tiny(torch.float64)
    block_size, lengths = 4, [11, 1, 23]
    sequences = [torch.randint(TINY["vocab"], (n,)).tolist() for n in lengths]
    k = torch.zeros(TINY["layers"], TINY["kv_heads"], 32, block_size, TINY["head_dim"], dtype=torch.float64)
    v = torch.zeros_like(k)
    free = torch.randperm(32).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    done, logits = [0, 0, 0], [[] for _ in lengths]
    with torch.no_grad():
        expected = [model(torch.tensor([ids]))[0] for ids in sequences]
        while any(d < n for d, n in zip(done, lengths)):
            slices, ids, positions, chunks = [], [], [], []
            for index, (seq, table) in enumerate(zip(sequences, tables)):
                count = min(len(seq) - done[index], [5, 1, 7][index])
                if count == 0:
                    continue
                ids += seq[done[index]:done[index] + count]
                positions += range(done[index], done[index] + count)
                slices.append(SequenceSlice(count, done[index] + count, table))
                chunks.append((index, count))
                done[index] += count
            out = model.forward_packed(torch.tensor(ids), torch.tensor(positions), PagedAttention(k, v, slices))
            row = 0
            for index, count in chunks:
                logits[index].append(out[row:row + count])
                row += count
    for index in range(len(lengths)):
        torch.testing.assert_close(torch.cat(logits[index]), expected[index], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_prompts_of_one_length_attend_together_as_each_alone(dtype):
    """Two prompts of 9 tokens (attended in one batched call: apart, and back to back as views of the step's rows), one
    of 5 and a decode in one step: each prompt's logits are the ones it gets alone in a step, bit for bit."""
    model = tiny(dtype)
    block_size, lengths = 4, [9, 5, 9]
    prompts = [torch.randint(TINY["vocab"], (n,), generator=torch.Generator().manual_seed(n + i)).tolist()
               for i, n in enumerate(lengths)]

    def step(sequences):  # sequences: [(ids, first position)] -> the step's logits, one tensor per sequence
        k = torch.zeros(TINY["layers"], TINY["kv_heads"], 16, block_size, TINY["head_dim"], dtype=dtype)
        v, tables, next_block = torch.zeros_like(k), [], 0
        for ids, first in sequences:
            blocks = -(-(first + len(ids)) // block_size)
            tables.append(list(range(next_block, next_block + blocks)))
            next_block += blocks
        slices = [SequenceSlice(len(ids), first + len(ids), table) for (ids, first), table in zip(sequences, tables)]
        ids = [token for sequence, _ in sequences for token in sequence]
        positions = [p for sequence, first in sequences for p in range(first, first + len(sequence))]
        attention = PagedAttention(k, v, slices)
        with torch.no_grad():
            out = model.forward_packed(torch.tensor(ids), torch.tensor(positions), attention)
        return attention, list(out.split([len(sequence) for sequence, _ in sequences]))

    alone = [step([(prompt, 0)])[1][0] for prompt in prompts]
    attention, together = step([(prompts[0], 0), (prompts[1], 0), ([7], 3), (prompts[2], 0)])
    assert attention.whole_prompts == {9: [0, 15], 5: [9]} and attention.prefills
    for expected, got in zip(alone, [together[0], together[1], together[3]]):
        assert torch.equal(got, expected)
    attention, together = step([([7], 3), (prompts[0], 0), (prompts[2], 0), (prompts[1], 0)])
    assert attention.whole_prompts == {9: [1, 10], 5: [19]}
    for expected, got in zip(alone, [together[1], together[3], together[2]]):
        assert torch.equal(got, expected)


def test_config_from_catalog_spec():
    config = LlamaConfig.from_spec(catalog.model("SmolLM2-135M"), rope_theta=100000.0)
    assert (config.hidden, config.layers, config.heads, config.kv_heads, config.head_dim) == (576, 30, 9, 3, 64)
    assert config.tied_embeddings and config.vocab == 49152 and config.ffn_hidden == 1536
    model = Llama(LlamaConfig.from_spec(catalog.model("SmolLM2-135M")))
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)


def test_config_rejects_what_is_not_llama():
    with pytest.raises(InvalidValue, match="mla"):
        LlamaConfig.from_spec(catalog.model("DeepSeek-V3"))
    with pytest.raises(InvalidValue, match="moe"):  # its shared expert and router bias: not built
        LlamaConfig.from_spec(catalog.model("DeepSeek-V3").model_copy(update={"mla": None}))
    mixtral = LlamaConfig.from_spec(catalog.model("mixtral-8x7b"))  # plain top-2 of 8 experts: built (nn.moe)
    assert (mixtral.experts, mixtral.experts_per_token, mixtral.expert_hidden) == (8, 2, 14336)
    with pytest.raises(InvalidValue, match="experts"):
        mixtral.to_hf()
    with pytest.raises(InvalidValue, match="kv_heads"):
        LlamaConfig(**{**TINY, "kv_heads": 3})
    with pytest.raises(InvalidValue, match="rope_type"):
        LlamaConfig.from_hf({**LlamaConfig(**TINY).to_hf(), "rope_scaling": {"rope_type": "yarn", "factor": 8.0}})
    with pytest.raises(InvalidValue, match="model_type"):
        LlamaConfig.from_hf({**LlamaConfig(**TINY).to_hf(), "model_type": "gemma"})
    with pytest.raises(InvalidValue, match="partial_rotary_factor"):  # Phi-4-mini's: rope over 3/4 of each head
        LlamaConfig.from_hf({**LlamaConfig(**TINY).to_hf(), "model_type": "phi3", "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}})
    with pytest.raises(InvalidValue, match="rope_type"):  # Phi-3's 128k models
        LlamaConfig.from_hf({**LlamaConfig(**TINY).to_hf(), "model_type": "phi3", "rope_scaling": {
            "type": "longrope", "long_factor": [1.0] * 4, "short_factor": [1.0] * 4}})
    with pytest.raises(InvalidValue, match="attention_bias"):  # Llama's puts a bias on o_proj too: not built
        LlamaConfig.from_hf({**LlamaConfig(**TINY).to_hf(), "attention_bias": True})
    qwen = LlamaConfig.from_spec(catalog.model("Qwen2.5-0.5B"), rope_theta=1000000.0)  # biases on q/k/v: built
    assert qwen.qkv_bias and qwen.to_spec("Qwen2.5-0.5B", 494_000_000, "test").qkv_bias
    qwen3 = LlamaConfig.from_spec(catalog.model("Qwen3-8B"), rope_theta=1000000.0)  # head norms: built
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.to_spec("Qwen3-8B", 8_190_000_000, "test").qk_norm
    with pytest.raises(InvalidValue, match="qk_norm"):  # no Hugging Face family has both
        dataclasses.replace(qwen, qk_norm=True).to_hf()
    with pytest.raises(InvalidValue, match="high_freq_factor"):
        RopeScaling("llama3", 8.0, low_freq_factor=4.0, high_freq_factor=1.0)
    with pytest.raises(InvalidValue, match="rope_scaling.original_max_position_embeddings"):
        LlamaConfig.from_hf({**LlamaConfig(**TINY).to_hf(), "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}})
    with pytest.raises(InvalidValue, match="sequence length"):
        tiny()(torch.zeros(1, TINY["max_seq"] + 1, dtype=torch.long))


def test_training_path_has_gradients():
    model = tiny()
    ids = torch.randint(TINY["vocab"], (2, 16))
    loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_rms_norm_in_bf16_rounds_once_from_fp32():
    """The fused norm accumulates in fp32 and rounds once: within half a bf16 ulp of the exact value
    (HF's two roundings are not), and never further from it than HF's formula on average."""
    from mlsyslab.nn.llama import RMSNorm

    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 96, generator=generator) * 3).bfloat16()
    norm = RMSNorm(96, 1e-5).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=generator) + 0.5)
        ours = norm(x).double()
    exact = norm.weight.double() * x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    hf = (norm.weight * torch.nn.functional.rms_norm(x.float(), (96,), None, 1e-5).bfloat16()).double()
    assert ((ours - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-30).all()
    assert (ours - exact).abs().mean() <= (hf - exact).abs().mean()
