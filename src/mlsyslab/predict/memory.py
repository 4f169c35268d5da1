"""Training memory per accelerator: model states (ZeRO), activations (Korthikanti), buffers.

Model states, mixed-precision Adam (Rajbhandari et al., SC'20, K = 12): weights 2Ψ, gradients 2Ψ,
optimizer 12Ψ (fp32 master, m, v). ZeRO-1 shards the optimizer over the data-parallel group N (with
context parallelism, DP × CP: Megatron's distributed optimizer; parallel/mesh.py), ZeRO-2 also
gradients, ZeRO-3 also weights: 16Ψ → 4Ψ+12Ψ/N → 2Ψ+14Ψ/N → 16Ψ/N. Plain SGD keeps only the fp32
master (K = 4); fp32 training keeps no master copy (Adam K = 8, SGD K = 0).
ZeRO-Offload moves the optimizer to the host: an fp32 master (even for fp32 training, since the
device keeps its own weights) plus the fp32 state, 12Ψ/N for Adam.
Ψ is what one rank holds after tensor, pipeline and expert sharding (the pipeline rank holding the most, for the
layers each holds under the cost-balanced split of predict/pipeline.py: the first, the last or one between).

Activations per layer and microbatch (Korthikanti et al. 2022, arXiv 2205.05198, fp16):
s·b·h·(34 + 5·a·s/h) without parallelism; tensor parallel t divides all but 10·s·b·h, sequence
parallelism divides those too; selective recompute drops the 5·a·s²·b attention-score term; full
recompute keeps only each layer's 2·s·b·h input. Generalised here to GQA widths, gated MLPs and
MoE (top-k routed copies of each token). With `eager_activations` (the trainer's twin; `mlsys calibrate` sets it for
this machine) what nn/'s layers save under eager PyTorch instead, tensor by tensor (`eager_activation_bytes_per_layer`),
at the training dtype. Pipeline stages hold the microbatches in flight:
GPipe m, 1F1B and PipeDream min(m, p), interleaved min(m, p + (p−1)/v) on the first stage (its chunks taken as equal),
counted for the layers the first stage holds; on rank r min(m, p − r) and min(m, p + (p − 2r − 1)/v), and the memory per
accelerator takes the rank holding the most (`heaviest_activation_bytes`).
PipeDream's weight stashing (Narayanan et al., SOSP'19 §3.3; parallel/weight_stash.py) also keeps a copy of
the stage's weights per version still owed a backward. Stage r's forwards of microbatches 0..p−r−1 all run on
version 0 (no backward has come yet), each later forward on a new one, and version 0 is freed at microbatch
p−r−1's backward: min(p − r, max(1, m − p + r + 1)) versions at once (`stashed_versions`; equal to the executed
schedule's for p ≤ 8, m < 20), on the first stage min(p, max(1, m − p + 1)) — one, not two, at m = p = 2, where every
forward precedes the first update (counted on the heaviest stage: exact where that is the first).
Twin of: parallel/zero.py and measure/ (held equal in tests/parallel/test_zero.py).
"""

from dataclasses import dataclass

import numpy as np

from mlsyslab.predict.architecture import ParameterBreakdown, parameters
from mlsyslab.predict.assumptions import DEFAULT, Assumptions
from mlsyslab.predict.layout import Layout
from mlsyslab.predict.pipeline import StageLayers, stage_layers
from mlsyslab.specs.schema import DTYPE_BYTES, Model


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes per accelerator by category (arrays over layouts), and whether they fit."""

    weights: np.ndarray
    gradients: np.ndarray
    optimizer: np.ndarray
    activations: np.ndarray
    buffers: np.ndarray
    host_offload: np.ndarray  # bytes moved to host memory per rank (optimizer under offload)
    capacity: float  # allocatable bytes per accelerator

    @property
    def total(self):
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers

    @property
    def fits(self):
        return self.total <= self.capacity

    @property
    def headroom(self):
        """Allocatable bytes left (negative: short by that much)."""
        return self.capacity - self.total

    def breakdown(self, i: int = 0) -> dict:
        pick = lambda a: float(np.asarray(a).reshape(-1)[i])  # noqa: E731
        return {"weights": pick(self.weights), "gradients": pick(self.gradients),
                "optimizer": pick(self.optimizer), "activations": pick(self.activations),
                "buffers": pick(self.buffers), "total": pick(self.total), "capacity": self.capacity,
                "host_offload": pick(self.host_offload)}


def model_state_bytes(params, data_parallel, zero_stage, optimizer: str = "adam", dtype: str = "bf16", offload=False):
    """(weights, gradients, optimizer) bytes per rank for `params` held by the rank before ZeRO."""
    width = DTYPE_BYTES[dtype]
    mixed = width < 4
    optimizer_width = {"adam": 12.0 if mixed else 8.0, "sgd": 4.0 if mixed else 0.0}[optimizer]
    n = np.asarray(data_parallel, dtype=float)
    zero = np.asarray(zero_stage)
    weights = width * params / np.where(zero >= 3, n, 1.0)
    gradients = width * params / np.where(zero >= 2, n, 1.0)
    optimizer_bytes = optimizer_width * params / np.where(zero >= 1, n, 1.0)
    return weights, gradients, np.where(offload, 0.0, optimizer_bytes)


def offloaded_optimizer_bytes(params, data_parallel, zero_stage, optimizer: str = "adam"):
    """Host bytes per rank under ZeRO-Offload: an fp32 master copy (4) plus the fp32 state (Adam 8, SGD 0)."""
    state = {"adam": 8.0, "sgd": 0.0}[optimizer]
    shard = np.where(np.asarray(zero_stage) >= 1, np.asarray(data_parallel, dtype=float), 1.0)
    return (4.0 + state) * params / shard


def stashed_versions(pp, microbatches, stage=0):
    """Weight versions PipeDream's stage `stage` of `pp` keeps at once over `microbatches` (module docstring)."""
    ahead = np.asarray(pp) - stage  # the forwards before its first backward, all on version 0
    return np.minimum(ahead, np.maximum(1, np.asarray(microbatches) - ahead + 1))


def stage_parameters(breakdown: ParameterBreakdown, layout: Layout, stages: StageLayers, rank: str = "heaviest"):
    """(non-expert, expert) parameters one rank of a pipeline stage holds: the "first", the "last" or the "heaviest"
    rank (of the first, the last and every one between), for the layers each holds under the balanced split
    (`stages`).

    Matmul weights split over TP; routed experts over EP·TP; norms (Q/K head norms too) and the router replicate.
    The first stage holds the embedding, the last the output layer (a second copy when tied and pp > 1). The cost-
    balanced split weighs forward FLOPs, not parameters: a middle rank can hold the most (one layer more than the
    first where the embedding is smaller than a layer; MoE layers where the first holds dense ones).
    """
    dense, experts, _ = rank_parameters(breakdown, layout, stages, rank)
    return dense, experts


def rank_parameters(breakdown: ParameterBreakdown, layout: Layout, stages: StageLayers, rank: str = "heaviest"):
    """`stage_parameters`, and the decoder layers that rank holds."""
    tp, pp, ep = (np.asarray(x, dtype=float) for x in (layout.tp, layout.pp, layout.ep))
    attention = (breakdown.attention - breakdown.head_norms) / tp + breakdown.head_norms + breakdown.layer_norms
    per_layer = (attention + breakdown.dense_mlp / tp,  # dense, MoE without its routed experts, routed experts
                 attention + breakdown.shared_experts / tp + breakdown.router, breakdown.routed_experts / (ep * tp))
    output = (breakdown.unembedding or breakdown.output_projection) / tp + breakdown.final_norm
    embedding = breakdown.embedding / tp

    def holding(layers, moe, axis=()):  # (non-expert, expert parameters, layers) of a rank holding these layers
        dense, moe_layer, expert = (np.expand_dims(x, axis) for x in per_layer)
        return (layers - moe) * dense + moe * moe_layer, moe * expert, layers

    first, last = holding(stages.first, stages.first_moe), holding(stages.last, stages.last_moe)
    ranks = [(first[0] + embedding, *first[1:]), (last[0] + output, *last[1:])]
    if rank == "heaviest":  # the middle ranks along the last axis (pp ≤ 2: one of no layers); the one holding most
        middle = np.broadcast_arrays(*holding(stages.middle, stages.middle_moe, -1))
        k = np.argmax(middle[0] + middle[1], axis=-1)[..., None]
        ranks.append(tuple(np.take_along_axis(x, k, axis=-1)[..., 0] for x in middle))
    shape = np.broadcast_shapes(*(np.shape(x) for held in ranks for x in held))
    ranks = [[np.broadcast_to(x, shape) for x in held] for held in ranks]
    which = {"first": np.zeros(shape, dtype=int), "last": np.ones(shape, dtype=int),
             "heaviest": np.argmax([dense + experts for dense, experts, _ in ranks], axis=0)}[rank]
    dense, experts, layers = (np.choose(which, [held[i] for held in ranks]) for i in range(3))
    single = first[0] + embedding + output - np.where(breakdown.unembedding, 0.0, breakdown.output_projection / tp)
    return (np.where(pp == 1, single, dense), np.where(pp == 1, first[1], experts),
            np.where(pp == 1, stages.first, layers))


def activation_bytes_per_layer(model: Model, layout: Layout, moe_layer: bool = False, flash_attention: bool = True):
    """(stored, without recompute) activation bytes of one layer, one microbatch, one rank (16-bit).

    With FlashAttention (or selective recompute) the s x s attention scores are never stored.
    """
    s = layout.seq / layout.cp
    b = layout.micro_batch
    h, f = model.hidden, model.ffn_hidden
    t = layout.tp.astype(float)
    q_width = model.heads * model.attention_head_dim
    kv_width = model.num_kv_heads * model.attention_head_dim
    if model.mla is not None:
        q_width = model.heads * (model.mla.qk_nope_head_dim + model.mla.qk_rope_head_dim)
        kv_width = (q_width + model.heads * model.mla.v_head_dim) / 2
    if moe_layer and model.moe is not None:
        f = model.moe.expert_ffn_hidden * (model.moe.experts_per_token + model.moe.shared_experts)
    # Stored per token: inside the TP region (split by t) and outside it (split by t only under SP).
    attention_inside = 2 * q_width + 4 * kv_width + 2 * q_width  # Q, K, V, attention output
    mlp_inside = (6 if model.gated_mlp else 4) * f  # fc1 (and gate) outputs, activation output
    outside = 2 * h + 2 * h + 4 * h + 2 * h  # QKV input, MLP input, 2 norm inputs, 2 dropout masks (1 byte)
    scores = 5 * model.heads * s  # softmax out (2), dropout mask (1), dropout out (2) per head per key
    inside = (attention_inside + mlp_inside) / t
    outside_shard = np.where(layout.sequence_parallel, t, 1.0)
    no_scores = (layout.recompute >= 1) | flash_attention
    per_token = inside + outside / outside_shard + np.where(no_scores, 0.0, scores / t)
    full = 2 * h / outside_shard
    return s * b * np.where(layout.recompute == 2, full, per_token), s * b * per_token


def eager_activation_bytes_per_layer(model: Model, layout: Layout, element_bytes: float, moe_layer: bool = False):
    """Bytes one layer saves for backward when PyTorch runs it eagerly, as mlsyslab's nn/ Llama is written — one
    microbatch, one rank, at `element_bytes` per activation — where `activation_bytes_per_layer` counts Megatron's
    fused kernels (Korthikanti et al. 2022). Tensor by tensor, as autograd keeps them (held to the byte against
    measure.memory.ActivationMeter: tests/measure/test_activation_meter.py, and on every layout, tests/train/):
    - each RMSNorm its input and the reciprocal RMS (fp32): h·w + 4 bytes a token (`nn.training_kernels`; PyTorch's
      own autograd of F.rms_norm on a CPU keeps fp32 copies of the input and the normalised input instead); under SP
      on this rank's shard of the sequence;
    - the q|k|v and gate|up entries their input (under SP only the shard, gathered again in backward);
    - attention q, k and v after rotary, its output (under CP in 16 bits, ring attention's fp32 accumulator too)
      and each query head's log-sum-exp (fp32); Qwen3's head norms as norms of q and k;
    - SwiGLU gate, up and silu(gate)·up (`nn.training_kernels` recomputes silu(gate) in backward; a plain MLP fc1's
      output and the activation's);
    - an MoE layer, routing balanced and nothing dropped: the router's input (under SP its shard), the router's
      probabilities and the kept weights (fp32), the top-k, sorted and kept copies' indices (int64) and the kept
      mask, the k routed copies of each token, each copy's SwiGLU, its weight and the combine's outputs and weighted
      outputs (under EP the arrived copies' order too); per layer the experts' token fractions of the balancing
      loss.
    Full recompute keeps each layer's input only."""
    n = layout.micro_batch * (layout.seq / layout.cp)  # tokens of the microbatch on this rank
    w = element_bytes
    h, t = model.hidden, layout.tp.astype(float)
    share = np.where(layout.sequence_parallel, 1.0 / t, 1.0)  # of the tokens outside the TP region
    heads, kv_heads = model.heads, model.num_kv_heads
    q_width, kv_width = heads * model.attention_head_dim, kv_heads * model.attention_head_dim
    if model.mla is not None:
        q_width = heads * (model.mla.qk_nope_head_dim + model.mla.qk_rope_head_dim)
        kv_width = (q_width + heads * model.mla.v_head_dim) / 2
    norm = h * w + 4
    output_bytes = w + np.where(layout.cp > 1, 4 if w < 4 else 0, 0)  # ring attention also keeps its fp32 sum
    attention = ((q_width + 2 * kv_width) * w + q_width * output_bytes + 4 * heads) / t
    if model.qk_norm:
        attention = attention + ((q_width + kv_width) * w + 4 * (heads + kv_heads)) / t
    per_token = (2 * norm + h * w) * share + attention
    constant = 0.0
    if moe_layer and model.moe is not None:
        k, experts, f = model.moe.experts_per_token, model.moe.experts, model.moe.expert_ffn_hidden
        # probabilities and the kept weights (fp32), top-k, sorted and kept copies' indices (int64), the kept mask
        routing = 4 * experts + 4 + 4 * k + 8 * k + 8 * k + k + 8 * k + np.where(layout.ep > 1, 8 * k, 0)
        copies = k * (h + 3 * f / t + 2 * h + 1) * w  # input, SwiGLU, output and weighted output, the weight
        shared = model.moe.shared_experts * 3 * f / t * w
        per_token = per_token + h * w * share + routing + copies + shared
        constant = 4.0 * experts
    else:
        per_token = per_token + h * w * share + (3 if model.gated_mlp else 2) * model.ffn_hidden / t * w
    return np.where(layout.recompute == 2, n * h * w * share, n * per_token + constant)


def eager_chunk_activation_bytes(model: Model, layout: Layout, element_bytes: float, layers, moe_layers,
                                 embedding: bool, head):
    """What one model chunk saves for backward in a microbatch's forward, run as nn/ runs it: its `layers`
    (`moe_layers` of them MoE) as `eager_activation_bytes_per_layer` counts them; rotary's cos and sin (2 · head_dim a
    token at the compute dtype); with the `embedding`, under TP the vocabulary-parallel lookup's local ids and mask
    (9 bytes a token; the token ids themselves are the batch's); where `head` (a bool per layout), the final norm, the
    head's input (under SP its shard) and the loss — fp32 log-probabilities of the rank's vocabulary slice, and under
    TP its local targets and mask (9 bytes a token), else cross-entropy's 4-byte total weight."""
    n = layout.micro_batch * (layout.seq / layout.cp)
    t = layout.tp.astype(float)
    share = np.where(layout.sequence_parallel, 1.0 / t, 1.0)
    dense = eager_activation_bytes_per_layer(model, layout, element_bytes)
    moe = eager_activation_bytes_per_layer(model, layout, element_bytes, True) if model.moe is not None else dense
    rope_dim = model.attention_head_dim if model.mla is None else model.mla.qk_rope_head_dim
    total = (layers - moe_layers) * dense + moe_layers * moe + n * 2 * rope_dim * element_bytes
    if embedding:
        total = total + np.where(layout.tp > 1, 9 * n, 0.0)
    loss = n * ((2 * model.hidden * element_bytes + 4) * share + 4 * model.vocab / t) \
        + np.where(layout.tp > 1, 9 * n, 4.0)
    return total + np.where(head, loss, 0.0)


def training_memory(model: Model, layout: Layout, hbm_bytes: float, optimizer: str = "adam",
                    dtype: str = "bf16", assumptions: Assumptions = DEFAULT,
                    stages: StageLayers | None = None) -> TrainingMemory:
    """Bytes per accelerator by category (`stages`: the layout's split, if already computed): the model states of the
    rank holding the most parameters (with PipeDream's stash of as many versions as the first stage keeps), the
    activations of the rank holding the most of them, the logits of the last's — each at its heaviest, so the total
    bounds every rank's from above."""
    breakdown = parameters(model)
    stages = stage_layers(model, layout) if stages is None else stages
    dense, experts, held = rank_parameters(breakdown, layout, stages)
    dp = layout.dp.astype(float) * layout.cp  # ZeRO shards over DP × CP: those ranks hold the same weights
    expert_dp = dp / layout.ep
    w1, g1, o1 = model_state_bytes(dense, dp, layout.zero, optimizer, dtype, layout.offload)
    w2, g2, o2 = model_state_bytes(experts, expert_dp, layout.zero, optimizer, dtype, layout.offload)
    weights, gradients, optimizer_bytes = w1 + w2, g1 + g2, o1 + o2
    stashed = stashed_versions(layout.pp, layout.microbatches) * DTYPE_BYTES[dtype] * (dense + experts)
    weights = weights + np.where(layout.schedule == 3, stashed, 0.0)
    offloaded = offloaded_optimizer_bytes(dense, dp, layout.zero, optimizer)
    offloaded = offloaded + offloaded_optimizer_bytes(experts, expert_dp, layout.zero, optimizer)
    host = np.where(layout.offload, offloaded, 0.0)

    dense_stored, moe_stored, working_layer = _activations(model, layout, assumptions)
    activations = heaviest_activation_bytes(model, layout, stages, DTYPE_BYTES[dtype], assumptions,
                                            (dense_stored, moe_stored))
    # Buffers: one layer's full activations live during its recompute + backward, fp32 logits for
    # the loss on the last stage, ZeRO-3's two gathered layers (current + prefetch).
    logits = 4.0 * layout.seq / layout.cp * layout.micro_batch * model.vocab / layout.tp
    gathered = np.where(layout.zero >= 3, 2 * DTYPE_BYTES[dtype] * (dense + experts) / np.maximum(held, 1), 0.0)
    buffers = np.where(layout.recompute == 2, working_layer, 0.0) + logits + gathered
    capacity = hbm_bytes * assumptions.memory_usable_fraction - assumptions.memory_reserved_bytes
    return TrainingMemory(weights, gradients, optimizer_bytes, activations, buffers, host, capacity)


def first_stage_activation_bytes(model: Model, layout: Layout, stages: StageLayers, element_bytes: float,
                                 assumptions: Assumptions = DEFAULT, korthikanti: tuple | None = None):
    """What the first pipeline stage's rank holds for backward at its peak: its layers' activations per microbatch
    times the microbatches the schedule keeps in flight. Korthikanti's 16-bit count (whatever `element_bytes`; its
    dense and MoE bytes per layer in `korthikanti` when already computed), or with `assumptions.eager_activations`
    what nn/ saves at `element_bytes` an activation, with the embedding's tensors and, without PP, the head's and
    the loss's."""
    return rank_activation_bytes(model, layout, stages.first, stages.first_moe, 0, element_bytes, assumptions,
                                 korthikanti)


def heaviest_activation_bytes(model: Model, layout: Layout, stages: StageLayers, element_bytes: float,
                              assumptions: Assumptions = DEFAULT, korthikanti: tuple | None = None):
    """The most any pipeline rank holds for backward at its peak (`rank_activation_bytes`): the first holds the most
    microbatches, but where stages are uneven a later one can hold more layers of them (Llama-3.1-405B on PP 64: one
    layer on the first, two on the next, 2 × 63 against 1 × 64 microbatch-layers)."""
    most = first_stage_activation_bytes(model, layout, stages, element_bytes, assumptions, korthikanti)
    last = layout.pp.astype(float) - 1
    ranks = [(stages.last, stages.last_moe, last)] + [
        (stages.middle[..., k], stages.middle_moe[..., k], stages.middle_rank[..., k])
        for k in range(stages.middle.shape[-1])]
    for layers, moe_layers, rank in ranks:
        held = rank_activation_bytes(model, layout, layers, moe_layers, rank, element_bytes, assumptions, korthikanti)
        most = np.where(layout.pp > 1, np.maximum(most, held), most)
    return most


def rank_activation_bytes(model: Model, layout: Layout, layers, moe_layers, rank, element_bytes: float,
                          assumptions: Assumptions = DEFAULT, korthikanti: tuple | None = None):
    """What pipeline rank `rank`, holding `layers` decoder layers (`moe_layers` of them MoE), holds for backward at its
    peak (as `first_stage_activation_bytes`; the embedding's tensors on rank 0, the head's without PP)."""
    if assumptions.eager_activations:  # the rank's chunks, taken as equal, and the rotary tables of each
        chunks = np.where(layout.schedule == 2, layout.interleave, 1)
        held = eager_chunk_activation_bytes(model, layout, element_bytes, layers, moe_layers, np.asarray(rank) == 0,
                                            layout.pp == 1) \
            + (chunks - 1) * eager_chunk_activation_bytes(model, layout, element_bytes, 0, 0, False, False)
    else:
        dense, moe = korthikanti if korthikanti is not None else _activations(model, layout, assumptions)[:2]
        held = (layers - moe_layers) * dense + moe_layers * moe
    return held * microbatches_in_flight(layout, rank)


def _activations(model: Model, layout: Layout, assumptions: Assumptions):
    """Stored bytes per dense and per MoE layer and microbatch, and the largest one-layer working set."""
    flash = assumptions.flash_attention
    dense_stored, dense_full = activation_bytes_per_layer(model, layout, False, flash)
    if model.moe is None:
        return dense_stored, dense_stored, dense_full
    moe_stored, moe_full = activation_bytes_per_layer(model, layout, True, flash)
    return dense_stored, moe_stored, np.maximum(dense_full, moe_full)


def microbatches_in_flight(layout: Layout, rank=0):
    """Microbatches whose activations pipeline rank `rank` (the first by default) holds at its peak."""
    m = layout.microbatches
    p = layout.pp.astype(float)
    v = layout.interleave.astype(float)
    one_f_one_b = np.minimum(m, p - rank)
    # Megatron's warm-up, (p − r − 1)·2 + (v − 1)·p chunk forwards, and one more before the first backward: of the
    # rank's m·v, in whole-rank units min(m, p + (p − 2r − 1)/v); on the first, min(m, p)·(1 + (p − 1)/(p·v)) once m > p
    interleaved = np.minimum(m, p + (p - 2 * np.asarray(rank) - 1) / v)
    return np.select([layout.schedule == 0, layout.schedule == 2], [m, interleaved], one_f_one_b)
