"""Composing the parallelisms on a device mesh: DP × PP × CP × TP (Narayanan et al. 2021, "3D"), and EP
inside DP.

The ranks form a mesh of shape (pp, dp, cp, tp) — tensor parallelism innermost, so its frequent
collectives stay inside a node, pipeline outermost, as Megatron-Core orders them — built with
torch's `init_device_mesh`. Each rank gets a `Rank` per dimension (its index and process group
there). Expert parallelism splits the data-parallel dimension, as DeepSpeed-MoE and Megatron-Core do:
each DP group is cut into EP groups of `ep` consecutive ranks that share their MoE layers' experts
(each holds E/ep of them, parallel/expert.py) while every rank keeps its own batch rows; the ranks that
hold the same experts in different EP groups form the expert-data-parallel group (`edp`, dp/ep ranks).
A layout that cannot work is rejected before anything starts, naming the dimension and why.
`composed_step` runs one training step of the nn/ Llama with all of them: TP splits each layer,
PP runs the 1F1B schedule between the stages (vocab-parallel loss on the last), CP shards the
sequence with ring attention (its gradients summed over the CP group), EP exchanges each MoE layer's
routed tokens inside its group, and DP averages the gradients — expert weights over their `edp` group,
since an expert's gradient already sums the tokens every rank of its EP group sent it.
Under CP an MoE layer routes each rank's share of the sequence on its own (expert capacity and the
load-balancing loss over those tokens, as under DP), and an expert's gradient is summed over the CP
ranks, which hold the same experts.
CP composes with DP, TP and PP: each TP rank's ring carries its own heads' K/V, the vocabulary-parallel loss takes
the rank's share of the targets, and under PP every stage holds the rank's share of each sequence (what crosses the
pipeline is [b, s/cp, h]) and attends through the ring of its CP group.
Held against the single-process model in tests/parallel/test_mesh.py (DP2 × PP2 × TP2 on 8 ranks,
DP2 × CP2, CP2 × TP2 and CP2 × PP2 on 4, an MoE model on DP4 with EP2, on DP2 with EP2, on CP2, on DP2 (EP2) × CP2,
on PP2, on DP2 (EP2) × PP2, on DP2 (EP2) × TP2, on CP2 × TP2 and on CP2 × PP2).
`mlsys train --tp/--pp/--cp/--dp/--ep` runs it (train.trainer.train_on_mesh); given `logs` (a CommLog
per dimension), every byte each dimension sends is counted there. Under PP each stage adds its MoE
layers' balancing loss itself (parallel/pipeline.py); under TP every expert is split
(parallel.tensor.TensorParallelExperts), and under TP × EP each TP slice of the experts is spread over
the EP ranks of its TP index (parallel.expert.ExpertDispatch). ZeRO (parallel/mesh_zero.py) runs with
any layout (under PP with ZeRO-2 and -3 the tied embedding's gradient is summed slice by slice:
`tied_gradient`); under CP every stage shards over DP × CP, and under EP the experts over the DP × CP
ranks holding the same experts (`edcp`). Clipping by the whole model's gradient norm: parallel/clipping.py.
"""

from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from mlsyslab.comm.launch import Rank
from mlsyslab.comm.log import CommLog, nbytes, traced
from mlsyslab.comm.p2p import Wire
from mlsyslab.errors import InvalidValue, raise_all
from mlsyslab.measure.memory import ActivationMeter
from mlsyslab.nn.llama import Llama
from mlsyslab.nn.moe import AUX_LOSS_WEIGHT, MixtureOfExperts, load_balancing_loss
from mlsyslab.parallel.context import ring_attention, zigzag_indices
from mlsyslab.parallel.expert import ExpertDispatch, ExpertParallel
from mlsyslab.parallel.pipeline import PipelineRank, mean_cross_entropy
from mlsyslab.parallel.schedules import build
from mlsyslab.parallel.tensor import (TensorGroup, TensorParallelExperts, parallelize_llama,
                                      vocab_parallel_cross_entropy)

DIMENSIONS = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class MeshLayout:
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # inside dp: ep consecutive DP ranks share the experts

    def validate(self, model_config, world_size: int, seq: int, microbatches: int) -> None:
        """Raise InvalidValue naming every rule the layout breaks (InvalidValues when more than one)."""
        product = self.dp * self.pp * self.cp * self.tp
        if product != world_size:
            raise InvalidValue("layout", f"dp{self.dp}·pp{self.pp}·cp{self.cp}·tp{self.tp}={product}",
                               f"a product equal to the {world_size} ranks")
        broken = []
        for name, value, divides, what in (("tp", self.tp, model_config.heads, "attention heads"),
                                           ("tp", self.tp, model_config.kv_heads, "KV heads"),
                                           ("tp", self.tp, model_config.vocab, "vocabulary rows"),
                                           ("tp", self.tp, model_config.ffn_hidden, "MLP hidden units"),
                                           ("tp", self.tp, model_config.expert_hidden, "expert hidden units")):
            if divides % value:
                broken.append(InvalidValue(name, value, f"a divisor of the {divides} {what}"))
        if self.pp > model_config.layers:  # uneven stages are fine: parallel.pipeline.split balances their cost
            broken.append(InvalidValue("pp", self.pp, f"at most the {model_config.layers} layers (a layer per stage)"))
        if self.cp > 1 and seq % (2 * self.cp):
            broken.append(InvalidValue("cp", self.cp, f"2·cp (zig-zag: 2·cp chunks) dividing the {seq} tokens of a "
                                       "sequence"))
        if self.ep > 1 and not model_config.experts:
            broken.append(InvalidValue("ep", self.ep, "1 for a dense model (no expert layers to split)"))
        else:
            for name, value, divides, what in (("ep", self.ep, self.dp, "data-parallel ranks (EP splits DP)"),
                                               ("ep", self.ep, model_config.experts or 1, "experts")):
                if divides % value:
                    broken.append(InvalidValue(name, value, f"a divisor of the {divides} {what}"))
        if microbatches < self.pp:
            broken.append(InvalidValue("microbatches", microbatches, f">= pp={self.pp} to fill the pipeline; a step's "
                                       "microbatches are the sequences per data-parallel rank over the micro-batch"))
        raise_all(broken)


@dataclass(frozen=True)
class MeshRanks:
    layout: MeshLayout
    pp: Rank
    dp: Rank
    cp: Rank
    tp: Rank
    ep: Rank | None  # the DP ranks sharing this rank's experts (None when ep = 1)
    edp: Rank  # the DP ranks holding the same experts as this one (all of DP when ep = 1)
    dcp: Rank  # the DP and CP ranks together, which hold the same weights: ZeRO's group (DP when cp = 1)
    edcp: Rank  # the DP and CP ranks holding the same experts: the experts' ZeRO group (edp when cp = 1)


def build_mesh(rank: Rank, layout: MeshLayout) -> MeshRanks:
    """This rank's place in each dimension of the (pp, dp, cp, tp) mesh, and in EP and EDP inside DP."""
    mesh = init_device_mesh(rank.device.type, tuple(getattr(layout, d) for d in DIMENSIONS), mesh_dim_names=DIMENSIONS)
    ranks = {name: _rank_in(rank, mesh.get_group(name), mesh.get_local_rank(name)) for name in DIMENSIONS}
    grids = mesh.mesh.permute(0, 3, 1, 2).reshape(-1, layout.dp, layout.cp)  # the DP × CP ranks of each (pp, tp)
    # new_subgroups_by_enumeration makes every group on every rank (in one order) and returns this rank's
    ranks["dcp"] = ranks["dp"] if layout.cp == 1 else _rank_in(rank, dist.new_subgroups_by_enumeration(
        [grid.reshape(-1).tolist() for grid in grids])[0])
    if layout.ep == 1:  # no expert groups to make (every start of a mesh would pay for them)
        return MeshRanks(layout, **ranks, ep=None, edp=ranks["dp"], edcp=ranks["dcp"])
    dp_lines = mesh.mesh.permute(0, 2, 3, 1).reshape(-1, layout.dp).tolist()  # every DP group, in DP order
    ep, edp = layout.ep, layout.dp // layout.ep
    ranks["ep"] = _rank_in(rank, dist.new_subgroups_by_enumeration(
        [line[i * ep:(i + 1) * ep] for line in dp_lines for i in range(edp)])[0])
    ranks["edp"] = _rank_in(rank, dist.new_subgroups_by_enumeration(
        [line[j::ep] for line in dp_lines for j in range(ep)])[0])
    ranks["edcp"] = ranks["edp"] if layout.cp == 1 else _rank_in(rank, dist.new_subgroups_by_enumeration(
        [grid[j::ep].reshape(-1).tolist() for grid in grids for j in range(ep)])[0])
    return MeshRanks(layout, **ranks)


def expert_parameters(model: torch.nn.Module) -> set[int]:
    """The ids of the parameters of `model`'s experts: under EP each EP rank holds different ones, so
    they are reduced over `edp` (`edcp` under ZeRO), not over DP."""
    return {id(p) for module in model.modules() if isinstance(module, MixtureOfExperts)
            for p in module.experts.parameters()}


def _rank_in(rank: Rank, group, local: int | None = None) -> Rank:
    return replace(rank, rank=dist.get_rank(group) if local is None else local, world_size=dist.get_world_size(group),
                   group=group, peers=tuple(dist.get_process_group_ranks(group)))


def composed_step(model: Llama, mesh: MeshRanks, inputs: torch.Tensor, targets: torch.Tensor, microbatches: int,
                  pipeline: PipelineRank | None = None, logs: dict | None = None,
                  reduce_data_parallel: bool = True, tied_gradient=None, optimizer=None,
                  meter: ActivationMeter | None = None) -> float:
    """Forward and backward of this rank's share of a global batch; returns the global mean loss.

    `inputs`/`targets` are the global batch [B, s]; DP takes rows, CP takes zig-zag columns, and the DP
    share runs as `microbatches` (the pipeline's under PP; otherwise one after the other, their gradients
    accumulating: an MoE model routes each on its own, as under DP). Each CP rank backpropagates the mean loss
    over its (equal) share of the tokens, so the whole's is the mean over CP: gradients end averaged over CP and
    DP on every rank — unless `reduce_data_parallel` is False: then the caller's ZeRO averages them over
    DP × CP (`MeshRanks.dcp`, as Megatron's distributed optimizer). An MoE model's loss includes
    `AUX_LOSS_WEIGHT` times its load-balancing loss (over each rank's own tokens).
    `tied_gradient()`, under PP with ZeRO-2 or -3 (whose backward leaves only this rank's slice of each
    gradient, `ZeroDataParallel.shard_gradient`; under ZeRO-3 the module holds no weight to ask): the
    tensor to sum over the pipeline for the tied embedding, its slice, summed slice by slice.
    `optimizer`, under the PipeDream schedule: what each stage steps after every backward (`PipelineRank.step`).
    `meter`: counts the activations each forward saves for its backward; its peak is what this rank held at once.
    """
    layout, logs = mesh.layout, logs or {}
    rows = inputs.chunk(layout.dp)[mesh.dp.rank], targets.chunk(layout.dp)[mesh.dp.rank]
    positions = None  # the rows' places in the sequence: all of it, but under CP
    if layout.cp > 1:  # this rank's zig-zag share of each sequence
        positions = zigzag_indices(rows[0].shape[1], layout.cp, mesh.cp.rank)
        rows = rows[0][:, positions], rows[1][:, positions]
    if layout.pp > 1:
        loss = pipeline.step(*rows, optimizer, meter)[0]
        loss = torch.tensor(0.0 if loss is None else loss, dtype=torch.float64)
        dist.all_reduce(loss, group=mesh.pp.group)  # only the last stage had it
        if model.config.tied_embeddings:
            _sum_tied_embedding_gradient(model, mesh.pp, logs.get("pipeline_p2p"), tied_gradient)
    else:  # the rows in microbatches whose gradients accumulate
        loss = sum(_microbatch_backward(model, mesh, x, y, positions, microbatches, logs, meter)
                   for x, y in zip(rows[0].chunk(microbatches), rows[1].chunk(microbatches)))
    if layout.cp > 1:  # each CP rank's loss is the mean over its (equal) share: their mean is the whole's
        dist.all_reduce(loss, group=mesh.cp.group)
        loss /= layout.cp
        if reduce_data_parallel:  # (ZeRO averages over DP × CP itself)
            _all_reduce_gradients(model.parameters(), mesh.cp, divisor=layout.cp, log=logs.get("context_parallel"))
    if reduce_data_parallel:
        experts = expert_parameters(model)
        _all_reduce_gradients([p for p in model.parameters() if id(p) not in experts], mesh.dp, divisor=layout.dp,
                              log=logs.get("data_parallel"))
        _all_reduce_gradients([p for p in model.parameters() if id(p) in experts], mesh.edp, divisor=layout.dp,
                              log=logs.get("data_parallel"))
    dist.all_reduce(loss, group=mesh.dp.group)
    return loss.item() / layout.dp


def _microbatch_backward(model: Llama, mesh: MeshRanks, x: torch.Tensor, y: torch.Tensor,
                         positions: torch.Tensor | None, microbatches: int, logs: dict,
                         meter: ActivationMeter | None = None) -> torch.Tensor:
    """Forward and backward of one of a rank's `microbatches` (without PP): its loss over 1/microbatches of the
    rank's rows; under CP (`positions`: their places in the sequence) this rank's zig-zag share of each sequence
    through ring attention (the mean over its tokens: see `composed_step`), under TP the vocabulary-parallel loss; an
    MoE model adds its load-balancing loss. Returns the detached share."""
    with meter.track([*model.parameters(), x, y]) if meter is not None else nullcontext():
        loss = _microbatch_loss(model, mesh, x, y, positions, microbatches, logs)
    loss.backward()
    if meter is not None:
        meter.release(meter.saved_bytes)
    return loss.detach()


def _microbatch_loss(model: Llama, mesh: MeshRanks, x: torch.Tensor, y: torch.Tensor,
                     positions: torch.Tensor | None, microbatches: int, logs: dict) -> torch.Tensor:
    """The forward of `_microbatch_backward`: the microbatch's share of the loss."""
    layout = mesh.layout
    if layout.cp > 1:  # this rank's zig-zag share of each sequence, attending through the ring
        wire = Wire(mesh.cp, logs.get("context_parallel"))
        hidden = model.hidden_states(x, positions.expand(x.shape[0], -1),
                                     lambda layer, q, k, v: ring_attention(wire, q, k, v))
        logits = model.lm_head(hidden)
    else:
        logits = model(x)
    loss = vocab_parallel_cross_entropy(logits, y, TensorGroup(mesh.tp, logs.get("tensor_parallel"))) \
        if layout.tp > 1 else mean_cross_entropy(logits, y)
    balance = load_balancing_loss(model)  # over this rank's tokens: under CP the CP ranks' mean joins the loss
    if balance is not None:
        loss = loss + AUX_LOSS_WEIGHT * balance
    return loss / microbatches


def prepare(model: Llama, mesh: MeshRanks, microbatches: int, schedule: str = "1f1b", interleave: int = 1,
            logs: dict | None = None, dtype: torch.dtype | None = None, sequence_parallel: bool = False
            ) -> tuple[Llama, PipelineRank | None]:
    """Split `model` (the same full weights on every rank) by TP (with `sequence_parallel`, the activations between
    blocks split along the sequence), then into this rank's pipeline stages.
    `dtype`: what activations cross the pipeline in (default: the model's; bf16 for a model that
    mixed-precision ZeRO casts after this)."""
    layout, logs = mesh.layout, logs or {}
    tp = TensorGroup(mesh.tp, logs.get("tensor_parallel"))
    if layout.tp > 1:
        parallelize_llama(model, tp, sequence_parallel)
    if layout.ep > 1:
        for layer in model.layers:
            if isinstance(layer.mlp, MixtureOfExperts):
                layer.mlp = ExpertParallel(layer.mlp, mesh.ep, logs.get("expert_parallel"))
            elif isinstance(layer.mlp, TensorParallelExperts):  # TP × EP: each TP slice of the experts over EP
                layer.mlp.dispatch = ExpertDispatch(layer.mlp.layer, mesh.ep, logs.get("expert_parallel"))
    if layout.pp == 1:
        return model, None
    loss = (lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, tp)) if layout.tp > 1 else None
    pipeline = PipelineRank(model, mesh.pp, build(schedule, layout.pp, microbatches, interleave),
                            log=logs.get("pipeline_p2p"), loss=loss, dtype=dtype,
                            sequence_shards=layout.tp if sequence_parallel else 1,
                            ring=Wire(mesh.cp, logs.get("context_parallel")) if layout.cp > 1 else None)
    return model, pipeline


def _all_reduce_gradients(parameters, rank: Rank, divisor: int, log: CommLog | None = None) -> None:
    """Each gradient summed over `rank`'s group, then divided by `divisor`."""
    for parameter in parameters:
        if parameter.grad is not None:
            if rank.world_size > 1:
                traced(log, "all_reduce", nbytes(parameter.grad), rank.world_size, dist.all_reduce, parameter.grad,
                       group=rank.group)
            if divisor != 1:
                parameter.grad /= divisor


def _sum_tied_embedding_gradient(model: Llama, pp: Rank, log: CommLog | None, tied_gradient=None) -> None:
    """Tied embeddings under PP: the first stage's embedding and the last stage's head are one matrix
    held twice, so their gradients are summed over the pipeline group (Megatron's embedding group;
    stages in between add zeros, into a buffer they drop: kept as their `.grad`, which no optimizer of theirs
    clears, it added the last step's sum again at every step) and both copies take the same step. Under ZeRO-2
    and -3 each rank sums its slice (the same slice on both stages: the matrix has a ZeRO bucket, or unit, of its
    own), 1/N of the bytes."""
    if tied_gradient is not None:
        gradient = tied_gradient()
    else:
        weight = model.embed_tokens.weight
        gradient = weight.grad if weight.grad is not None else torch.zeros(weight.shape, dtype=weight.dtype,
                                                                            device=pp.device)  # meta off the ends
    traced(log, "all_reduce", nbytes(gradient), pp.world_size, dist.all_reduce, gradient, group=pp.group)
