"""The predict twin of this engine: the decode step (TPOT) `predict.inference` expects for it.

ITL = max(FLOP / peak, (weights + KV read) / bandwidth) + kernels · host time per kernel, on the
hardware spec `mlsys calibrate --nproc 1 --threads <cores>` measured (peak, copy bandwidth, time per
eager kernel). What is this engine's own is counted, not assumed: the kernels one decoder layer
launches in a decode step are counted under a `TorchDispatchMode` on tiny models of 2 and 4 layers of
the same dtype, and the KV cache dtype is the engine's (`serve.engine.kv_cache_dtype`).
Not modelled: prefill chunks that share a step with decodes (they lengthen the measured TPOT at
high concurrency), the GEMV kernels reaching less than the copy bandwidth, and the C++ decode path:
the tiny models' head size (8) takes the PyTorch layers, so the count is theirs, while a served
model whose kernels apply runs each decode step's layers in one C++ call (`nn.fused_decode`) and pays
far less host time than the count implies. Used by
`mlsys bench serve --hardware` and benchmarks/serve.py; tested in tests/predict/test_inference_twin.py.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mlsyslab.nn.llama import Llama, LlamaConfig
from mlsyslab.nn.pretrained import DTYPES
from mlsyslab.predict.assumptions import Assumptions
from mlsyslab.predict.inference import predict_inference
from mlsyslab.serve.engine import Engine, EngineConfig, kv_cache_dtype
from mlsyslab.serve.sampling import SamplingParams


def predicted_tpot(model: Llama, name: str, hardware, assumptions: Assumptions, concurrency: int,
                   prompt_tokens: int, output_tokens: int) -> float:
    """Seconds per decode step of `model` served by this engine with `concurrency` requests in flight."""
    parameter = next(model.parameters())
    spec = model.config.to_spec(name, sum(p.numel() for p in model.parameters()), "the loaded model's config")
    kv = {torch_dtype: label for label, torch_dtype in DTYPES.items()}[kv_cache_dtype(parameter, model.config.head_dim)]
    counted = assumptions.override({"kernels_per_layer": kernels_per_decode_layer(parameter.dtype, concurrency)})
    prediction = predict_inference(spec, hardware, concurrency, prompt_tokens, output_tokens, kv_dtype=kv,
                                   assumptions=counted)
    return float(prediction.itl_s)


def kernels_per_decode_layer(dtype: torch.dtype, concurrency: int = 1) -> float:
    """Kernels one decoder layer launches in a decode step of `concurrency` sequences (of different
    lengths when there are several, as served): counted on 4- and 2-layer models, halved difference."""
    return (_decode_step_kernels(4, dtype, concurrency) - _decode_step_kernels(2, dtype, concurrency)) / 2


class _KernelCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _decode_step_kernels(layers: int, dtype: torch.dtype, concurrency: int) -> int:
    config = LlamaConfig(vocab=64, hidden=32, layers=layers, heads=4, kv_heads=2, head_dim=8, ffn_hidden=64,
                         max_seq=64)
    model = Llama(config).initialize(generator=torch.Generator().manual_seed(0)).to(dtype).eval()
    engine = Engine(model, None, EngineConfig(kv_cache_bytes=4_000_000), eos_token_ids=frozenset())
    for index in range(concurrency):
        engine.add_request(str(index), list(range(1, 3 + index)), SamplingParams(max_tokens=3, temperature=0))
    engine.step()  # the prefills; the next step decodes every sequence
    counter = _KernelCount()
    with counter:
        engine.step()
    return counter.count
