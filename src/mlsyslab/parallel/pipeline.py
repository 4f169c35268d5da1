"""Pipeline parallelism: run a schedule (parallel/schedules.py) for real with send/recv between stages.

The model's layers are split into p·v virtual stages balanced by predicted cost (`split`: each stage's forward
FLOPs per token, the last stage's output layer included, so a small model's last stage takes fewer layers); the
first stage also embeds, the last also norms, projects and takes the loss. Rank r holds virtual stages r, r + p, ….
For each action of its list it:
- F: receives the activation from the previous virtual stage (or embeds microbatch i), runs its
  chunk, keeps input and output for backward, and sends the output on (or computes the loss);
- B: receives the output gradient from the next virtual stage (or starts from its loss), runs
  backward through the kept output, and sends the input gradient back.
Sends are asynchronous and waited at the end of the step, so a rank runs as far as its inputs allow
and the schedule's order alone decides overlap (no send/recv ordering deadlock); each receive is
posted up to `RECEIVES_AHEAD` actions early, so its transfer overlaps the actions before (gloo moves
the data only once the receive is posted; torch.distributed.pipelining posts them early too). Parameter
gradients accumulate over the microbatches; the caller's optimizer steps after the flush — except
under "pipedream", where each rank updates its weights after every backward (asynchronous 1F1B)
and stashes the version each forward used for that microbatch's backward (parallel/weight_stash.py);
there a step is a run of m microbatches, and the only flush is at its end.
An MoE model's load-balancing loss is added where its layers are: each chunk's MoE layers route each
microbatch on its own, and their α-weighted share of the model's mean balancing loss is attached to the
chunk's output by an identity whose backward adds that share's gradient (`WithLoss`, the method of
Megatron-Core's MoEAuxLossAutoScaler), so it needs no trip to the last stage; each rank returns its
shares with the loss, summed over the pipeline by the caller.
Each span of the executed timeline starts once the action's input has arrived, so the time a rank
spends waiting for its neighbour is idle time: `executed_timeline` measures the bubble from the spans, and
`replayed_timeline` the bubble the schedule itself leaves at the step's own action times (the difference: waits).
Twin: predict.pipeline (bubble), predict.memory (activations in flight). Held equal to the
unpipelined model, and PipeDream to a single-process replay, in tests/parallel/test_pipeline.py.
"""

import time
from contextlib import nullcontext
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from mlsyslab.comm.launch import Rank
from mlsyslab.comm.log import CommLog
from mlsyslab.comm.p2p import Wire
from mlsyslab.errors import InvalidValue
from mlsyslab.measure.memory import ActivationMeter
from mlsyslab.nn.llama import Llama, causal_attention, release_unheld
from mlsyslab.nn.rope import rope_cos_sin, rope_inverse_frequencies
from mlsyslab.nn.moe import AUX_LOSS_WEIGHT, MixtureOfExperts, balancing_losses
from mlsyslab.parallel.context import ring_attention, zigzag_indices
from mlsyslab.parallel.schedules import Schedule, Timeline, timeline
from mlsyslab.parallel.weight_stash import WeightStash
from mlsyslab.predict.pipeline import balanced_split


class StageChunk(nn.Module):
    """Layers [first, last) of a Llama, plus the embedding (first chunk) or norm and head (last chunk).
    `sequence_shards`: under sequence parallelism (t), what enters and leaves a chunk holds 1/t of the sequence.
    `ring`: under context parallelism, the CP group's wire: the chunk holds this rank's zig-zag share of each
    sequence (`parallel.context.zigzag_indices`) and attends through the ring."""

    def __init__(self, model: Llama, first: int, last: int, sequence_shards: int = 1, ring: Wire | None = None):
        super().__init__()
        self.config, self.sequence_shards, self.ring = model.config, sequence_shards, ring
        self.embed = model.embed_tokens if first == 0 else None
        self.layers = nn.ModuleList(model.layers[first:last])
        self.is_last = last == model.config.layers
        self.norm = model.norm if self.is_last else None
        self.head = model.lm_head if self.is_last else None

    def forward(self, x):
        tokens = x.shape[1] if self.embed is not None else x.shape[1] * self.sequence_shards  # rope's: every position
        if self.embed is not None:
            x = self.embed(x)
        if self.ring is None:
            positions, attend = torch.arange(tokens), partial(causal_attention, 0)
        else:
            positions = zigzag_indices(tokens * self.ring.size, self.ring.size, self.ring.me)
            attend = partial(ring_attention, self.ring)
        cos, sin = rope_cos_sin(rope_inverse_frequencies(self.config), positions.expand(x.shape[0], -1), x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attend)
        return self.head(self.norm(x)) if self.is_last else x


def split(model: Llama, stages: int) -> list[tuple[int, int]]:
    """[first, last) layers of each of `stages` virtual stages, at least one each, balanced by predicted cost
    (`predict.pipeline.balanced_split`: the costliest stage as cheap as it can be, then the most even). A stage costs
    its layers' and, on the last, the output layer's forward FLOPs per token (`forward_flops_per_token`; the embedding
    is a lookup). The output layer is a large share of a small model (SmolLM2-135M's costs ~8 of its 30 layers), so an
    even split of the layers would leave the last stage the pipeline's bottleneck. Every rank computes the same split."""
    layers = model.config.layers
    if stages > layers:
        raise InvalidValue("pipeline stages", stages, f"at most the {layers} layers (one or more each)")
    return balanced_split([forward_flops_per_token(layer) for layer in model.layers], stages,
                          forward_flops_per_token(model.lm_head))


def release_other_stages(model: Llama, chunks: nn.ModuleList) -> None:
    """Move every part of `model` that `chunks` do not hold (other stages' layers, the embedding off the first stage,
    the norm and head off the last) to the meta device: shapes kept, no bytes. Without it every rank kept the whole
    model it was built from, and a pipeline saved no memory of weights (llama-tiny on PP 2: rank 0 held stage 1's
    layers too). A tied embedding stays on the first stage and the last, which hold it."""
    release_unheld((*model.layers, model.embed_tokens, model.norm, model.lm_head), chunks)


def forward_flops_per_token(module: nn.Module) -> float:
    """2 × the matrix weights (2-D parameters) a token meets in `module` on this rank; in an MoE layer the router in
    full and `top_k` experts (one expert's weights, top_k times)."""
    moe = next((m for m in module.modules() if isinstance(m, MixtureOfExperts)), None)
    routed = {id(p) for p in moe.experts.parameters()} if moe is not None else set()
    dense = sum(p.numel() for p in module.parameters() if p.dim() >= 2 and id(p) not in routed)
    experts = moe.top_k * sum(p.numel() for p in moe.experts[0].parameters()) if moe is not None else 0
    return 2.0 * (dense + experts)


RECEIVES_AHEAD = 4  # actions whose inputs are in flight at once: at most 3 buffers [b, s, hidden] more.
# Measured (benchmarks/pipeline.py, p=2, m=8): receiving at use, the executed bubble of interleaved
# 1F1B was 12.8% (analytic 5.9%); one action ahead 9.6%; four 6.9%.


class PipelineRank:
    """The chunks one rank holds and the schedule it follows."""

    def __init__(self, model: Llama, rank: Rank, schedule: Schedule, log: CommLog | None = None, loss=None,
                 dtype: torch.dtype | None = None, sequence_shards: int = 1, ring: Wire | None = None):
        if schedule.stages != rank.world_size:
            raise InvalidValue("stages", schedule.stages, f"the {rank.world_size} ranks of the pipeline group")
        self.rank, self.schedule, self.wire = rank, schedule, Wire(rank, log)
        self.loss = loss or mean_cross_entropy  # (logits, targets) -> mean loss; vocab-parallel under TP
        bounds = split(model, schedule.stages * schedule.chunks)
        self.chunks = nn.ModuleList(StageChunk(model, *bounds[schedule.virtual_stage(rank.rank, c)], sequence_shards,
                                               ring) for c in range(schedule.chunks))
        release_other_stages(model, self.chunks)
        self.sequence_shards = sequence_shards  # sequence parallelism: activations travel as [b, s/t, hidden]
        self.hidden, self.last_stage = model.config.hidden, schedule.stages * schedule.chunks - 1
        self.dtype = dtype or model.norm.weight.dtype  # what activations travel in: the model's by default
        self.peak_activations = 0  # microbatch-chunks held at once, as executed
        self.stashes = [WeightStash(chunk) for chunk in self.chunks] if schedule.name == "pipedream" else None
        self.last_spans: list = []  # the executed timeline of the latest step
        self.moe_layers = sum(isinstance(module, MixtureOfExperts) for module in model.modules())

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, optimizer: torch.optim.Optimizer | None = None,
             meter: ActivationMeter | None = None) -> tuple[float | None, list]:
        """One pipeline step over the microbatches of `inputs` / `targets` ([m·b, s] each).

        Returns the mean loss (on the rank that holds the last stage, else None) and the executed
        timeline [(action, start_s, end_s)], times from `time.perf_counter()` (one clock for every
        process of a machine). Under "pipedream", `optimizer` (over this rank's chunks) steps after
        every backward; otherwise gradients accumulate for the caller to apply. `meter` counts the bytes each
        forward saves for its backward, held until that backward: its peak is what the microbatches in flight hold.
        """
        if self.stashes is not None and optimizer is None:
            raise InvalidValue("optimizer", None, "an optimizer over this rank's chunks (PipeDream updates after "
                                                  "every backward)")
        m = self.schedule.microbatches
        micro_inputs, micro_targets = inputs.chunk(m), targets.chunk(m)
        kept, losses, sends, spans, arriving, balances = {}, {}, [], [], {}, []
        actions = self.schedule.actions[self.rank.rank]
        for index, action in enumerate(actions):
            for ahead in range(index, min(index + RECEIVES_AHEAD, len(actions))):
                if ahead not in arriving:  # posted in action order, so messages from one peer match in order
                    arriving[ahead] = self._post_receive(actions[ahead], micro_inputs)
            incoming = arriving.pop(index)
            if incoming is not None:
                incoming[0].wait()
            stage = self.schedule.virtual_stage(self.rank.rank, action.chunk)
            chunk = self.chunks[action.chunk]
            if action.kind == "F":
                x = micro_inputs[action.microbatch] if incoming is None else incoming[1].requires_grad_(True)
                began = time.perf_counter()
                weights = chunk.parameters() if self.stashes is None else self.stashes[action.chunk].current().values()
                held = [*weights, inputs, targets]  # the batch's tokens and targets: not activations
                with meter.track(held) if meter is not None else nullcontext():
                    out = chunk(x) if self.stashes is None else self.stashes[action.chunk].forward(action.microbatch, x)
                    share = 1 if self.stashes is not None else m  # PipeDream: each microbatch's own update
                    balance = self._balance(chunk, share)
                    if balance is not None:
                        balances.append(balance.detach() * share / m)
                    if stage == self.last_stage:
                        loss = self.loss(out, micro_targets[action.microbatch])
                        losses[action.microbatch] = loss.detach() / m
                        out = loss / share if balance is None else loss / share + balance
                    else:
                        sends.append(self.wire.isend(out.detach(), self._owner(stage + 1)))
                        if balance is not None:
                            out = WithLoss.apply(out, balance)
                kept[(action.microbatch, action.chunk)] = (x, out, meter.saved_bytes if meter is not None else 0)
                self.peak_activations = max(self.peak_activations, len(kept))
            else:
                x, out, saved = kept.pop((action.microbatch, action.chunk))
                began = time.perf_counter()
                out.backward(None if incoming is None else incoming[1])  # the last stage starts from its loss
                if meter is not None:
                    meter.release(saved)
                if stage > 0:
                    sends.append(self.wire.isend(x.grad, self._owner(stage - 1)))
                if self.stashes is not None:
                    self.stashes[action.chunk].update(action.microbatch, optimizer)
            spans.append((action, began, time.perf_counter()))
        for pending in sends:
            pending.wait()
        self.last_spans = spans
        parts = [*losses.values(), *balances]
        loss = float(sum(parts)) if parts else None
        return loss, spans

    def _balance(self, chunk: nn.Module, share: int) -> torch.Tensor | None:
        """α · (the chunk's MoE layers' balancing losses in the forward just run) / (MoE layers · share)."""
        losses = balancing_losses(chunk)
        if not losses:
            return None
        return AUX_LOSS_WEIGHT * torch.stack(losses).sum() / (self.moe_layers * share)

    def _owner(self, virtual_stage: int) -> int:
        """The pipeline-group member holding `virtual_stage`."""
        return virtual_stage % self.schedule.stages

    def _post_receive(self, action, micro_inputs) -> tuple | None:
        """Start receiving what `action` needs — F: the previous virtual stage's activation, B: the next
        one's gradient, both [b, s/t, hidden] (t: `sequence_shards`) — and return (pending, buffer); None when it
        needs nothing."""
        stage = self.schedule.virtual_stage(self.rank.rank, action.chunk)
        source = stage - 1 if action.kind == "F" else stage + 1
        if not 0 <= source <= self.last_stage:
            return None
        batch, tokens = micro_inputs[action.microbatch].shape
        buffer = torch.empty(batch, tokens // self.sequence_shards, self.hidden, dtype=self.dtype)
        return self.wire.irecv(buffer, self._owner(source)), buffer


class WithLoss(torch.autograd.Function):
    """x unchanged; backward also starts `loss`'s own backward (d loss / d loss = 1), so a loss computed
    inside a pipeline chunk gets its gradient when the chunk's output gets its own."""

    @staticmethod
    def forward(ctx, x, loss):
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=grad.device)


def mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least fp32 for the softmax
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def executed_timeline(schedule: Schedule, spans_per_rank: list[list]) -> Timeline:
    """The executed timeline of one step (`PipelineRank.step`'s spans from every rank of the pipeline, in rank
    order), as `schedules.timeline` simulates it: its bubble counts waiting for a neighbour as idle, and it draws
    with `schedules.render_png` / `chrome_trace`."""
    return Timeline.of(schedule, [(rank, action, start, end) for rank, spans in enumerate(spans_per_rank)
                                  for action, start, end in spans])


def replayed_timeline(schedule: Schedule, spans_per_rank: list[list]) -> Timeline:
    """The schedule simulated with each action taking the time it took in the executed step (`executed_timeline`'s
    spans), its input there the moment the action it needs ends: the bubble the schedule itself leaves at this run's
    compute times. Where ranks compute the same stage work at different speeds (unequal stages, or a host whose cores
    differ from moment to moment) it is above the analytic bubble; the executed bubble above it is the executor's own
    cost — transfers, and receives posted late (benchmarks/pipeline.py)."""
    return timeline(schedule, durations={(rank, action): end - start for rank, spans in enumerate(spans_per_rank)
                                         for action, start, end in spans})
