"""The predict twin of this engine: the decode step (TPOT) `predict.inference` expects for it.

ITL = max(FLOP / peak, (weights + KV read) / bandwidth) + kernels · host time per kernel, on the
hardware spec `mlsys calibrate --nproc 1 --threads <cores>` measured (peak, copy bandwidth, time per
eager kernel); a spec measured per rank of several ranks (the trainer's) is refused (`check_calibration`): its
bandwidth is a share of the machine's. What is this engine's own is counted, not assumed: where its streamed C++
step runs the decode (`nn.fused_decode`: the paged kernel serves the head size, and the step has fewer rows than
`packed_linear.streamed_below`) the host pays one call a step; elsewhere the kernels one decoder layer launches
are counted under a `TorchDispatchMode` on tiny models of 2 and 4 layers of the same dtype (their head size, 8,
takes the PyTorch layers; the per-op C++ step launches fewer). The KV cache dtype is the engine's
(`serve.engine.kv_cache_dtype`). Not modelled: prefill chunks that share a step with decodes (they lengthen the
measured TPOT at high concurrency), the products streaming below the copy bandwidth and the barriers between them
(benchmarks/README.md: the batch-1 step reaches 73-93% of the roofline here). Used by `mlsys bench serve
--hardware` and benchmarks/serve.py; tested in tests/predict/test_inference_twin.py.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mlsyslab.errors import InvalidValue
from mlsyslab.nn import cpu_kernels
from mlsyslab.nn.llama import Llama, LlamaConfig
from mlsyslab.nn.packed_linear import streamed_below
from mlsyslab.nn.pretrained import DTYPE_NAMES, torch_dtype
from mlsyslab.predict.assumptions import Assumptions
from mlsyslab.predict.inference import predict_inference
from mlsyslab.serve.config import EngineConfig
from mlsyslab.serve.engine import Engine, kv_cache_dtype
from mlsyslab.serve.sampling_params import SamplingParams


def predicted_tpot(model: Llama, name: str, hardware, assumptions: Assumptions, concurrency: int,
                   prompt_tokens: int, output_tokens: int) -> float:
    """Seconds per decode step of `model` served by this engine with `concurrency` requests in flight, on `hardware`
    resolved for `serve.config.compute_dtype`."""
    parameter = next(model.parameters())
    spec = model.config.to_spec(name, sum(p.numel() for p in model.parameters()), "the loaded model's config")
    label = {torch_dtype(label): label for label in DTYPE_NAMES}
    counted = assumptions.override({"kernels_per_layer": host_kernels_per_layer(model, concurrency)})
    prediction = predict_inference(spec, hardware, concurrency, prompt_tokens, output_tokens,
                                   weight_dtype=label[parameter.dtype],
                                   kv_dtype=label[kv_cache_dtype(parameter, model.config.head_dim)], assumptions=counted)
    return float(prediction.itl_s)


def check_calibration(hardware) -> None:
    """Raise unless `hardware` was measured as this engine runs: one process on every core."""
    if hardware.accelerators_per_node != 1:
        raise InvalidValue("--hardware", "local", "a spec from `mlsys calibrate --nproc 1 --threads <cores>`, as the "
                           f"engine runs (this one was measured per rank of {hardware.accelerators_per_node} ranks "
                           "running at once: a share of the machine's bandwidth)")


def host_kernels_per_layer(model: Llama, concurrency: int) -> float:
    """Host-side launches a decode step of `concurrency` rows pays per layer: one C++ call for the whole step where
    the engine's streamed step takes it, else the PyTorch layers' kernels, counted."""
    parameter = next(model.parameters())
    if (cpu_kernels.serves_attention(parameter.device, parameter.dtype, model.config.head_dim)
            and concurrency < streamed_below(parameter.dtype)):
        return 1 / model.config.layers
    return kernels_per_decode_layer(parameter.dtype, concurrency)


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
    config = LlamaConfig(vocab=concurrency + 64, hidden=32, layers=layers, heads=4, kv_heads=2, head_dim=8,
                         ffn_hidden=64, max_seq=concurrency + 64)  # sequence i's prompt: ids 1..i + 2
    model = Llama(config).initialize(generator=torch.Generator().manual_seed(0)).to(dtype).eval()
    engine = Engine(model, None, EngineConfig(kv_cache_bytes=4_000_000), eos_token_ids=frozenset())
    for index in range(concurrency):
        engine.add_request(str(index), list(range(1, 3 + index)), SamplingParams(max_tokens=3, temperature=0))
    engine.step()  # the prefills; the next step decodes every sequence
    counter = _KernelCount()
    with counter:
        engine.step()
    return counter.count
