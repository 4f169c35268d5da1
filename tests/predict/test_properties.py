"""Property tests: monotonicity, conservation, and that feasibility means what it says."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlsyslab.errors import InvalidValue
from mlsyslab.predict.architecture import parameters
from mlsyslab.predict.hardware import Hardware
from mlsyslab.predict.inference import predict_inference
from mlsyslab.predict.layout import Layout
from mlsyslab.predict.memory import model_state_bytes, stage_parameters
from mlsyslab.predict.pipeline import balanced_split, stage_layers
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
    one, sharded = Layout.of(tp=1), Layout.of(tp=tp)
    dense_1, experts_1 = stage_parameters(counts, one, stage_layers(model, one))
    dense_t, experts_t = stage_parameters(counts, sharded, stage_layers(model, sharded))
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


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([1.0, 1.5, 2.0, 3.0]), min_size=1, max_size=9), st.integers(1, 9),
       st.sampled_from([0.0, 0.5, 2.7, 8.0]))
def test_balanced_split_has_the_cheapest_costliest_stage(costs, stages, tail):
    """No contiguous split (one layer or more a stage) has a cheaper costliest stage, and among those none is more
    even (sum of squared stage costs)."""
    stages = min(stages, len(costs))
    layers = len(costs)
    score = lambda bounds: (max(sum(costs[i:j]) + (tail if j == layers else 0.0) for i, j in bounds),  # noqa: E731
                            sum((sum(costs[i:j]) + (tail if j == layers else 0.0)) ** 2 for i, j in bounds))
    bounds = balanced_split(costs, stages, tail)
    assert [i for i, _ in bounds][0] == 0 and bounds[-1][1] == layers
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(bounds, bounds[1:]))
    scores = [score(list(zip((0, *ends), (*ends, layers)))) for ends in itertools.combinations(range(1, layers), stages - 1)]
    least = min(worst for worst, _ in scores)
    most_even = min(squares for worst, squares in scores if worst <= least * (1 + 1e-9))  # sums round differently
    assert score(bounds) == pytest.approx((least, most_even))


@pytest.mark.parametrize("seq", [8192, 10**8])
def test_recomputation_adds_flops_at_any_sequence_length(seq):
    """Selective and full recomputation add FLOPs (hfu > mfu) at 1e8 tokens too: the step's sizes multiplied as int64
    wrapped past 9.2e18 there, and hfu came out under mfu."""
    model, hardware = catalog.model("llama-3-8b"), Hardware.of(*catalog.hardware("h100"))
    result = predict_training(model, hardware, Layout.of(dp=8, global_batch=32, seq=seq, recompute=np.array([1, 2])))
    assert np.all(np.isfinite(result.mfu)) and np.all(result.hfu > result.mfu), (result.mfu, result.hfu)


def test_stage_layers_follow_the_output_layer():
    """SmolLM2-135M's output layer costs ~8 of its 30 layers: pp = 2 holds 19 + 11 layers (the last, with the
    logits, the slowest on a tie), and the step is faster than if the last stage held 15 layers and the logits;
    DeepSeek-V3 (3 dense layers, then 58 MoE) at pp = 4: the last rank holds fewer, a middle one is the slowest."""
    smol = catalog.model("SmolLM2-135M")
    layouts = Layout.of(pp=[1, 2, 5], global_batch=8, micro_batch=1, seq=512)
    stages = stage_layers(smol, layouts)
    assert stages.first.tolist() == [30, 19, 7] and stages.last.tolist() == [30, 11, 1]
    assert stages.busiest_other.tolist() == [0, 19, 8]
    deepseek = catalog.model("DeepSeek-V3")
    split4 = stage_layers(deepseek, Layout.of(pp=4, global_batch=64, micro_batch=1, seq=512))
    assert (float(split4.first), float(split4.first_moe), float(split4.last)) == (16, 13, 14)
    assert float(split4.busiest_other) == 16 and float(split4.busiest_other_moe) == 16
    interleaved = stage_layers(smol, Layout.of(pp=2, schedule=2, interleave=3, global_batch=8, micro_batch=1, seq=512))
    assert float(interleaved.first) + float(interleaved.last) == 30 and float(interleaved.first) > 15
    hardware = Hardware.of(*catalog.hardware("dgx-h100"))
    pp2 = Layout.of(pp=2, global_batch=8, micro_batch=1, seq=512)
    balanced = predict_training(smol, hardware, pp2)
    even = predict_training(smol.model_copy(update={"layers": 15}), hardware, Layout.of(pp=1, global_batch=8,
                                                                                         micro_batch=1, seq=512))
    assert balanced.time_s["compute"] < even.time_s["compute"]
    first = predict_training(smol, hardware, pp2, stage="first")
    assert first.wire_bytes["pipeline_p2p"] == balanced.wire_bytes["pipeline_p2p"]
    with pytest.raises(InvalidValue, match="stage"):
        predict_training(smol, hardware, pp2, stage="last")
