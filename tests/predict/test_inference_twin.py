"""The serving twin: predict's decode step for the model nn/ runs, with the host time of eager kernels."""

import numpy as np
import pytest

from mlsyslab.nn.llama import Llama, LlamaConfig
from mlsyslab.predict.architecture import parameters
from mlsyslab.predict.assumptions import Assumptions
from mlsyslab.predict.hardware import Hardware
from mlsyslab.predict.inference import predict_inference
from mlsyslab.specs import catalog


def test_kernel_overhead_adds_layers_times_kernels_to_every_pass():
    model, (system, chip) = catalog.model("SmolLM2-135M"), catalog.hardware("h100")
    hw = Hardware.of(system, chip, "bf16")
    plain = predict_inference(model, hw, 4, 128, 64)
    eager = predict_inference(model, hw, 4, 128, 64, assumptions=Assumptions().override(
        {"kernel_overhead_s": 5e-6, "kernels_per_layer": 40}))
    launches = 5e-6 * 40 * model.layers
    assert float(eager.itl_s) == pytest.approx(float(plain.itl_s) + launches, rel=1e-12)
    assert float(eager.ttft_s) == pytest.approx(float(plain.ttft_s) + launches, rel=1e-12)


def test_llama_config_as_a_catalog_spec_round_trips():
    config = LlamaConfig.from_spec(catalog.model("SmolLM2-135M"), rope_theta=100000.0)
    count = sum(p.numel() for p in Llama(config).parameters())
    spec = config.to_spec("smol", count, "test")
    assert LlamaConfig.from_spec(spec, rope_theta=100000.0, rms_norm_eps=config.rms_norm_eps) == config
    assert np.isclose(parameters(spec).total(), count, rtol=1e-9)


def test_the_engine_twin_counts_its_kernels_per_layer():
    """~80 aten ops per decoder layer in a decode step; more with several sequences (the padding mask)."""
    import torch

    from mlsyslab.serve.twin import kernels_per_decode_layer

    single, batched = kernels_per_decode_layer(torch.float32, 1), kernels_per_decode_layer(torch.float32, 3)
    assert 40 <= single <= 150 and single == int(single)
    assert batched > single
