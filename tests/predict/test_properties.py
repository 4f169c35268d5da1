"""Property tests: monotonicity, conservation, and that feasibility means what it says."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mlsyslab.predict.architecture import parameters
from mlsyslab.predict.hardware import Hardware
from mlsyslab.predict.inference import predict_inference
from mlsyslab.predict.layout import Layout
from mlsyslab.predict.memory import model_state_bytes, stage_parameters
from mlsyslab.predict.planner import plan
from mlsyslab.predict.training import predict_training
from mlsyslab.specs import catalog

MODELS = ["gpt2", "llama-3-8b", "llama-2-70b", "mixtral-8x7b", "deepseek-v3", "qwen2.5-7b"]
HARDWARE = ["h100", "a100", "mi300x", "tpu-v5p", "b200"]
FIELDS = ["peak_flops", "hbm_bw", "scale_up_bw", "scale_out_bw", "pcie_bw"]


@st.composite
def scenarios(draw):
    model = catalog.model(draw(st.sampled_from(MODELS)))
    hardware = Hardware.of(*catalog.hardware(draw(st.sampled_from(HARDWARE))))
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if model.heads % t == 0]))
    pp = draw(st.sampled_from([p for p in (1, 2, 4) if model.layers % p == 0]))
    cp = draw(st.sampled_from([1, 2, 4]))
    dp = draw(st.sampled_from([1, 2, 4, 8, 16]))
    ep = draw(st.sampled_from([e for e in (1, 2, 4, 8) if dp % e == 0 and (model.moe or e == 1)
                               and (model.moe is None or model.moe.experts % e == 0)]))
    micro = draw(st.sampled_from([1, 2, 4]))
    layout = Layout.of(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=draw(st.integers(0, 3)), micro_batch=micro,
                       global_batch=dp * micro * draw(st.sampled_from([1, 4, 16])), seq=draw(st.sampled_from([1024, 4096])),
                       recompute=draw(st.integers(0, 2)), schedule=draw(st.sampled_from([0, 1, 3])),
                       sequence_parallel=draw(st.booleans()), offload=draw(st.booleans()))
    return model, hardware, layout


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.sampled_from(FIELDS), st.floats(1.0, 10.0))
def test_more_bandwidth_or_flops_is_never_slower_to_train(scenario, field, factor):
    model, hardware, layout = scenario
    before = predict_training(model, hardware, layout).step_s
    after = predict_training(model, hardware.scaled(**{field: factor}), layout).step_s
    assert np.all(after <= before * (1 + 1e-12))


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(MODELS), st.sampled_from(HARDWARE), st.sampled_from(FIELDS), st.floats(1.0, 10.0),
       st.integers(1, 512), st.integers(16, 8192), st.sampled_from([1, 2, 4, 8]))
def test_more_bandwidth_or_flops_is_never_slower_to_serve(name, chip, field, factor, batch, prompt, tp):
    model, hardware = catalog.model(name), Hardware.of(*catalog.hardware(chip))
    before = predict_inference(model, hardware, batch, prompt, 128, tp)
    after = predict_inference(model, hardware.scaled(**{field: factor}), batch, prompt, 128, tp)
    assert after.ttft_s <= before.ttft_s * (1 + 1e-12) and after.itl_s <= before.itl_s * (1 + 1e-12)


@settings(max_examples=100, deadline=None)
@given(st.floats(1e6, 1e12), st.integers(1, 1024), st.integers(0, 3), st.sampled_from(["adam", "sgd"]))
def test_zero_shards_add_up_to_the_unsharded_states(psi, n, stage, optimizer):
    whole = model_state_bytes(psi, 1, 0, optimizer)
    shard = model_state_bytes(psi, n, stage, optimizer)
    for sharded_from, whole_part, shard_part in zip((3, 2, 1), whole, shard):
        expected = whole_part / n if stage >= sharded_from else whole_part
        assert np.isclose(shard_part, expected)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(MODELS), st.sampled_from([1, 2, 4, 8]))
def test_tensor_parallel_shards_add_up_to_the_model(name, tp):
    """t ranks hold the sharded weights once and the replicated ones (norms, router) t times."""
    model = catalog.model(name)
    counts = parameters(model)
    dense_1, experts_1 = stage_parameters(counts, Layout.of(tp=1))
    dense_t, experts_t = stage_parameters(counts, Layout.of(tp=tp))
    replicated = counts.layers * counts.layer_norms + counts.final_norm + counts.moe_layers * counts.router
    assert np.isclose(dense_1 + experts_1, counts.total() - counts.extra)
    assert np.isclose(tp * (dense_t + experts_t) - (tp - 1) * replicated, dense_1 + experts_1)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(MODELS), st.sampled_from(HARDWARE), st.sampled_from([8, 64, 256]), st.sampled_from([64, 512]),
       st.sampled_from([2048, 8192]))
def test_planner_ranks_only_feasible_layouts_and_they_fit(name, chip, gpus, global_batch, seq):
    model, hardware = catalog.model(name), Hardware.of(*catalog.hardware(chip))
    result = plan(model, hardware, gpus, global_batch, seq)
    assert np.all(result.feasible[result.ranked])
    assert len(result.ranked) == result.feasible.sum()
    assert result.evaluated == len(result.ranked) + sum(result.infeasible.values())
    best, prediction = result.top(len(result.ranked))
    assert np.all(prediction.feasible) and np.all(prediction.memory.total <= prediction.memory.capacity)
    layouts = result.layouts
    assert np.all(layouts.gpus == gpus)
    assert np.all(layouts.tp <= hardware.scale_up_domain) and np.all(model.heads % layouts.tp == 0)
    assert np.all(np.diff(result.tokens_per_s[result.ranked]) <= 0)
    assert np.allclose(prediction.tokens_per_s, result.tokens_per_s[result.ranked])
