"""Load a Hugging Face safetensors folder (config.json + *.safetensors) into `nn.llama.Llama`.

Our parameter names are HF's `LlamaForCausalLM` names without the `model.` prefix, so loading is a
rename (and, for checkpoints that store q|k|v and gate|up as one matrix each, as Phi-3's `qkv_proj` and
`gate_up_proj`, a split into row slices: `split_fused`); tensors are memory-mapped by safetensors and assigned without a copy when the dtype already
matches (a 538 MB fp32 folder loads in about a second). Shards listed in
`model.safetensors.index.json` are read in turn. Tested in tests/nn/test_loaders.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mlsyslab.errors import InvalidValue
from mlsyslab.nn.llama import Llama, LlamaConfig


def load_hf_folder(folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Llama:
    """A Llama with the weights of an HF folder, in `dtype`, on `device`, in eval mode."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise InvalidValue("model", str(folder), "a folder with config.json and *.safetensors")
    config = LlamaConfig.from_hf(json.loads(config_path.read_text()))
    state = split_fused({our_name(name): tensor.to(dtype=dtype, device=device)
                         for name, tensor in read_safetensors(folder).items()}, config)
    if config.tied_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = Llama(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [name for name in missing if not (config.tied_embeddings and name == "lm_head.weight")]
    if missing or unexpected:
        raise InvalidValue("model", str(folder), "a Llama checkpoint", f"missing {missing[:4]}, unexpected {unexpected[:4]}")
    if config.tied_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors file(s), by HF name."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    state = {}
    for name in files:
        if not (folder / name).is_file():
            raise InvalidValue("model", str(folder / name), "an existing safetensors file")
        state.update(load_file(str(folder / name)))
    return state


def our_name(hf_name: str) -> str:
    return hf_name.removeprefix("model.")


def split_fused(state: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Phi-3's fused matrices as our separate ones: `qkv_proj` rows are q (heads·d), k and v (kv_heads·d each) in
    turn, `gate_up_proj` rows gate then up (transformers' Phi3MLP: `gate, up = gate_up_proj(x).chunk(2)`). Views, not
    copies."""
    widths = {"self_attn.qkv_proj": [("self_attn.q_proj", config.heads * config.head_dim),
                                     ("self_attn.k_proj", config.kv_heads * config.head_dim),
                                     ("self_attn.v_proj", config.kv_heads * config.head_dim)],
              "mlp.gate_up_proj": [("mlp.gate_proj", config.ffn_hidden), ("mlp.up_proj", config.ffn_hidden)]}
    split = {}
    for name, tensor in state.items():
        fused = next((key for key in widths if f".{key}." in name), None)
        if fused is None:
            split[name] = tensor
            continue
        rows = [width for _, width in widths[fused]]
        if tensor.shape[0] != sum(rows):
            raise InvalidValue(name, list(tensor.shape), f"{sum(rows)} rows ({fused} of this config)")
        for (part, _), piece in zip(widths[fused], tensor.split(rows)):
            split[name.replace(fused, part)] = piece
    return split


def save_hf_folder(model: Llama, folder: str | Path) -> None:
    """Write `model` as an HF folder (config.json + model.safetensors), readable by transformers."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {("" if name == "lm_head.weight" else "model.") + name: tensor.contiguous()
             for name, tensor in model.state_dict().items()
             if not (model.config.tied_embeddings and name == "lm_head.weight")}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2))
