"""Pipeline schedules: the simulated bubble equals the analytic one; GPipe holds m microbatches and
1F1B at most p; executed for real on 2 and 4 ranks, every schedule gives the unpipelined loss and
gradients."""

import copy
import itertools

import numpy as np
import pytest
import torch
from torch.func import functional_call

from mlsyslab.comm.launch import spawn
from mlsyslab.errors import InvalidValue
from mlsyslab.nn.llama import Llama, LlamaConfig
from mlsyslab.parallel.pipeline import (PipelineRank, StageChunk, executed_timeline, forward_flops_per_token,
                                        replayed_timeline, split)
from mlsyslab.parallel.schedules import build, chrome_trace, render_png, timeline, weight_versions
from mlsyslab.predict.assumptions import DEFAULT
from mlsyslab.predict.pipeline import pipeline_bubble_fraction
from mlsyslab.predict.layout import Layout
from mlsyslab.predict.memory import microbatches_in_flight, stashed_versions

CONFIG = LlamaConfig(vocab=64, hidden=32, layers=8, heads=4, kv_heads=2, head_dim=8, ffn_hidden=48, tied_embeddings=False,
                     max_seq=64)


@pytest.mark.parametrize("name, p, m, v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 4, 1), ("interleaved", 4, 8, 2),
                                           ("interleaved", 4, 16, 4), ("pipedream", 2, 6, 1), ("1f1b", 8, 3, 1)])
def test_simulated_bubble_is_the_analytic_bubble(name, p, m, v):
    schedule = build(name, p, m, v)
    result = timeline(schedule, forward_s=1.0, backward_s=2.0)
    assert result.bubble == pytest.approx(float(pipeline_bubble_fraction(p, m, v)), abs=0.02)
    assert schedule.analytic_bubble == pytest.approx(float(pipeline_bubble_fraction(p, m, v)))


@pytest.mark.parametrize("stages", [2, 3, 5])
def test_split_balances_predicted_cost_with_the_output_layer(stages):
    """A vocabulary large beside the hidden size makes the output layer cost several layers: the split leaves the
    last stage fewer layers, and no contiguous split (one layer or more a stage) has a cheaper costliest stage."""
    model = Llama(LlamaConfig(vocab=4096, hidden=32, layers=10, heads=4, kv_heads=2, head_dim=8, ffn_hidden=48,
                              tied_embeddings=True, max_seq=64))
    layer, head = forward_flops_per_token(model.layers[0]), forward_flops_per_token(model.lm_head)
    assert layer == 2 * (4 * 32 * 32 // 2 + 2 * 32 * 16 + 3 * 32 * 48) and head == 2 * 4096 * 32  # q, o; k, v; MLP
    bounds = split(model, stages)
    assert bounds[0][0] == 0 and bounds[-1][1] == 10 and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    costliest = lambda ends: max((b - a) * layer + (head if b == 10 else 0) for a, b in zip((0, *ends), (*ends, 10)))  # noqa: E731
    assert costliest([b for _, b in bounds[:-1]]) == min(costliest(ends) for ends in itertools.combinations(range(1, 10), stages - 1))
    assert bounds[-1][1] - bounds[-1][0] < 10 // stages
    even = Llama(CONFIG)  # its output layer costs a fraction of a layer: an even split
    assert split(even, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]


@pytest.mark.parametrize("config", [
    LlamaConfig(vocab=4096, hidden=32, layers=10, heads=4, kv_heads=2, head_dim=8, ffn_hidden=48, tied_embeddings=True,
                max_seq=64),
    LlamaConfig(vocab=512, hidden=64, layers=12, heads=4, kv_heads=4, head_dim=16, ffn_hidden=96, tied_embeddings=False,
                max_seq=64),
    LlamaConfig(vocab=2048, hidden=32, layers=9, heads=4, kv_heads=2, head_dim=8, ffn_hidden=48, tied_embeddings=False,
                max_seq=64, experts=4, experts_per_token=2, expert_ffn_hidden=24, dense_layers=2),
    LlamaConfig(vocab=512, hidden=32, layers=8, heads=4, kv_heads=2, head_dim=8, ffn_hidden=96, tied_embeddings=False,
                max_seq=64, experts=8, experts_per_token=1, expert_ffn_hidden=24, dense_layers=2),
], ids=["tied, large vocabulary", "untied", "MoE after 2 dense layers", "MoE layers hold the most"])
def test_predict_splits_the_stages_as_the_pipeline_does(config):
    """predict.pipeline.stage_layers, from the architecture alone, gives each rank the layers `split` gives it from
    the built model's weights (virtual stage i on rank i mod p), the experts' layers among them too; and
    virtual_stage_costs each virtual stage's forward FLOPs per token as the built layers count them; and
    predict.memory.stage_parameters the parameters of the first rank, the last and the heaviest — a middle one where
    the split, balancing FLOPs, gives it the layers of many experts (predict once took the heavier of first and last)."""
    from mlsyslab.predict.architecture import parameters
    from mlsyslab.predict.memory import stage_parameters
    from mlsyslab.predict.pipeline import stage_layers, virtual_stage_costs

    model, spec = Llama(config), config.to_spec("probe", 1, "test")
    for p, v in ((2, 1), (3, 1), (4, 1), (2, 2), (3, 3)):
        if p * v > config.layers:
            continue
        held, moe_held, costs = [0] * p, [0] * p, []
        weights = [model.embed_tokens.weight.numel()] + [0] * (p - 2) + [0]  # a tied head: a second copy on the last
        weights[-1] += sum(w.numel() for w in (*model.norm.parameters(), *model.lm_head.parameters()))
        for stage, (first, last) in enumerate(split(model, p * v)):
            held[stage % p] += last - first
            weights[stage % p] += sum(w.numel() for layer in model.layers[first:last] for w in layer.parameters())
            moe_held[stage % p] += max(0, last - max(first, config.dense_layers)) if config.experts else 0
            costs.append(sum(forward_flops_per_token(layer) for layer in model.layers[first:last])
                         + (forward_flops_per_token(model.lm_head) if stage == p * v - 1 else 0))
        assert virtual_stage_costs(spec, p * v) == pytest.approx(costs), (p, v)
        layout = Layout.of(pp=p, schedule=2 if v > 1 else 1, interleave=v, global_batch=p, seq=64)
        predicted = stage_layers(spec, layout)
        assert (float(predicted.first), float(predicted.last)) == (held[0], held[-1]), (p, v, held)
        assert (float(predicted.first_moe), float(predicted.last_moe)) == (moe_held[0], moe_held[-1]), (p, v)
        assert float(predicted.busiest_other) in held[:-1]
        for rank, count in (("first", weights[0]), ("last", weights[-1]), ("heaviest", max(weights))):
            assert sum(float(x) for x in stage_parameters(parameters(spec), layout, predicted, rank)) == count, \
                (p, v, rank, weights)


def test_activations_in_flight():
    assert timeline(build("gpipe", 4, 8)).peak_in_flight == [8, 8, 8, 8]
    assert timeline(build("1f1b", 4, 8)).peak_in_flight == [4, 3, 2, 1]
    interleaved = timeline(build("interleaved", 4, 8, 2)).peak_in_flight[0]  # in chunks of 1/v stage
    assert interleaved / 2 == pytest.approx(4 * (1 + 3 / (4 * 2)))  # p·(1 + (p−1)/(p·v)) (Korthikanti et al.)


def test_a_split_of_unequal_stages_simulates_a_larger_bubble():
    """GPipe, 2 stages, 2 microbatches, the second stage 3x the first's work: forwards 0.5 and 1.5, backwards twice
    that; the second stage is busy 9 of the 10.5 units, the first 3: 9 idle of 21, against 1/3 for equal stages."""
    assert timeline(build("gpipe", 2, 2), stage_costs=[1, 3]).bubble == pytest.approx(9 / 21)
    assert timeline(build("gpipe", 2, 2), stage_costs=[2, 2]).bubble == pytest.approx(1 / 3)


def test_a_replay_keeps_the_actions_times_and_leaves_out_the_waits_for_data():
    """`replayed_timeline` runs the schedule at the executed actions' own times: a simulated step (unequal stages)
    replays to itself; an executed GPipe step of 2 stages and 1 microbatch (forward 1, backward 2) whose two transfers
    each took 0.25 is idle 7 of 13 rank-units, and replays to its compute alone, the analytic 1/2."""
    schedule = build("1f1b", 2, 4)
    simulated = timeline(schedule, stage_costs=[1, 1.5])
    spans = [[(action, start, end) for r, action, start, end in simulated.spans if r == rank] for rank in range(2)]
    replayed = replayed_timeline(schedule, spans)
    assert [(r, a) for r, a, *_ in replayed.spans] == [(r, a) for r, a, *_ in simulated.spans]
    assert [t for *_, start, end in replayed.spans for t in (start, end)] == pytest.approx(
        [t for *_, start, end in simulated.spans for t in (start, end)])
    gpipe = build("gpipe", 2, 1)
    (forward, backward), _ = gpipe.actions
    executed = [[(forward, 0.0, 1.0), (backward, 4.5, 6.5)], [(forward, 1.25, 2.25), (backward, 2.25, 4.25)]]
    assert executed_timeline(gpipe, executed).bubble == pytest.approx(7 / 13)
    assert replayed_timeline(gpipe, executed).bubble == pytest.approx(1 / 2) == gpipe.analytic_bubble


@pytest.mark.parametrize("name, p, v", [("gpipe", 3, 1), ("1f1b", 4, 1), ("interleaved", 2, 3), ("interleaved", 4, 2),
                                     ("pipedream", 3, 1), ("interleaved", 5, 2)])
def test_predict_holds_each_stages_microbatches_in_flight_as_the_schedule_does(name, p, v):
    """predict.memory's closed form, in whole-rank units, against the schedule simulated, on every rank — also where
    m·v chunk forwards are fewer than interleaving's warm-up (m = p: it had p·(1 + (p−1)/(p·v)) > m)."""
    for m in (p, 2 * p, 3 * p):
        layout = Layout.of(pp=p, schedule=name, interleave=v, global_batch=m, micro_batch=1, seq=64)
        simulated = [held / v for held in timeline(build(name, p, m, v)).peak_in_flight]
        assert [float(microbatches_in_flight(layout, rank)) for rank in range(p)] == pytest.approx(simulated), m


def test_predict_prices_the_rank_holding_the_most_activations():
    """Uneven stages: with one layer on the first rank and two on the next (the split, balancing FLOPs, gives the
    first fewer here), rank 1's 2 × (p − 1) microbatch-layers under 1F1B outweigh rank 0's 1 × p; predict's memory per
    GPU takes the most of any rank, as each rank's layers (the split's) times its microbatches in flight (the
    schedule's) give it (it took the first rank's: half)."""
    from mlsyslab.predict.memory import _activations, training_memory
    from mlsyslab.predict.pipeline import virtual_stage_layers

    spec, p, m = CONFIG.to_spec("probe", 1, "test"), 5, 10  # 8 layers over 5 ranks: 1, 2, 2, 2, 1
    layout = Layout.of(pp=p, schedule="1f1b", global_batch=m, micro_batch=1, seq=64)
    layers = [held for held, _ in virtual_stage_layers(spec, p)]
    per_layer = float(np.asarray(_activations(spec, layout, DEFAULT)[0]).reshape(-1)[0])
    held = [count * per_layer * peak for count, peak in zip(layers, timeline(build("1f1b", p, m)).peak_in_flight)]
    assert max(held) > held[0]
    predicted = float(np.asarray(training_memory(spec, layout, 80e9).activations).reshape(-1)[0])
    assert predicted == pytest.approx(max(held))


def test_pipedream_weight_stashing_versions():
    versions = weight_versions(build("pipedream", 4, 8))
    assert versions[3] == {i: i for i in range(8)}  # the last stage updates after every microbatch
    assert versions[0][4] == 1 and versions[0][3] == 0  # the first stage lags: p − 1 forwards in flight


def test_traces_render(tmp_path):
    schedule = build("interleaved", 4, 8, 2)
    result = timeline(schedule)
    render_png(schedule, result, str(tmp_path / "pipeline.png"))
    assert (tmp_path / "pipeline.png").stat().st_size > 1000
    assert '"traceEvents"' in chrome_trace(result)


def _run(rank, name, microbatches, chunks):
    torch.manual_seed(0)
    reference = Llama(CONFIG).initialize(generator=torch.Generator().manual_seed(3))
    ids = torch.randint(0, CONFIG.vocab, (microbatches * 2, 9), generator=torch.Generator().manual_seed(4))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    model = copy.deepcopy(reference)
    logits = reference(inputs)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, CONFIG.vocab), targets.reshape(-1))
    loss.backward()
    schedule = build(name, rank.world_size, microbatches, chunks)
    pipeline = PipelineRank(model, rank, schedule)
    ours, spans = pipeline.step(inputs, targets)
    errors = {}
    bounds = split(model, rank.world_size * chunks)
    for chunk_index, chunk in enumerate(pipeline.chunks):
        first, last = bounds[schedule.virtual_stage(rank.rank, chunk_index)]
        for offset, layer in enumerate(chunk.layers):
            for (name_, mine), (_, full) in zip(layer.named_parameters(), reference.layers[first + offset].named_parameters()):
                errors[f"layer{first + offset}.{name_}"] = (mine.grad - full.grad).abs().max().item()
        if chunk.embed is not None:
            errors["embed"] = (chunk.embed.weight.grad - reference.embed_tokens.weight.grad).abs().max().item()
        if chunk.head is not None:
            errors["head"] = (chunk.head.weight.grad - reference.lm_head.weight.grad).abs().max().item()
    return ours, loss.item(), errors, pipeline.peak_activations


@pytest.mark.parametrize("world, name, microbatches, chunks", [
    (2, "gpipe", 4, 1), (2, "1f1b", 4, 1), (2, "interleaved", 4, 2),
    (4, "gpipe", 4, 1), (4, "1f1b", 8, 1), (4, "interleaved", 4, 2),
    (3, "1f1b", 6, 1), (3, "interleaved", 6, 2),  # 8 layers over 3 and 6 stages: unequal ones
])
def test_executed_pipeline_equals_the_unpipelined_model(world, name, microbatches, chunks):
    results = spawn(_run, world, name, microbatches, chunks)
    losses = [ours for ours, _, _, _ in results if ours is not None]
    assert len(losses) == 1 and losses[0] == pytest.approx(results[0][1], rel=1e-5)
    for _, _, errors, _ in results:
        assert max(errors.values()) < 1e-5, errors
    peaks = [peak for *_, peak in results]
    if name == "gpipe":
        assert peaks[0] == microbatches
    if name == "1f1b":
        assert peaks[0] <= world


def _pipedream_data(microbatches):
    reference = Llama(CONFIG).initialize(generator=torch.Generator().manual_seed(3))
    ids = torch.randint(0, CONFIG.vocab, (microbatches * 2, 9), generator=torch.Generator().manual_seed(4))
    return reference, ids[:, :-1], ids[:, 1:]


def _run_pipedream(rank, microbatches, lr):
    torch.manual_seed(0)
    model, inputs, targets = _pipedream_data(microbatches)
    pipeline = PipelineRank(model, rank, build("pipedream", rank.world_size, microbatches))
    optimizer = torch.optim.SGD(pipeline.chunks.parameters(), lr=lr)
    with pytest.raises(InvalidValue, match="optimizer"):
        pipeline.step(inputs, targets)
    held = []
    real_update = pipeline.stashes[0].update
    pipeline.stashes[0].update = lambda mb, opt: (held.append(pipeline.stashes[0].versions_held), real_update(mb, opt))
    loss, spans = pipeline.step(inputs, targets, optimizer)
    weights = {name: parameter.detach().clone() for name, parameter in pipeline.chunks[0].named_parameters()}
    return loss, weights, dict(pipeline.stashes[0].used), max(held)


def _pipedream_replay(stages, microbatches, lr):
    """One process, no pipeline: microbatch j runs forward and backward through every stage at the weight
    version `weight_versions` gives it there; stage s's k-th update applies microbatch k's gradient."""
    model, inputs, targets = _pipedream_data(microbatches)
    chunks = [StageChunk(model, *bounds) for bounds in split(model, stages)]
    versions = weight_versions(build("pipedream", stages, microbatches))
    history = [[{n: p.detach().clone() for n, p in chunk.named_parameters()}] for chunk in chunks]
    losses = []
    for j, (x, y) in enumerate(zip(inputs.chunk(microbatches), targets.chunk(microbatches))):
        used = [{n: t.clone().requires_grad_() for n, t in history[s][versions[s][j]].items()} for s in range(stages)]
        for chunk, weights in zip(chunks, used):
            x = functional_call(chunk, weights, (x,))
        loss = torch.nn.functional.cross_entropy(x.reshape(-1, CONFIG.vocab), y.reshape(-1))
        loss.backward()
        losses.append(loss.item())
        for s in range(stages):
            history[s].append({n: history[s][-1][n] - lr * used[s][n].grad for n in used[s]})
    return sum(losses) / microbatches, [h[-1] for h in history], versions


@pytest.mark.parametrize("world, microbatches", [(2, 2), (2, 6), (4, 8)])
def test_pipedream_executes_weight_stashing(world, microbatches):
    """Each rank updates after every backward; a microbatch's backward uses the weights its forward used.
    The executed pipeline ends with exactly the weights of a single-process replay of those versions,
    and stage r holds the weight versions predict says at most: min(p − r, max(1, m − p + r + 1)) (at m = p = 2 the
    first stage one, where predict once said two)."""
    lr = 0.5  # large, so that a backward on the wrong version would move the weights visibly
    results = spawn(_run_pipedream, world, microbatches, lr)
    loss, final, versions = _pipedream_replay(world, microbatches, lr)
    assert [r[0] for r in results if r[0] is not None] == [pytest.approx(loss, rel=1e-5)]
    for rank, (_, weights, used, held) in enumerate(results):
        assert used == versions[rank]
        assert held == stashed_versions(world, microbatches, rank)
        assert max(abs(weights[n] - final[rank][n]).max().item() for n in weights) < 1e-5
    assert versions[0] != {i: i for i in range(microbatches)}  # the first stage really lags
