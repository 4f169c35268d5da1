"""`mlsys calibrate`'s spec: what the twin reads back, and the vocabulary projection's measured cost."""

import platform

import numpy as np
import pytest

from mlsyslab.cli.options import resolve_assumptions, resolve_hardware
from mlsyslab.errors import InvalidValue
from mlsyslab.measure.calibrate import WIDTHS, _fit_efficiency, calibrate
from mlsyslab.predict.assumptions import Assumptions
from mlsyslab.predict.architecture import parameters
from mlsyslab.predict.layout import Layout
from mlsyslab.predict.training import predict_training
from mlsyslab.specs import catalog


def test_the_output_projection_bytes_are_timed_per_logit_on_the_last_stage_alone():
    model, hardware = catalog.model("SmolLM2-135M"), resolve_hardware("h100", None, "bf16")[0]
    base = resolve_assumptions(None)
    more = base.override({"output_projection_bytes_per_logit": 40.0})
    t, tokens, microbatches = 2.0, 2 * 1024, 64 / 8 / 2
    logits_s = 40.0 * tokens * model.vocab / t / (hardware.hbm_bw * base.memory_bandwidth_efficiency)
    step = lambda layout, a: float(predict_training(model, hardware, layout, assumptions=a).step_s.reshape(-1)[0])  # noqa: E731
    unpipelined = Layout.of(dp=8, tp=2, micro_batch=2, global_batch=64, seq=1024)
    assert step(unpipelined, more) - step(unpipelined, base) == pytest.approx(microbatches * logits_s, rel=1e-9)
    # a pipeline's first stage holds no head: its own time does not change
    pipelined = Layout.of(dp=4, tp=2, pp=2, micro_batch=2, global_batch=64, seq=1024)
    first = lambda a: predict_training(model, hardware, pipelined, assumptions=a, stage="first")  # noqa: E731
    assert float(first(more).time_s["compute"].reshape(-1)[0]) == float(first(base).time_s["compute"].reshape(-1)[0])


def test_tensor_parallel_all_reduces_take_their_own_alpha_and_beta():
    model, hardware = catalog.model("SmolLM2-135M"), resolve_hardware("h100", None, "bf16")[0]
    layout = Layout.of(dp=1, tp=2, micro_batch=2, global_batch=2, seq=1024)
    base = resolve_assumptions(None)
    own = base.override({"shared_memory_latency_factor": 0.25, "shared_memory_bandwidth_factor": 4})
    message = 2 * 1024 * model.hidden * 2  # bf16 activations of one microbatch
    per_all_reduce = lambda bw, alpha: 2 * (1 / 2) * message / bw + 2 * alpha  # noqa: E731 - ring, 2 ranks
    link_bw = hardware.scale_up_bw * base.scale_up_efficiency
    tp = lambda a: float(predict_training(model, hardware, layout, assumptions=a).time_s["tensor_parallel"].reshape(-1)[0])  # noqa: E731
    count = 4 * model.layers
    assert tp(base) == pytest.approx(count * per_all_reduce(link_bw, base.scale_up_latency_s), rel=1e-9)
    assert tp(own) == pytest.approx(count * per_all_reduce(4 * link_bw, 0.25 * base.scale_up_latency_s), rel=1e-9)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_data_parallel_alone_takes_the_shared_memory_alpha_and_beta(zero):
    """DDP's and ZeRO's collectives go through shared memory when data parallelism is all the ranks do (their
    data-parallel time as if the link had the factors' α and β); beside TP they stay on the link."""
    model, hardware = catalog.model("SmolLM2-135M"), resolve_hardware("h100", None, "bf16")[0]
    base = resolve_assumptions(None)
    own = base.override({"shared_memory_latency_factor": 0.25, "shared_memory_bandwidth_factor": 4})
    as_link = base.override({"scale_up_latency_s": 0.25 * base.scale_up_latency_s, "scale_up_efficiency": 4 * base.scale_up_efficiency})
    dp = lambda layout, a: float(predict_training(model, hardware, layout, assumptions=a).time_s["data_parallel"].reshape(-1)[0])  # noqa: E731
    alone = Layout.of(dp=4, zero=zero, micro_batch=2, global_batch=16, seq=1024)
    assert dp(alone, own) == pytest.approx(dp(alone, as_link), rel=1e-12)
    assert dp(alone, own) < dp(alone, base)
    beside_tensor_parallel = Layout.of(dp=2, tp=2, zero=zero, micro_batch=2, global_batch=8, seq=1024)
    assert dp(beside_tensor_parallel, own) == pytest.approx(dp(beside_tensor_parallel, base), rel=1e-12)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_alone_takes_the_shared_memory_shard_collectives_beta(zero):
    """ZeRO's all-gathers and reduce-scatters through shared memory run at their own β (the all-reduce's times the
    shard factor); DDP's all-reduce keeps the all-reduce's, and beside TP every collective stays on the link."""
    model, hardware = catalog.model("SmolLM2-135M"), resolve_hardware("h100", None, "bf16")[0]
    base = resolve_assumptions(None).override({"shared_memory_bandwidth_factor": 4})
    slower = base.override({"shared_memory_shard_bandwidth_factor": 0.5})
    as_link = base.override({"scale_up_efficiency": (0.5 if zero else 1) * 4 * base.scale_up_efficiency,
                             "shared_memory_bandwidth_factor": 1})
    dp = lambda layout, a: float(predict_training(model, hardware, layout, assumptions=a).time_s["data_parallel"].reshape(-1)[0])  # noqa: E731
    alone = Layout.of(dp=4, zero=zero, micro_batch=2, global_batch=16, seq=1024)
    assert dp(alone, slower) == pytest.approx(dp(alone, as_link), rel=1e-12)
    beside_tensor_parallel = Layout.of(dp=2, tp=2, zero=zero, micro_batch=2, global_batch=8, seq=1024)
    assert dp(beside_tensor_parallel, slower) == pytest.approx(dp(beside_tensor_parallel, base), rel=1e-12)


def test_a_flat_matmul_fit_is_a_valid_assumption_but_a_zero_efficiency_is_not():
    """The calibration's fit may find no width dependence (w_half = 0 where narrow GEMMs ran as fast as wide ones, as
    in a CI run on a noisy 2-vCPU host, 2026-12-01): efficiency = max at every width, which the twin must accept. An
    efficiency of 0 divides the times by zero: refused, naming the field."""
    eta_max, w_half = _fit_efficiency(np.array(WIDTHS, float), np.ones(len(WIDTHS)))
    assert (eta_max, w_half) == (pytest.approx(1.0), 0.0)
    assert Assumptions().override({"matmul_half_efficiency_width": w_half}).matmul_half_efficiency_width == 0.0
    for name in ("matmul_efficiency_max", "attention_efficiency", "memory_bandwidth_efficiency", "scale_up_efficiency",
                 "scale_out_efficiency"):
        with pytest.raises(InvalidValue, match=f"assume.{name}=0.0"):
            Assumptions().override({name: 0.0})


def test_calibrate_writes_a_spec_the_twin_reads(tmp_path):
    path = tmp_path / "local.yaml"
    spec = calibrate(2, path)
    hardware, measured = resolve_hardware(None, path, "fp32")
    assumptions = resolve_assumptions(None, measured)
    assert hardware.peak_flops == spec["accelerator"]["peak_flops"]["fp32"] > 0
    assert np.isfinite(assumptions.output_projection_bytes_per_logit) and assumptions.output_projection_bytes_per_logit >= 0
    shared = "shared_memory_all_reduce_s_by_bytes" in spec["measured"]  # ranks of one x86 host: TP's own transport
    assert shared == (platform.machine() in ("x86_64", "AMD64"))
    assert (assumptions.shared_memory_latency_factor, assumptions.shared_memory_bandwidth_factor) != (1.0, 1.0) or not shared
    assert shared == ("shared_memory_all_gather_and_reduce_scatter_s_by_bytes" in spec["measured"])
    assert assumptions.shared_memory_shard_bandwidth_factor > 0
    assert assumptions.loss_bytes_per_logit > 0 and assumptions.kernel_overhead_s > 0
    assert assumptions.attention_efficiency > 0
    assert assumptions.optimizer_bytes_per_parameter > 0 and assumptions.gradient_accumulation_bytes_per_parameter > 0
    prediction = predict_training(catalog.model("SmolLM2-135M"), hardware, Layout.of(dp=2, micro_batch=1,
                                  global_batch=2, seq=128), assumptions=assumptions)
    assert np.isfinite(prediction.step_s).all()


@pytest.mark.parametrize("zero", [0, 3])
def test_gradient_accumulation_is_paid_every_microbatch_over_the_rank_s_whole_gradients(zero):
    """Every microbatch hands on all the rank's gradients (added into the accumulated ones, or copied into a bucket),
    ZeRO or not: the shards come after."""
    model, hardware = catalog.model("SmolLM2-135M"), resolve_hardware("h100", None, "bf16")[0]
    base = resolve_assumptions(None)
    more = base.override({"gradient_accumulation_bytes_per_parameter": 12.0})
    layout = Layout.of(dp=8, zero=zero, micro_batch=2, global_batch=64, seq=1024)  # 4 microbatches a rank
    step = lambda a: float(predict_training(model, hardware, layout, assumptions=a).step_s.reshape(-1)[0])  # noqa: E731
    per_microbatch = 12.0 * parameters(model).total() / (hardware.hbm_bw * base.memory_bandwidth_efficiency)
    assert step(more) - step(base) == pytest.approx(4 * per_microbatch, rel=1e-9)


def test_attention_takes_its_own_rate():
    """Training attention's FLOPs (2·s·(d_qk + d_v) a token a layer forward, three passes) at the GEMMs' rate times
    attention_efficiency; the products keep theirs."""
    model, hardware = catalog.model("SmolLM2-135M"), resolve_hardware("h100", None, "bf16")[0]
    base = resolve_assumptions(None)
    slower = base.override({"attention_efficiency": 0.5})
    layout = Layout.of(dp=1, micro_batch=2, global_batch=2, seq=1024)
    compute = lambda a: float(predict_training(model, hardware, layout, assumptions=a).time_s["compute"].reshape(-1)[0])  # noqa: E731
    gemm_rate = hardware.peak_flops * base.matmul_efficiency_max * model.hidden / (model.hidden + base.matmul_half_efficiency_width)
    attention_flops = 3 * 2 * 2 * 1024 * 1024 * 2 * model.heads * model.attention_head_dim * model.layers
    assert compute(slower) - compute(base) == pytest.approx(attention_flops / gemm_rate * (1 / 0.5 - 1), rel=1e-9)
