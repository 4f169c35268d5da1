"""Closed forms from the papers hold exactly."""

import numpy as np
import pytest

from mlsyslab.predict import collectives as coll
from mlsyslab.predict.architecture import kv_bytes_per_token
from mlsyslab.predict.assumptions import DEFAULT
from mlsyslab.predict.hardware import Hardware
from mlsyslab.predict.layout import Layout
from mlsyslab.predict.memory import activation_bytes_per_layer, model_state_bytes, stashed_versions, training_memory
from mlsyslab.predict.pipeline import pipeline_bubble_fraction
from mlsyslab.predict.training import predict_training
from mlsyslab.specs import catalog
from mlsyslab.specs.schema import Model


@pytest.mark.parametrize("stage, gigabytes", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.88)])
def test_zero_paper_table_7_5b_on_64_gpus(stage, gigabytes):
    """Rajbhandari et al. 2020, Table 1: Ψ = 7.5B, N = 64, mixed-precision Adam (K = 12)."""
    total = sum(model_state_bytes(7.5e9, 64, stage))
    assert total / 1e9 == pytest.approx(gigabytes, abs=0.05)


def test_zero_stage_formulas_and_sgd():
    psi, n = 1e9, 8
    for stage, expected in enumerate([16 * psi, 4 * psi + 12 * psi / n, 2 * psi + 14 * psi / n, 16 * psi / n]):
        assert sum(model_state_bytes(psi, n, stage)) == pytest.approx(expected)
    assert sum(model_state_bytes(psi, 1, 0, optimizer="sgd")) == pytest.approx(8 * psi)  # 2 + 2 + fp32 master 4
    assert sum(model_state_bytes(psi, 1, 0, dtype="fp32")) == pytest.approx(16 * psi)  # 4 + 4 + m, v 8
    weights, gradients, optimizer = model_state_bytes(psi, n, 1, offload=True)
    assert optimizer == 0 and weights == 2 * psi


@pytest.mark.parametrize("name, expected", [("llama-3-8b", 131_072), ("llama-2-70b", 327_680), ("opt-13b", 819_200)])
def test_kv_bytes_per_token(name, expected):
    assert kv_bytes_per_token(catalog.model(name), "fp16") == expected


@pytest.mark.parametrize("p, m", [(4, 4), (4, 16), (8, 64), (2, 1)])
def test_bubble_fraction(p, m):
    assert pipeline_bubble_fraction(p, m) == pytest.approx((p - 1) / (m + p - 1))


def test_bubble_4_stages_4_microbatches_is_3_over_7():
    assert pipeline_bubble_fraction(4, 4) == pytest.approx(3 / 7)


@pytest.mark.parametrize("v", [1, 2, 3, 4])
def test_interleaved_bubble_divides_the_idle_time_by_v(v):
    p, m = 8, 32
    idle_over_ideal = pipeline_bubble_fraction(p, m, v) / (1 - pipeline_bubble_fraction(p, m, v))
    assert idle_over_ideal == pytest.approx((p - 1) / (v * m))  # Narayanan et al. 2021


@pytest.mark.parametrize("n", [2, 4, 8, 64, 1024])
def test_ring_all_reduce(n):
    size, bandwidth, alpha = 1e9, 100e9, 5e-6
    expected = 2 * (n - 1) / n * size / bandwidth + 2 * (n - 1) * alpha
    assert coll.ring_all_reduce_s(size, n, bandwidth, alpha) == pytest.approx(expected)
    assert coll.ring_all_reduce_bytes_per_rank(size, n) == pytest.approx(2 * (n - 1) / n * size)


def test_ring_all_reduce_time_is_nearly_independent_of_n_for_large_messages():
    times = coll.ring_all_reduce_s(10e9, np.array([8, 64, 512]), 50e9, 0.0)
    assert times.max() / times.min() < 2 * (1 - 1 / 512) / (2 * (1 - 1 / 8)) + 1e-9


def test_reduce_scatter_plus_all_gather_is_all_reduce():
    size, n, bandwidth, alpha = 3e8, 16, 40e9, 1e-5
    both = coll.reduce_scatter_s(size, n, bandwidth, alpha) + coll.all_gather_s(size, n, bandwidth, alpha)
    assert both == pytest.approx(coll.ring_all_reduce_s(size, n, bandwidth, alpha))


def test_hierarchical_all_reduce_within_one_domain_is_the_ring():
    args = (1e9, 8, 8, 300e9, 5e-6, 25e9, 1e-5)
    assert coll.hierarchical_all_reduce_s(*args) == pytest.approx(coll.ring_all_reduce_s(1e9, 8, 300e9, 5e-6))


def _gpt(hidden=6144, heads=64):
    return Model(name="gpt", source="test", family="gpt", hidden=hidden, layers=1, heads=heads, ffn_hidden=4 * hidden,
                 gated_mlp=False, vocab=51200, max_seq=2048, norm="layernorm", linear_bias=True, published_params=1)


@pytest.mark.parametrize("t", [1, 2, 8])
def test_korthikanti_activation_formulas(t):
    """Korthikanti et al. 2022, Table 2, for a GPT layer (MHA, 4h GELU MLP, dropout)."""
    model, s, b = _gpt(), 2048, 4
    h, a = model.hidden, model.heads
    cases = [
        (dict(sequence_parallel=False, recompute="none"), s * b * h * (10 + 24 / t + 5 * a * s / (h * t))),
        (dict(sequence_parallel=True, recompute="none"), s * b * h * (34 / t + 5 * a * s / (h * t))),
        (dict(sequence_parallel=False, recompute="selective"), s * b * h * (10 + 24 / t)),
        (dict(sequence_parallel=True, recompute="selective"), s * b * h * 34 / t),
        (dict(sequence_parallel=False, recompute="full"), 2 * s * b * h),
    ]
    for options, expected in cases:
        layout = Layout.of(tp=t, micro_batch=b, seq=s, **options)
        stored, _ = activation_bytes_per_layer(model, layout, flash_attention=False)
        assert stored == pytest.approx(expected), options


def test_pipedream_stashes_weight_versions_and_updates_per_microbatch():
    """PipeDream against 1F1B on the same layout: the same activations in flight and bubble; min(p, max(1, m − p + 1))
    more copies of the first stage's weights (with m = 64, p = 4: stage 0 owes 4 versions a backward); m optimizer updates a step instead of one, each
    followed by the copy its new version stashes."""
    model = catalog.model("llama-3-8b")
    hardware = Hardware.of(*catalog.hardware("h100"), "bf16")
    runs = {name: Layout.of(tp=4, pp=4, global_batch=64, seq=4096, schedule=name) for name in ("1f1b", "pipedream")}
    memory = {name: training_memory(model, layout, 80e9).breakdown() for name, layout in runs.items()}
    assert memory["pipedream"]["activations"] == memory["1f1b"]["activations"]
    assert memory["pipedream"]["weights"] == pytest.approx(5 * memory["1f1b"]["weights"])  # live + 4 copies
    assert memory["pipedream"]["gradients"] == memory["1f1b"]["gradients"]
    time = {name: predict_training(model, hardware, layout) for name, layout in runs.items()}
    assert float(time["pipedream"].bubble_fraction) == float(time["1f1b"].bubble_fraction)
    one, every = (float(time[name].time_s["optimizer"]) for name in ("1f1b", "pipedream"))
    assert every > 64 * one


def test_the_stashed_versions_are_the_schedules():
    """predict's count of the weight versions each PipeDream stage holds at once equals the count over its schedule's
    actions (a version is held from its first forward to its last microbatch's backward), for p = 2..8, m = p..3p."""
    from mlsyslab.parallel.schedules import build

    for p in range(2, 9):
        for m in range(p, 3 * p + 1):
            for stage, actions in enumerate(build("pipedream", p, m).actions):
                updates, version, pending, most = 0, {}, {}, 0
                for action in actions:
                    if action.kind == "F":
                        version[action.microbatch] = updates
                        pending[updates] = pending.get(updates, 0) + 1
                        most = max(most, len(pending))
                    else:
                        pending[version[action.microbatch]] -= 1
                        pending = {v: n for v, n in pending.items() if n}
                        updates += 1
                assert stashed_versions(p, m, stage) == most, (p, m, stage)


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_bubble_is_the_fill_and_drain_through_the_other_stages(pp, schedule):
    """A 4-layer model whose output layer outweighs its layers: the cost-balanced split gives the last stage one layer
    and the head, the others the rest. The step's pipeline part (m slots of the slowest stage and the bubble) is what
    the schedule takes, simulated with each stage's slot, not (m + p − 1) slots of the slowest."""
    from mlsyslab.parallel.schedules import build, timeline

    model = Model(name="head-heavy", source="test", family="llama", hidden=128, layers=4, heads=4, kv_heads=2,
                  ffn_hidden=384, vocab=49152, tied_embeddings=True, max_seq=512, published_params=7_079_040)
    hardware = Hardware.of(*catalog.hardware("h100"), "bf16")
    layout = Layout.of(pp=pp, micro_batch=1, global_batch=8, seq=128, schedule=schedule)
    slowest, first = (predict_training(model, hardware, layout, stage=stage) for stage in ("slowest", "first"))
    assert float(slowest.stages.last) == 1 and float(first.stages.first) == 4 - (pp - 1) and bool(slowest.slowest_is_last)
    slot = lambda prediction: sum(float(prediction.time_s[part]) for part in (  # noqa: E731
        "compute", "tensor_parallel", "expert_parallel", "context_parallel", "pipeline_p2p")) / 8
    costs = [slot(first)] * (pp - 1) + [slot(slowest)]  # the first stage's rank holds what each other one holds
    simulated = timeline(build(schedule, pp, 8), stage_costs=costs).makespan * sum(costs) / pp / 3  # units of a slot
    predicted = 8 * slot(slowest) + float(slowest.time_s["pipeline_bubble"])
    assert predicted == pytest.approx(simulated, rel=1e-9)
    assert predicted < (8 + pp - 1) * slot(slowest)  # the equal-stage count overstates it


def test_sequence_parallel_regathers_are_timed_where_not_hidden():
    """Under SP each column-parallel entry all-gathers its input again in backward (2 a dense layer, each s·b·h):
    hidden behind the input gradient's GEMM by default (Megatron), timed in full at overlap 0 (ours: calibrate's);
    the bytes are sent either way."""
    model, hardware = catalog.model("llama-3-8b"), Hardware.of(*catalog.hardware("h100"))
    layout = Layout.of(tp=8, global_batch=8, micro_batch=1, seq=4096, sequence_parallel=True)
    hidden = predict_training(model, hardware, layout)
    shown = predict_training(model, hardware, layout,
                             assumptions=DEFAULT.override({"sequence_parallel_regather_overlap": 0.0}))
    gather = coll.reduce_scatter_s(4096 * model.hidden * 2, 8, hardware.scale_up_bw * DEFAULT.scale_up_efficiency,
                                   DEFAULT.scale_up_latency_s)
    extra = shown.time_s["tensor_parallel"] - hidden.time_s["tensor_parallel"]
    assert float(extra) == pytest.approx(8 * 2 * model.layers * float(gather))  # 8 microbatches
    assert float(shown.wire_bytes["tensor_parallel"]) == float(hidden.wire_bytes["tensor_parallel"])
