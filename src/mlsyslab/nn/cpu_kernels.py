"""Builds and loads the C++ kernels of the CPU serving path and of the training model's layers (`nn/csrc/*.cpp`,
ops `torch.ops.mlsyslab.*`).

- `paged_decode_attention` (csrc/paged_decode.cpp): decode attention reading the paged KV cache in
  place, fp32 or bf16 cache; used by `nn.paged_attention`.
- `rms_norm` (and `rms_norm_rstd`), `silu_and_mul`, `rope_` (csrc/layer_ops.cpp): a decoder layer's per-token steps
  as one pass each; the serving copy of the model (`nn.packed_linear.packed_for_inference`) uses them through
  `KernelRMSNorm`, `silu_and_mul` and `rope`, the training model through `nn.training_kernels`.
- `rms_norm_backward`, `silu_and_mul_backward` (csrc/layer_grads.cpp): the training path's backward of RMSNorm and
  of silu(gate)·up in one pass each, through `nn.training_kernels` (with `rope_` for rope's backward).
- `causal_attention_forward`, `causal_attention_backward` (csrc/causal_attention.cpp): the training model's causal
  attention and its FlashAttention-2 backward, through `nn.training_kernels.causal_attention`.
- `prompt_attention` (csrc/prompt_attention.cpp): causal attention of a step's whole prompts on AMX tiles (bf16,
  head_dim 32/64/128, `serves_prompt_attention`); used by `nn.paged_attention`.
- `decode_layers` (csrc/decode_layers.cpp): a decode step through every decoder layer in one call, the
  kernels above and the serving copy's matmuls in C++ order; used by `nn.fused_decode`.
- `stream_pack`, `streamed_linear` (csrc/streamed_linear.cpp): the matrix-vector product of small
  decode steps, on a tiled copy of the weight (`nn.packed_linear`); for fp32 where the CPU has AVX-512 and bf16
  where it has AVX512_BF16, the register-blocked GEMM of csrc/panel_linear.cpp, at every row count (`panels`), for
  bf16 on AMX tiles where the CPU has them (csrc/amx_linear.cpp, `amx_panels`).
- `streamed_decode` (csrc/streamed_decode.cpp): a whole decode step, logits included, in one parallel
  region, when every matrix takes the streamed kernel; used by `nn.fused_decode`.
- `softmax_draw` (csrc/softmax_draw.cpp): one token per row from softmax(logits / T) by inverse CDF;
  used by `serve.sampling` for the rows that sample without top-k / top-p / min-p.
- `huge_page_zeros` (csrc/huge_pages.cpp): zeroed bytes on transparent huge pages, as tensors through
  `huge_page_zeros` here: the serving copy's streamed weights (`nn.packed_linear`) and the KV pool (`serve.kv_cache`).

The kernels are compiled at first use with `torch.utils.cpp_extension.load` (g++ and ninja; ~50 s on a 2-core
AMD Zen 3 — 75 s when each file included all of ATen (`ATen/ATen.h`, ~13 s a file of parsing), so each includes
`ATen/core/Tensor.h` and the ops it calls; the first build says it is building on the `mlsyslab` logger:
`mlsyslab.progress`) into a folder of the torch extensions cache and loaded in well under a second afterwards.
They are built for this CPU (`-march=native`: AVX-512 where there is one), so the build is named after the CPU's
model and flags, and a home folder shared by different machines never loads code built for another; the folder is
named after the Python and torch versions too.
OpenMP is the libgomp torch already loaded (same soname): the kernels' threads are torch's
(`torch.set_num_threads`). Where they cannot be built (no compiler) or do not apply (not CPU, a dtype
other than fp32/bf16, head_dim not 32/64/128), `load()` is None and callers keep their PyTorch path;
MLSYS_CPU_KERNELS=0 forces that path. Tested against the PyTorch path in tests/nn/test_cpu_kernels.py.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from mlsyslab.measure.host import cpu_description

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
HEAD_DIMS = (32, 64, 128)
DTYPES = (torch.float32, torch.bfloat16)
STALE_BUILD_LOCK_S = 15 * 60  # a build takes 1-2 minutes: a lock this old is a killed build's
log = logging.getLogger(__name__)


def panels(dtype: torch.dtype) -> bool:
    """Whether the streamed kernel is the panel kernel for weights of `dtype` in this build (csrc/panel_linear.cpp:
    fp32 with AVX-512, bf16 with AVX512_BF16's pair instruction; False where the kernels do not build)."""
    return load() is not None and load().streamed_panels(dtype)


def amx_panels() -> bool:
    """Whether the bf16 panel kernel runs on AMX tiles here (csrc/amx_linear.cpp: the CPU has them, the OS granted them
    to this process, and MLSYS_AMX is not 0)."""
    return panels(torch.bfloat16) and load().streamed_amx()


def cpu_fingerprint() -> str:
    """The CPU's model name and feature flags, hashed: what `-march=native` compiles for."""
    model, flags = cpu_description()
    return hashlib.sha256(" ".join([model, *sorted(flags)]).encode()).hexdigest()[:12]


@functools.cache
def load():
    """`torch.ops.mlsyslab`, built if needed; None where the kernels cannot be built or are switched off."""
    if os.environ.get("MLSYS_CPU_KERNELS", "1") == "0" or platform.machine() not in ("x86_64", "AMD64", "aarch64"):
        return None
    try:
        from torch.utils.cpp_extension import get_default_build_root
        from torch.utils.cpp_extension import load as build
        name = f"mlsyslab_cpu_kernels_{cpu_fingerprint()}"
        folder = (Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
                  / f"{name}-py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}")
        if not (folder / f"{name}.so").is_file():
            log.info("building mlsyslab's C++ kernels for this CPU into %s (first use only; ~1-2 minutes on 2 "
                     "cores)", folder)
        folder.mkdir(parents=True, exist_ok=True)
        remove_stale_lock(folder)
        build(name=name, sources=[str(source) for source in SOURCES], build_directory=str(folder),
              is_python_module=False, extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
              extra_ldflags=["-fopenmp"])
    except Exception as error:  # noqa: BLE001 - no compiler, no ninja, or a failed build: say so, fall back
        warnings.warn(f"CPU kernels not built ({type(error).__name__}: {str(error)[:200]}); serving and the "
                      "model's backward take their PyTorch paths (slower)", RuntimeWarning, stacklevel=2)
        return None
    return torch.ops.mlsyslab


def remove_stale_lock(folder: Path) -> None:
    """Remove the lock file torch's build keeps in `folder` while it builds, where it is older than
    `STALE_BUILD_LOCK_S`: a build killed midway (Ctrl-C on the first `mlsys train`, a rank stopped) leaves it behind,
    and every later load would wait on it forever (torch.utils.file_baton has no timeout)."""
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_BUILD_LOCK_S:
        log.warning("removing %s, left %.0f minutes ago by a build that did not finish", lock, age / 60)
        lock.unlink(missing_ok=True)


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype, in_background: bool = False) -> torch.Tensor:
    """A zeroed CPU tensor on transparent huge pages where the kernels build (csrc/huge_pages.cpp; for buffers a
    decode step streams or walks: the weights' tiles, the KV pool), else torch's own allocation. Its pages are
    faulted in before it returns, or with `in_background` by a thread of the kernels' own while it is used."""
    if load() is None:
        return torch.zeros(shape, dtype=dtype)
    return load().huge_page_zeros(math.prod(shape) * dtype.itemsize, in_background).view(dtype).view(shape)


def serves(tensor: torch.Tensor) -> bool:
    """Whether the layer kernels take `tensor` (CPU, fp32 or bf16) and are built."""
    return tensor.device.type == "cpu" and tensor.dtype in DTYPES and load() is not None


def serves_attention(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `paged_decode_attention` reads a KV cache of this device, dtype and head size."""
    return device.type == "cpu" and dtype in DTYPES and head_dim in HEAD_DIMS and load() is not None


def serves_prompt_attention(q: torch.Tensor) -> bool:
    """Whether `prompt_attention` takes queries like `q` [..., heads, head_dim]: bf16 on a CPU whose AMX tiles the OS
    granted (csrc/amx_linear.cpp), head_dim 32, 64 or 128."""
    return (q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.shape[-1] in HEAD_DIMS and load() is not None
            and load().streamed_amx())


class KernelRMSNorm(nn.Module):
    """`nn.llama.RMSNorm` for inference, in one pass (rounded once, as F.rms_norm); shares the weight."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return load().rms_norm(x.contiguous(), self.weight, self.eps)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up in one pass; gate and up are the two halves of one fused matmul's output."""
    width = gate.shape[-1]
    out = load().silu_and_mul(gate.reshape(-1, width), up.reshape(-1, width))
    return out.view(*gate.shape)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`nn.rope.apply_rope` in place on x [B, T, heads, head_dim] (a view of the fused q/k/v output)."""
    load().rope_(x.view(-1, *x.shape[2:]), cos.reshape(-1, x.shape[-1]), signed_sin.reshape(-1, x.shape[-1]))
    return x
