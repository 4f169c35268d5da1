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


def test_the_twin_counts_one_host_call_a_step_where_the_streamed_step_decodes():
    """A model whose head size the paged kernel serves decodes in one C++ call a step (`nn.fused_decode`) under
    `streamed_below` rows: no per-layer kernels to pay for; where that step does not apply, the counted ones."""
    import torch

    from mlsyslab.nn import cpu_kernels
    from mlsyslab.nn.llama import Llama, LlamaConfig
    from mlsyslab.nn.packed_linear import streamed_below
    from mlsyslab.serve.twin import host_kernels_per_layer, kernels_per_decode_layer

    config = LlamaConfig(vocab=64, hidden=128, layers=4, heads=2, kv_heads=1, head_dim=64, ffn_hidden=128, max_seq=64)
    model = Llama(config)
    if cpu_kernels.serves_attention(torch.device("cpu"), torch.float32, 64):
        assert host_kernels_per_layer(model, 1) == 1 / 4
    else:
        assert host_kernels_per_layer(model, 1) == kernels_per_decode_layer(torch.float32, 1)
    wide = streamed_below(torch.float32)
    if wide < 1_000:
        assert host_kernels_per_layer(model, int(wide)) == kernels_per_decode_layer(torch.float32, int(wide))


def test_the_twin_refuses_a_spec_measured_per_rank_of_several():
    from mlsyslab.cli.options import resolve_hardware
    from mlsyslab.errors import InvalidValue
    from mlsyslab.serve.twin import check_calibration

    hardware, _ = resolve_hardware("h100", None, "bf16")  # 8 accelerators a node, as 8 ranks would measure
    with pytest.raises(InvalidValue, match="calibrate --nproc 1"):
        check_calibration(hardware)


@pytest.mark.parametrize("has_bf16_dot", [False, True])
def test_the_twin_takes_the_fp32_peak_where_this_engine_widens_bf16(monkeypatch, has_bf16_dot):
    """Without a bf16 dot product the engine multiplies bf16 weights in fp32 (the streamed kernel widens them, wide
    steps take an fp32 copy), so the twin resolves the local spec's fp32 peak; the weights' bytes stay bf16."""
    import torch

    from mlsyslab.cli.options import resolve_hardware
    from mlsyslab.serve import config
    from mlsyslab.serve.config import compute_dtype
    from mlsyslab.serve.twin import predicted_tpot

    monkeypatch.setattr(config, "cpu_has_bf16_dot", lambda: has_bf16_dot)
    assert compute_dtype("local", "bf16") == ("bf16" if has_bf16_dot else "fp32")
    assert compute_dtype("local", "fp32") == "fp32" and compute_dtype("h100", "bf16") == "bf16"

    hardware, _ = resolve_hardware("h100", None, "fp32")
    config = LlamaConfig(vocab=64, hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, ffn_hidden=128, max_seq=64)
    model = Llama(config).to(torch.bfloat16)
    spec = config.to_spec("tiny", sum(p.numel() for p in model.parameters()), "test")
    tpot = predicted_tpot(model, "tiny", hardware, Assumptions(), 1, 16, 16)
    at = lambda weights: float(predict_inference(  # noqa: E731
        spec, hardware, 1, 16, 16, weight_dtype=weights, kv_dtype="bf16",
        assumptions=Assumptions().override({"kernels_per_layer": 0.5})).itl_s)
    assert tpot == pytest.approx(at("bf16"), rel=1e-12) and at("bf16") < at("fp32")
