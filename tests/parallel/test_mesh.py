"""Parallelisms composed on a mesh: the first 10 losses of DP2 × PP2 × TP2 (8 ranks), of DP2 × CP2, CP2 × TP2 and
CP2 × PP2 (4 ranks) and of an MoE model on DP × EP, CP, DP2 (EP2) × CP2, CP2 × TP2 and CP2 × PP2 (4 ranks) equal the
single-process run's, and so do an MoE model's under ZeRO with EP; impossible layouts are rejected with the reason."""

import copy
import dataclasses

import pytest
import torch

from mlsyslab.comm.launch import spawn
from mlsyslab.errors import InvalidValue, InvalidValues
from mlsyslab.nn.llama import Llama, LlamaConfig
from mlsyslab.nn.moe import AUX_LOSS_WEIGHT, MixtureOfExperts, load_balancing_loss
from mlsyslab.parallel.clipping import clip_gradients, piece_weights
from mlsyslab.parallel.context import zigzag_indices
from mlsyslab.parallel.mesh import MeshLayout, build_mesh, composed_step, expert_parameters, prepare
from mlsyslab.parallel.mesh_zero import MeshZero
from mlsyslab.parallel.tensor import split_parameters

CONFIG = LlamaConfig(vocab=64, hidden=32, layers=4, heads=4, kv_heads=2, head_dim=8, ffn_hidden=48, tied_embeddings=False,
                     max_seq=64)
MOE = dataclasses.replace(CONFIG, experts=4, experts_per_token=2, dense_layers=1)
TIED, TIED_MOE = (dataclasses.replace(config, tied_embeddings=True) for config in (CONFIG, MOE))
STEPS, BATCH, SEQ, MICROBATCHES = 10, 8, 16, 2
CLIP_STEPS, MAX_NORM = 3, 0.5


def _batch(step):
    ids = torch.randint(0, CONFIG.vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    return ids[:, :-1], ids[:, 1:]


def _model(config=CONFIG):
    return Llama(config).initialize(generator=torch.Generator().manual_seed(7)).double()


def _optimizer(parameters):
    return torch.optim.AdamW(list(parameters), lr=1e-2, weight_decay=0.0, foreach=False)


def _single_process():
    model = _model()
    optimizer = _optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        inputs, targets = _batch(step)
        loss = torch.nn.functional.cross_entropy(model(inputs).reshape(-1, CONFIG.vocab), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _route_by_sequence_shards(model, cp):
    """Make every MoE layer route each of the `cp` zig-zag shards of the sequence on its own, as the CP
    ranks do (capacity and load-balancing loss per shard, the layer's loss their mean)."""
    shards = [zigzag_indices(SEQ, cp, rank) for rank in range(cp)]
    for module in model.modules():
        if isinstance(module, MixtureOfExperts):
            whole = module.forward

            def forward(x, residual=None, whole=whole, module=module):
                out, losses = torch.empty_like(x), []
                for positions in shards:
                    out[:, positions] = whole(x[:, positions])
                    losses.append(module.last_routing.aux_loss)
                module.last_routing = dataclasses.replace(module.last_routing, aux_loss=torch.stack(losses).mean())
                return out if residual is None else residual + out

            module.forward = forward


def _sgd(parameters):
    """Plain SGD: a gradient off by a constant factor changes the losses (Adam's update would hide it)."""
    return torch.optim.SGD(list(parameters), lr=0.5)


def _moe_single_process(shards, cp=1, optimizer=_optimizer, config=MOE, max_norm=0.0, steps=STEPS):
    """One process, the global batch in `shards` parts whose gradients accumulate: what data parallelism
    computes for an MoE model, each part routed on its own (expert capacity and the load-balancing
    loss are per rank's tokens under DP, as in Megatron-LM and DeepSpeed-MoE), and each part's sequence
    in `cp` shards routed on their own (as under context parallelism). With `max_norm` the gradient is
    clipped by torch's clip_grad_norm_. Returns the losses and the norms before clipping."""
    model = _model(config)
    if cp > 1:
        _route_by_sequence_shards(model, cp)
    optimizer = optimizer(model.parameters())
    losses, norms = [], []
    for step in range(steps):
        optimizer.zero_grad()
        total = 0.0
        for inputs, targets in zip(*(part.chunk(shards) for part in _batch(step))):
            loss = torch.nn.functional.cross_entropy(model(inputs).reshape(-1, config.vocab), targets.reshape(-1))
            balance = load_balancing_loss(model)
            loss = loss if balance is None else loss + AUX_LOSS_WEIGHT * balance
            (loss / shards).backward()
            total += loss.item() / shards
        if max_norm:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        losses.append(total)
    return losses, norms


def _composed(rank, layout, config=CONFIG):
    layout.validate(config, rank.world_size, SEQ, MICROBATCHES)
    mesh = build_mesh(rank, layout)
    model, pipeline = prepare(copy.deepcopy(_model(config)), mesh, MICROBATCHES)
    optimizer = _optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        losses.append(composed_step(model, mesh, *_batch(step), MICROBATCHES, pipeline))
        optimizer.step()
    return losses


@pytest.mark.parametrize("layout, world", [(MeshLayout(dp=2, pp=2, tp=2), 8), (MeshLayout(dp=2, cp=2), 4),
                                           (MeshLayout(cp=2, tp=2), 4), (MeshLayout(cp=2, pp=2), 4)])
def test_composed_losses_equal_the_single_process_run(layout, world):
    reference = _single_process()
    for losses in spawn(_composed, world, layout, timeout_s=300):
        assert losses == pytest.approx(reference, rel=1e-9)


def _slow(layout):  # CI time: each composes what the default layouts run (DP4 (EP2) the EP pair, the EP layouts CP, PP, TP)
    return pytest.param(layout, marks=pytest.mark.slow)


@pytest.mark.parametrize("layout", [
    MeshLayout(dp=4, ep=2), _slow(MeshLayout(dp=2, ep=2)), _slow(MeshLayout(cp=2)), MeshLayout(dp=2, ep=2, cp=2),
    _slow(MeshLayout(pp=2)), MeshLayout(dp=2, ep=2, pp=2), MeshLayout(dp=2, ep=2, tp=2), _slow(MeshLayout(cp=2, tp=2)),
    _slow(MeshLayout(cp=2, pp=2))])
def test_expert_parallel_inside_data_parallel_equals_the_single_process_run(layout):
    """An MoE model on DP × EP, on CP alone, on DP2 (EP2) × CP2 (4 ranks: each EP pair exchanges tokens
    inside one CP index, the expert gradients summed over CP and then over the EDP ranks), under
    PP, where each microbatch is routed on its own and each stage adds its layers' balancing loss, on
    DP2 (EP2) × TP2, each TP rank's slice of the experts exchanged with the EP rank of its TP index, and on
    CP2 × TP2 and CP2 × PP2, each CP rank's share of the sequence routed on its own (through the TP-split experts;
    in each microbatch, stage by stage)."""
    shards = layout.dp * MICROBATCHES  # each rank routes each of its microbatches on its own
    reference, _ = _moe_single_process(shards, layout.cp)
    for losses in spawn(_composed, layout.dp * layout.cp * layout.pp * layout.tp, layout, MOE, timeout_s=300):
        assert losses == pytest.approx(reference, rel=1e-9)


def _composed_with_zero(rank, layout, stage, mixed_precision=False):
    mesh = build_mesh(rank, layout)
    model, pipeline = prepare(_model(MOE).float(), mesh, MICROBATCHES,  # ZeRO's flat buffers: fp32 or bf16
                              dtype=torch.bfloat16 if mixed_precision else None)
    held = pipeline.chunks if pipeline is not None else model
    zero = MeshZero(model, held, mesh, stage, _sgd, mixed_precision=mixed_precision)
    if stage == 3 and pipeline is None:  # a decoder layer a unit (the embedding, final norm and head each their own;
        # the experts by layer), not each linear: what predict prices (two gathered layers, layers + 2 gathers a pass)
        assert [len(z.partition.units) for z in zero.zeros] == [MOE.layers + 3, MOE.layers - MOE.dense_layers]
    assert {p.dtype for p in held.parameters()} <= {torch.bfloat16 if mixed_precision else torch.float32}
    return [zero.train_step(lambda tied_gradient: composed_step(
        model, mesh, *_batch(step), MICROBATCHES, pipeline, reduce_data_parallel=False,
        tied_gradient=tied_gradient))[0] for step in range(STEPS)]


@pytest.mark.parametrize("layout, stage", [
    (MeshLayout(dp=4, ep=2), 1), (MeshLayout(dp=4, ep=2), 2), (MeshLayout(dp=4, ep=2), 3),
    (MeshLayout(dp=2, ep=2, cp=2), 3), (MeshLayout(dp=2, ep=2, pp=2), 2)])
def test_zero_with_expert_parallelism_equals_the_single_process_run(layout, stage):
    """ZeRO on an MoE model with EP: the dense weights sharded over DP × CP, the experts over the ranks
    holding the same experts (2 of DP4 (EP2); 2 of DP2 (EP2) × CP2, one per CP index), every gradient
    divided by the DP × CP size — under SGD, whose losses show a gradient off by a constant factor (an fp32
    model: a looser tolerance than the float64 runs above)."""
    shards = layout.dp * MICROBATCHES  # each rank routes each of its microbatches on its own
    reference, _ = _moe_single_process(shards, layout.cp, _sgd)
    for losses in spawn(_composed_with_zero, layout.dp * layout.cp * layout.pp, layout, stage, timeout_s=300):
        assert losses == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("layout, stage", [
    (MeshLayout(dp=2, ep=2, pp=2), 2), (MeshLayout(dp=2, ep=2, cp=2), 3), (MeshLayout(dp=2, ep=2, tp=2), 1)])
def test_mixed_precision_zero_on_the_mesh_follows_the_single_process_run(layout, stage):
    """bf16 compute (activations across the pipeline, K/V around the CP ring, tokens through EP's
    all-to-all, TP's all-reduces, gradients reduce-scattered in bf16) with fp32 master weights: under SGD
    the first 6 losses stay within 5e-4 of the float64 run's (measured: 1.3e-4 at most; bf16's rounding
    then grows chaotically, to ~7e-3 by step 10). Gradients divided by twice the DP × CP size were off by
    1e-3 at step 3 and 3.5e-3 at step 4."""
    shards = layout.dp * MICROBATCHES  # each rank routes each of its microbatches on its own
    reference, _ = _moe_single_process(shards, layout.cp, _sgd)
    for losses in spawn(_composed_with_zero, layout.dp * layout.cp * layout.pp * layout.tp, layout, stage, True,
                        timeout_s=300):
        assert losses[:6] == pytest.approx(reference[:6], rel=5e-4)


def _composed_and_clipped(rank, layout, config, stage):
    """CLIP_STEPS steps of SGD on the mesh, each gradient clipped to MAX_NORM: without ZeRO (stage 0, fp64) or
    under it (fp32). Returns the losses and the norms before clipping."""
    mesh = build_mesh(rank, layout)
    model, pipeline = prepare(_model(config).to(torch.float32 if stage else torch.float64), mesh, MICROBATCHES)
    held = pipeline.chunks if pipeline is not None else model
    tied = (model.embed_tokens.weight,) if pipeline is not None and config.tied_embeddings else ()
    losses, norms = [], []
    if stage:
        zero = MeshZero(model, held, mesh, stage, _sgd, tied=tied)
        for step in range(CLIP_STEPS):
            loss, norm = zero.train_step(lambda tied_gradient: composed_step(
                model, mesh, *_batch(step), MICROBATCHES, pipeline, reduce_data_parallel=False,
                tied_gradient=tied_gradient), MAX_NORM)
            losses.append(loss)
            norms.append(norm)
        return losses, norms
    parameters = list(held.parameters())
    weights = piece_weights(parameters, mesh, split_parameters(held), expert_parameters(model), tied, sharded=False)
    optimizer = _sgd(parameters)
    for step in range(CLIP_STEPS):
        optimizer.zero_grad()
        losses.append(composed_step(model, mesh, *_batch(step), MICROBATCHES, pipeline))
        norms.append(clip_gradients(parameters, weights, MAX_NORM))
        optimizer.step()
    return losses, norms


@pytest.mark.parametrize("config, layout, stage", [
    (TIED, MeshLayout(pp=2, tp=2), 0), (MOE, MeshLayout(dp=2, ep=2, cp=2), 0),
    (TIED, MeshLayout(pp=4), 0),  # stages between the two tied copies (their zeros once kept the last step's sum)
    (TIED_MOE, MeshLayout(dp=2, ep=2, pp=2), 2), (MOE, MeshLayout(dp=2, ep=2, tp=2), 3)])
def test_clipping_on_the_mesh_takes_the_whole_models_norm(config, layout, stage):
    """Clipping by the global norm (parallel/clipping.py) against torch's clip_grad_norm_ on one process, every step
    clipped: the norms and the losses after each clipped SGD step. The layouts hold each piece counted once: the
    norms TP does not split (on TP rank 0), the tied embedding under PP (on the first stage), DP × CP copies (1/(dp·cp)
    each without ZeRO) and experts held by fewer of them (ep/(dp·cp)); under ZeRO-2 and -3 each rank's slices."""
    reference, norms = _moe_single_process(layout.dp * MICROBATCHES, layout.cp, _sgd, config, MAX_NORM, CLIP_STEPS)
    assert min(norms) > MAX_NORM  # every step clipped
    tolerance = 1e-5 if stage else 1e-9
    for losses, rank_norms in spawn(_composed_and_clipped, layout.dp * layout.cp * layout.pp * layout.tp, layout, config,
                                    stage, timeout_s=300):
        assert rank_norms == pytest.approx(norms, rel=tolerance)
        assert losses == pytest.approx(reference, rel=tolerance)


@pytest.mark.parametrize("layout, field", [(MeshLayout(dp=3), "layout"), (MeshLayout(tp=3, dp=1), "layout"),
                                           (MeshLayout(tp=8), "tp"), (MeshLayout(pp=8), "pp"), (MeshLayout(cp=16), "cp"),
                                           (MeshLayout(dp=2, ep=2), "ep")])  # a dense model has no experts to split
def test_impossible_layouts_are_rejected(layout, field):
    world = layout.dp * layout.pp * layout.cp * layout.tp if field != "layout" else 8
    with pytest.raises(InvalidValue, match=field):
        layout.validate(CONFIG, world, SEQ, MICROBATCHES)


def test_every_broken_rule_of_a_layout_is_named_at_once():
    """TP, PP, CP and the microbatches all wrong: one refusal names each (the first alone was named, so a layout took
    a run per rule to fix); the field is the first one's; it pickles as the engine process sends errors."""
    import pickle

    layout = MeshLayout(tp=8, pp=8, cp=16)
    with pytest.raises(InvalidValues) as error:
        layout.validate(CONFIG, 8 * 8 * 16, SEQ, 4)
    assert [e.field for e in error.value.errors] == ["tp", "pp", "cp", "microbatches"] and error.value.field == "tp"
    assert str(error.value).count("is invalid") == 4 and "\n" not in str(error.value)
    assert str(pickle.loads(pickle.dumps(error.value))) == str(error.value)
    with pytest.raises(InvalidValue) as error:  # one rule: a plain InvalidValue, as before
        MeshLayout(tp=8).validate(CONFIG, 8, SEQ, MICROBATCHES)
    assert type(error.value) is InvalidValue


def test_an_odd_sequence_is_valid_without_context_parallelism():
    """Zig-zag CP needs 2·cp chunks; with cp = 1 there are none (the mesh trainer refused an odd --seq, naming cp=1)."""
    MeshLayout(tp=2, pp=2).validate(CONFIG, 4, 63, MICROBATCHES)
    with pytest.raises(InvalidValue, match="cp"):
        MeshLayout(cp=2).validate(CONFIG, 2, 63, MICROBATCHES)


@pytest.mark.parametrize("layout, field, message", [
    (MeshLayout(dp=4, ep=3), "ep", "divisor of the 4 data-parallel"), (MeshLayout(dp=8, ep=8), "ep", "4 experts"),
    (MeshLayout(dp=2, tp=4), "tp", "KV heads")])
def test_impossible_expert_layouts_are_rejected(layout, field, message):
    with pytest.raises(InvalidValue, match=field) as error:
        layout.validate(MOE, layout.dp * layout.tp * layout.pp, SEQ, MICROBATCHES)
    assert message in str(error.value)
    MeshLayout(dp=2, tp=2).validate(MOE, 4, SEQ, MICROBATCHES)  # TP splits every expert
    MeshLayout(dp=2, tp=2, ep=2).validate(MOE, 4, SEQ, MICROBATCHES)  # and EP spreads the slices
    with pytest.raises(InvalidValue, match="tp") as error:
        MeshLayout(dp=2, tp=2).validate(dataclasses.replace(MOE, expert_ffn_hidden=33), 4, SEQ, MICROBATCHES)
    assert "33 expert hidden units" in str(error.value)

