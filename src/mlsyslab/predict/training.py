"""Training step time of a layout DP(ZeRO) × TP × PP × CP × EP, and what bounds it.

Per microbatch, each rank of the slowest pipeline stage spends (the stages split by cost as our pipeline splits them,
predict/pipeline.py: with a large output layer the last holds fewer layers, and another stage may be the slowest):
  compute     matmul FLOP / (peak · η(h/t)), η(w) = η_max · w/(w + w_half), plus memory-bound
              kernels (norms, activations, residuals; unfused attention scores; the loss, and the logits'
              traffic beyond the head's FLOPs) at HBM speed;
  TP          2 all-reduces forward, 2 backward (+2 when the forward is recomputed) of s·b·h
              activations per layer (Shoeybi et al. 2019); with sequence parallelism each becomes a
              reduce-scatter + all-gather of the same bytes (Korthikanti et al. 2022);
  EP          dispatch + combine all-to-all of top-k copies of each token per MoE layer, twice
              more backward (Lepikhin et al. 2020, GShard);
  CP          cp − 1 ring steps passing K/V per layer (twice in backward: K/V and their
              gradients, accumulated in fp32), hidden behind attention compute when it is shorter
              (Liu et al. 2023);
  PP          a send forward and backward per microbatch between stages.
A step is m such slots, the fill and drain through the other stages (the bubble: (p − 1)/v slots when the stages are
equal), then the exposed part of the data-parallel
traffic (2Ψ per step; ZeRO-2 (m+1)Ψ, ZeRO-3 3mΨ with m microbatches), then the optimizer step (memory-bound; on the
CPU under offload; under PipeDream one per microbatch, each followed by the copy of the weights its new version
stashes). MFU counts model FLOPs (3 × forward); HFU adds recomputation.
Twin of: train/ and parallel/ (verify/ holds measured step time against this for --hardware local).
"""

from dataclasses import dataclass

import numpy as np

from mlsyslab.errors import InvalidValue, raise_all
from mlsyslab.predict import collectives as coll
from mlsyslab.predict.architecture import (attention_dims, forward_flops_per_token, parameters,
                                            training_flops_per_token)
from mlsyslab.predict.assumptions import DEFAULT, Assumptions
from mlsyslab.predict.hardware import Hardware
from mlsyslab.predict.layout import Layout
from mlsyslab.predict.memory import TrainingMemory, stage_parameters, training_memory
from mlsyslab.predict.pipeline import StageLayers, pipeline_bubble_fraction, stage_layers
from mlsyslab.specs.schema import DTYPE_BYTES, Model

# The step's parts; "optimizer" is the memory-bound work on the rank's parameters: the update, and the gradients'
# accumulation every microbatch.
TIME_PARTS = ("compute", "tensor_parallel", "expert_parallel", "context_parallel", "pipeline_p2p",
              "pipeline_bubble", "data_parallel", "optimizer")


@dataclass(frozen=True)
class TrainingPrediction:
    step_s: np.ndarray
    mfu: np.ndarray
    hfu: np.ndarray
    tflops_per_gpu: np.ndarray  # model FLOP/s per GPU, in TFLOP/s
    tokens_per_s: np.ndarray
    bubble_fraction: np.ndarray
    time_s: dict  # part -> array: where a step's time goes (sums to step_s)
    wire_bytes: dict  # parallelism -> bytes each rank sends per step
    memory: TrainingMemory
    feasible: np.ndarray
    reason_code: np.ndarray  # index into REASONS: 0 where feasible, else the first rule broken
    stages: StageLayers  # the decoder layers the pipeline's first, last and busiest other ranks hold
    slowest_is_last: np.ndarray  # whether the rank timed is the last (else the busiest other)

    def reason(self, i: int = 0) -> str:
        return REASONS[int(self.reason_code.reshape(-1)[i])]


def matmul_efficiency(width, assumptions: Assumptions = DEFAULT):
    """Fraction of peak a transformer's matmuls reach when the per-device GEMM width is `width`."""
    width = np.asarray(width, dtype=float)
    return assumptions.matmul_efficiency_max * width / (width + assumptions.matmul_half_efficiency_width)


def predict_training(model: Model, hardware: Hardware, layout: Layout, optimizer: str = "adam",
                     assumptions: Assumptions = DEFAULT, stage: str = "slowest") -> TrainingPrediction:
    """The step of `layout`, timed on the pipeline's slowest rank: the last (it also computes the logits) or the
    busiest of the others, both timed. Its per-step bytes (wire_bytes) are that rank's, or with stage="first" those of a
    rank of the first stage (what rank 0 of a run logs: verify/)."""
    if stage not in ("slowest", "first"):
        raise InvalidValue("stage", stage, "slowest or first")
    a, hw = assumptions, hardware
    width = DTYPE_BYTES[hw.dtype]
    breakdown = parameters(model)
    t, p, c, e, d = (getattr(layout, k).astype(float) for k in ("tp", "pp", "cp", "ep", "dp"))
    v = np.where(layout.schedule == 2, layout.interleave, 1).astype(float)
    m = layout.microbatches
    tokens = layout.micro_batch * layout.seq / c  # tokens per microbatch on one rank
    stages = stage_layers(model, layout)  # the cost-balanced split our pipeline runs
    first = stage == "first"
    # The ranks timed, along a leading axis: the last, the busiest other and the mean of the others (for the bubble), or
    # a rank of the first stage in each row; the decoder layers each holds, of them with experts, and whether it
    # computes the logits. Every per-rank term below is linear in these.
    if first:
        layers, moe_layers = (np.stack([x] * 3) for x in (stages.first, stages.first_moe))
        head = np.stack([np.where(p == 1, 1.0, 0.0)] * 3)
    else:
        others = np.maximum(p - 1, 1)
        layers = np.stack([stages.last, stages.busiest_other, (model.layers - stages.last) / others])
        moe_layers = np.stack([stages.last_moe, stages.busiest_other_moe,
                               (breakdown.moe_layers - stages.last_moe) / others])
        head = np.stack([np.ones_like(p), np.zeros_like(p), np.zeros_like(p)])
    full = layout.recompute == 2
    selective = layout.recompute == 1

    # Compute per microbatch on that rank.
    d_qk, d_v = attention_dims(model)
    layer_matmul_fwd = 2 * tokens * ((layers - moe_layers) * breakdown.matmul_per_dense_layer
                                     + moe_layers * breakdown.matmul_per_moe_layer) / t
    logits_fwd = 2 * tokens * breakdown.output_projection / t * head
    attention_fwd = 2 * tokens * layout.seq * (d_qk + d_v) * layers / t
    passes = 3 + full  # forward, backward (2x); full recompute repeats the layers' forward (not the logits)
    gemm_flops = passes * layer_matmul_fwd + 3 * logits_fwd
    peak = hw.peak_flops * matmul_efficiency(model.hidden / t, a)
    attention_peak = peak * a.attention_efficiency
    sp_shard = np.where(layout.sequence_parallel, t, 1.0)
    elementwise = a.elementwise_bytes_per_token_per_hidden * model.hidden / sp_shard * tokens * layers * passes
    scores = 0.0 if a.flash_attention else 2 * 5 * model.heads * layout.seq * tokens / t * layers * (passes + selective)
    # The loss: fp32 logits written, softmax read and written, and their gradient, on the last stage; and the bytes
    # the vocabulary projection's products move beyond their FLOPs (counted at the layers' rate in gemm_flops).
    loss_bytes = (a.loss_bytes_per_logit + a.output_projection_bytes_per_logit) * tokens * model.vocab / t * head
    memory_bw = hw.hbm_bw * a.memory_bandwidth_efficiency
    launches = a.kernel_overhead_s * a.kernels_per_layer * layers * passes
    compute = gemm_flops / peak + (passes + selective) * attention_fwd / attention_peak \
        + (elementwise + scores + loss_bytes) / memory_bw + launches

    # Tensor parallel: 4 collectives of s·b·h per layer (6 with recompute), all-reduce-equivalent.
    act_bytes = tokens * model.hidden * width
    up_bw, out_bw = hw.scale_up_bw * a.scale_up_efficiency, hw.scale_out_bw * a.scale_out_efficiency
    link = dict(up_bw=up_bw, up_latency_s=a.scale_up_latency_s, out_bw=out_bw, out_latency_s=a.scale_out_latency_s)
    # the collectives our ranks run through shared memory inside a node (comm/shared_memory.py): TP's always, DDP's and
    # ZeRO's where data parallelism is all the ranks do
    shared_link = dict(link, up_bw=up_bw * a.shared_memory_bandwidth_factor,
                       up_latency_s=a.scale_up_latency_s * a.shared_memory_latency_factor)
    tp_local = np.minimum(t, hw.scale_up_domain)
    tp_count = (4 + 2 * full) * layers
    tp_time = tp_count * coll.hierarchical_all_reduce_s(act_bytes, t, tp_local, **shared_link)
    # Under SP each column-parallel entry (attention's, and the MLP's: a dense one's, or an MoE one's router) gathers
    # its input again in backward, so as to keep only its shard (Korthikanti et al. §4.2.2): an all-gather, half an
    # all-reduce's bytes, per entry, timed as far as it is not hidden behind the input gradient's GEMM (Megatron hides
    # it; ours does not).
    sp_regathers = np.where(layout.sequence_parallel, layers, 0.0)
    tp_bytes = (tp_count + sp_regathers) * coll.ring_all_reduce_bytes_per_rank(act_bytes, t)
    tp_time = tp_time + sp_regathers * 2 * coll.hierarchical_shard_s(act_bytes, t, tp_local, **shared_link) \
        * (1 - a.sequence_parallel_regather_overlap)
    # An MoE layer under TP also sums its routing weights' gradient (fp32, one per routed copy) in backward
    # (parallel.tensor.TensorParallelExperts); copies dropped over capacity send nothing.
    top_k = 0 if model.moe is None else model.moe.experts_per_token
    routing_weight_bytes = tokens * top_k * 4
    tp_time = tp_time + moe_layers * coll.hierarchical_all_reduce_s(routing_weight_bytes, t, tp_local, **shared_link)
    tp_bytes = tp_bytes + moe_layers * coll.ring_all_reduce_bytes_per_rank(routing_weight_bytes, t)

    # Expert parallel: dispatch + combine of top-k token copies, per MoE layer, fwd and bwd.
    a2a_bytes = tokens * top_k * model.hidden * width
    ep_local = np.clip(hw.scale_up_domain / (t * c), 1, None)
    ep_count = (4 + 2 * full) * moe_layers
    ep_time = ep_count * coll.hierarchical_shard_s(a2a_bytes, e, np.minimum(e, ep_local), **link)
    ep_bytes = ep_count * coll.ring_shard_bytes_per_rank(a2a_bytes, e)
    # and each forward's routing metadata (int64): a copy count per rank, an expert id per routed copy
    routing_count = (1 + full) * moe_layers
    ep_time = ep_time + routing_count * sum(coll.hierarchical_shard_s(size, e, np.minimum(e, ep_local), **link)
                                            for size in (tokens * top_k * 8, e * 8))
    ep_bytes = ep_bytes + routing_count * sum(coll.ring_shard_bytes_per_rank(size, e)
                                              for size in (tokens * top_k * 8, e * 8))

    # Context parallel: K/V blocks circulate the ring.
    kv_width = 2 * model.num_kv_heads * model.attention_head_dim if model.mla is None else d_qk + d_v
    kv_block = tokens * kv_width * width / t
    gradient_block = tokens * kv_width * max(width, 4) / t  # the accumulators stay fp32 (parallel/context.py)
    cp_bw = np.where(t * c <= hw.scale_up_domain, up_bw, out_bw)
    # forward (c−1) hops of K+V (again under full recompute); backward (c−1) hops of K+V with their
    # gradient accumulators, then one hop bringing the accumulators home
    kv_hops = np.where(c > 1, (c - 1) * (2 + full) * layers, 0.0)
    gradient_hops = np.where(c > 1, c * layers, 0.0)
    cp_transfer = (kv_hops * coll.point_to_point_s(kv_block, cp_bw, a.scale_up_latency_s)
                   + gradient_hops * coll.point_to_point_s(gradient_block, cp_bw, a.scale_up_latency_s))
    attention_time = passes * attention_fwd / attention_peak
    cp_time = np.where(c > 1, np.maximum(0.0, cp_transfer - a.context_parallel_overlap * attention_time), 0.0)
    cp_bytes = kv_hops * kv_block + gradient_hops * gradient_block

    # Pipeline: activations (gradients backward) cross each stage boundary once per microbatch.
    p2p_bytes = act_bytes / sp_shard
    p2p_bw = np.where(layout.gpus <= hw.scale_up_domain, up_bw, out_bw)
    p2p_time = np.where(p > 1, 2 * v * coll.point_to_point_s(p2p_bytes, p2p_bw, a.scale_out_latency_s), 0.0)
    p2p_time = p2p_time * (1 - a.pipeline_p2p_overlap)

    slot = compute + tp_time * (1 - a.tensor_parallel_overlap) + ep_time * (1 - a.expert_all_to_all_overlap) + cp_time + p2p_time
    other = slot[1] > slot[0]  # the busiest other rank is the slower (a tie goes to the last)
    # The fill and drain: a microbatch's slot on each stage but the slowest, once (Huang et al. 2019, GPipe), over v
    # virtual stages (Narayanan et al. 2021): (p − 1)/v slots when the stages are equal; under the cost-balanced split
    # the output layer can leave the last far costlier than the others, which then fill and drain in less.
    fill_and_drain = (p - 1) * slot[2] + np.where(other, slot[0] - slot[1], 0.0)
    timed = lambda x: np.where(other, *np.broadcast_to(x, slot.shape)[[1, 0]])  # noqa: E731
    slowest_is_last = np.logical_and(not first, ~other)
    slot, compute, tp_time, ep_time, cp_time, p2p_time, tp_bytes, ep_bytes, cp_bytes, layers = (
        timed(x) for x in (slot, compute, tp_time, ep_time, cp_time, p2p_time, tp_bytes, ep_bytes, cp_bytes, layers))
    bubble = fill_and_drain / v

    # Data parallel, in units of one all-reduce of the gradients (2Ψ(N−1)/N): ZeRO-0/1 reduce once per
    # step; ZeRO-2 reduce-scatters every microbatch's gradients then all-gathers the weights once,
    # (m+1)/2; ZeRO-3 gathers the weights forward and backward and reduce-scatters every microbatch, 3m/2.
    # ZeRO reduces over DP × CP (those ranks hold the same weights; Megatron's distributed optimizer),
    # plain DP over DP after the CP sum (counted with CP: verify.training).
    dense_params, expert_params = stage_parameters(breakdown, layout, stages, "first" if first else "heaviest")
    volume = np.select([layout.zero == 3, layout.zero == 2], [1.5 * m, (m + 1) / 2], 1.0) * a.gradient_reduce_bytes
    group = np.where(layout.zero > 0, d * c, d)
    dp_local = np.clip(hw.scale_up_domain / (t * group / d), 1, None)  # the group's ranks inside one node
    expert_dp = group / e
    data_only = (t == 1) & (p == 1) & (c == 1) & (e == 1)
    # through shared memory, ZeRO's all-gathers and reduce-scatters at their own rate, DDP's all-reduce at its
    shared_dp_link = dict(shared_link, up_bw=shared_link["up_bw"] * np.where(
        layout.zero >= 1, a.shared_memory_shard_bandwidth_factor, 1.0))
    dp_link = {name: np.where(data_only, shared_dp_link[name], link[name]) for name in link}
    dp_time = (
        coll.hierarchical_all_reduce_s(volume * dense_params, group, np.minimum(group, dp_local), **dp_link)
        + coll.hierarchical_all_reduce_s(volume * expert_params, expert_dp, np.minimum(expert_dp, dp_local), **dp_link))
    dp_bytes = (coll.ring_all_reduce_bytes_per_rank(volume * dense_params, group)
                + coll.ring_all_reduce_bytes_per_rank(volume * expert_params, expert_dp))
    # ZeRO-3 gathers (forward, backward) and reduce-scatters each layer's unit separately, every
    # microbatch: 3·m·(layers + 2) collectives, each paying (n − 1) latencies.
    zero3_latency = np.where(layout.zero == 3, 3 * m * (layers + 2) * (group - 1), 0.0) * np.where(
        d * t * c <= hw.scale_up_domain, dp_link["up_latency_s"], a.scale_out_latency_s)
    dp_time = dp_time + zero3_latency
    dp_exposed = dp_time * (1 - a.data_parallel_overlap)

    # Optimizer step over this rank's shard: HBM-bound, or CPU-bound with a PCIe round trip under offload.
    local = dense_params / np.where(layout.zero >= 1, d, 1.0) + expert_params / np.where(layout.zero >= 1, expert_dp, 1.0)
    on_device = local * a.optimizer_bytes_per_parameter / memory_bw
    # and every microbatch, the rank's whole gradients (before any ZeRO sharding) handed on: added into those
    # accumulated, or copied into a bucket
    gradient_handling = m * (dense_params + expert_params) * a.gradient_accumulation_bytes_per_parameter / memory_bw
    pcie = max(hw.pcie_bw, 1.0)
    offloaded = local * hw.accelerators_per_node / a.cpu_adam_parameters_per_s + 2 * width * local / pcie
    pipedream = layout.schedule == 3  # an update after every microbatch's backward, and a stashed copy of each version
    optimizer_time = np.where(pipedream, m, 1.0) * np.where(layout.offload, offloaded, on_device) \
        + np.where(pipedream, m * 2 * width * local / memory_bw, 0.0) + gradient_handling

    step = m * slot + bubble + dp_exposed + optimizer_time
    seq = np.asarray(layout.seq, dtype=float)  # products of int64 sizes wrap past 9.2e18 (a 1e8-token sweep)
    step_tokens = layout.global_batch * seq
    model_flops = step_tokens * training_flops_per_token(model, layout.seq)
    gpus = layout.gpus.astype(float)
    mfu = model_flops / (step * gpus * hw.peak_flops)
    forward = step_tokens * forward_flops_per_token(model, layout.seq)
    attention_forward = step_tokens * 2 * seq * (d_qk + d_v) * model.layers
    logits_forward = step_tokens * 2 * breakdown.output_projection
    recomputed = np.where(full, forward - logits_forward, np.where(selective, attention_forward, 0.0))
    hfu = (model_flops + recomputed) / (step * gpus * hw.peak_flops)
    memory = training_memory(model, layout, hw.hbm_bytes, optimizer, hw.dtype, a, stages)
    feasible, reason_code = _feasibility(model, layout, memory)
    time_s = {
        "compute": m * compute, "tensor_parallel": m * tp_time * (1 - a.tensor_parallel_overlap),
        "expert_parallel": m * ep_time * (1 - a.expert_all_to_all_overlap), "context_parallel": m * cp_time,
        "pipeline_p2p": m * p2p_time, "pipeline_bubble": bubble, "data_parallel": dp_exposed,
        "optimizer": optimizer_time,
    }
    wire = {"tensor_parallel": m * tp_bytes, "expert_parallel": m * ep_bytes, "context_parallel": m * cp_bytes,
            "pipeline_p2p": np.where(p > 1, 2 * v * m * p2p_bytes, 0.0), "data_parallel": dp_bytes}
    return TrainingPrediction(
        step_s=step, mfu=mfu, hfu=hfu, tflops_per_gpu=model_flops / (step * gpus) / 1e12,
        tokens_per_s=step_tokens / step, bubble_fraction=pipeline_bubble_fraction(p, m, v),
        time_s=time_s, wire_bytes=wire, memory=memory, feasible=feasible, reason_code=reason_code, stages=stages,
        slowest_is_last=slowest_is_last,
    )


REASONS = (
    "",
    "TP does not divide the attention heads",
    "PP x interleave exceeds the layers",
    "EP > 1 needs a mixture-of-experts model",
    "EP does not divide the experts and DP",
    "global batch is not a multiple of DP x micro batch",
    "interleaved 1F1B needs microbatches divisible by PP",
    "CP needs the sequence divisible by 2 x CP (zig-zag shards)",
    "does not fit in memory",
)


def validate_layout(model: Model, layout: Layout) -> None:
    """Raise InvalidValue naming the field and what is valid for each rule a layout's first row breaks (all of them,
    as InvalidValues, when it breaks several).

    Memory is not a rule here: a layout that does not fit is a prediction (infeasible), not bad input.
    """
    row = layout.row(0)
    experts = model.moe.experts if model.moe else 1
    named = {
        1: ("tp", f"a divisor of the {model.heads} attention heads of {model.name}"),
        2: ("pp", f"PP x interleave at most the {model.layers} layers of {model.name} (a layer per virtual stage)"),
        3: ("ep", f"1, since {model.name} has no experts"),
        4: ("ep", f"a divisor of both the {experts} experts and DP={row['dp']}"),
        5: ("global_batch", f"a multiple of DP x micro batch = {row['dp'] * row['micro_batch']}"),
        6: ("global_batch", f"microbatches per pipeline divisible by PP={row['pp']} for the interleaved schedule"),
        7: ("cp", f"a CP with seq={row['seq']} divisible by 2 x CP"),
    }
    errors = []
    for index, broken in enumerate(_broken_rules(model, layout, None), start=1):
        if bool(np.asarray(broken).reshape(-1)[0]):
            field, valid = named[index]
            errors.append(InvalidValue(field, row[field], valid, reason=REASONS[index]))
    raise_all(errors)


def _broken_rules(model: Model, layout: Layout, memory: TrainingMemory | None) -> list:
    """Whether each layout breaks each rule of REASONS (in its order, from 1; memory's last, only given `memory`)."""
    m = layout.microbatches
    experts = 1 if model.moe is None else model.moe.experts
    return [
        model.heads % layout.tp != 0,
        layout.pp * np.where(layout.schedule == 2, layout.interleave, 1) > model.layers,  # uneven is fine: the
        # split is cost-balanced anyway (DeepSeek-V3 trained its 61 layers on PP 16)
        (model.moe is None) & (layout.ep > 1),
        (experts % layout.ep != 0) | (layout.dp % layout.ep != 0),
        (np.abs(m - np.round(m)) > 1e-9) | (m < 1),
        (layout.schedule == 2) & (np.round(m) % layout.pp != 0),
        (layout.cp > 1) & (layout.seq % (2 * layout.cp) != 0),  # zig-zag shards: 2·cp chunks (none without CP)
    ] + ([] if memory is None else [~memory.fits])


def _feasibility(model: Model, layout: Layout, memory: TrainingMemory):
    """(feasible, reason code) arrays: the first rule in REASONS each layout breaks, 0 if none."""
    broken = _broken_rules(model, layout, memory)
    code = np.zeros(layout.dp.shape, dtype=np.int8)
    for index in range(len(broken), 0, -1):
        code = np.where(broken[index - 1], index, code)
    return code == 0, code
