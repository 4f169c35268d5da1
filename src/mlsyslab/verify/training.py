"""A training run beside its prediction: bytes per rank by category, bytes on the wire by op, step time.

Model states must agree to the byte (padding included); wire bytes per op exactly (ring volumes);
activations and step time are models, shown with their ratio. Predicted:
- states: predict.memory.model_state_bytes over the padded parameter count Ψ the run reports (on a device mesh, rank
  0's after TP, PP and EP, its count without padding held against predict.memory.stage_parameters');
- wire per step with m microbatches per rank: DDP all-reduce 2(N−1)/N·Ψ; ZeRO-1 reduce-scatter and
  all-gather (N−1)/N·Ψ each; ZeRO-2 reduce-scatter m times; ZeRO-3 all-gather 2m times and
  reduce-scatter m times (bytes of the compute dtype);
- activations: what nn/ saves for backward in one microbatch's forward (predict.memory's eager accounting, at the
  run's dtype: the layers, the embedding, the head and the loss's fp32 log-probabilities);
- step time: predict.training.predict_training on `hardware` (after `mlsys calibrate`: --hardware local).
"""

import numpy as np

from mlsyslab.parallel.schedules import build, peak_held, timeline
from mlsyslab.predict.architecture import parameters
from mlsyslab.predict.assumptions import DEFAULT, Assumptions
from mlsyslab.predict.collectives import ring_all_reduce_bytes_per_rank, ring_shard_bytes_per_rank
from mlsyslab.predict.hardware import Hardware
from mlsyslab.predict.layout import Layout
from mlsyslab.predict.memory import (eager_chunk_activation_bytes, first_stage_activation_bytes, model_state_bytes,
                                     offloaded_optimizer_bytes, stage_parameters, stashed_versions)
from mlsyslab.predict.pipeline import stage_layers, virtual_stage_costs, virtual_stage_layers
from mlsyslab.predict.training import predict_training
from mlsyslab.specs.schema import DTYPE_BYTES, Model


def run_dtype(config) -> tuple[str, float]:
    """The run's compute dtype (--bf16 or fp32) and its bytes per element."""
    dtype = "bf16" if config.bf16 else "fp32"
    return dtype, DTYPE_BYTES[dtype]


def predicted_wire_bytes(strategy: str, padded_params: int, world: int, microbatches: int, element_bytes: int,
                         clipped: bool = False) -> dict:
    """Bytes each rank sends per step, by op; with `clipped`, ZeRO's all-reduce of the squared gradient norm (one
    fp32) too."""
    message = padded_params * element_bytes
    shard = float(ring_shard_bytes_per_rank(message, world))
    if strategy == "ddp":
        return {"all_reduce": float(ring_all_reduce_bytes_per_rank(message, world))}
    gathers = {"zero1": 1, "zero2": 1, "zero3": 2 * microbatches}[strategy]
    scatters = {"zero1": 1, "zero2": microbatches, "zero3": microbatches}[strategy]
    norm = {"all_reduce": float(ring_all_reduce_bytes_per_rank(4, world))} if clipped else {}
    return {"reduce_scatter": scatters * shard, "all_gather": gathers * shard, **norm}


def compare_training(config, result: dict, hardware: Hardware | None = None,
                     assumptions: Assumptions = DEFAULT) -> dict:
    spec = Model(**config.model)
    dtype, width = run_dtype(config)
    layout = Layout.of(dp=config.nproc, zero=config.zero_stage, micro_batch=config.micro_batch,
                       global_batch=config.global_batch, seq=config.seq, offload=config.offload)
    activations = saved_activation_bytes(spec, layout, stage_layers(spec, layout), width, assumptions)
    predicted_memory = {**predicted_model_states(config, [(result["padded_parameters"], config.nproc)]),
                        "activations": activations}
    measured_memory = {**result["held_bytes"], "activations": result["activation_bytes"]}
    wire = predicted_wire_bytes(config.strategy, result["padded_parameters"], config.nproc, config.microbatches, width,
                                bool(config.clip_grad_norm))
    report = {
        "memory_bytes": {k: _pair(predicted_memory[k], measured_memory.get(k, 0)) for k in predicted_memory},
        "wire_bytes_per_step": {op: _pair(wire.get(op, 0.0), result["wire_bytes_per_step"].get(op, 0.0))
                                for op in sorted(set(wire) | set(result["wire_bytes_per_step"]))},
        "step_s": _pair(None, float(np.median(result["step_s"][1:] or result["step_s"])) if result["step_s"] else None),
    }
    if hardware is not None:
        prediction = predict_training(spec, hardware, layout, assumptions=assumptions.override(
            {"gradient_reduce_bytes": width}))
        report["step_s"]["predicted"] = float(prediction.step_s.reshape(-1)[0])
        report["step_s"]["ratio"] = _ratio(report["step_s"]["measured"], report["step_s"]["predicted"])
    return report


def predicted_model_states(config, groups: list) -> dict:
    """Weights, gradients, optimizer state and host-offloaded bytes of a rank (predict.memory's model states) that
    shards each (parameters, ranks) of `groups` over its ranks by the run's ZeRO stage."""
    dtype, width = run_dtype(config)
    states = {"weights": 0.0, "gradients": 0.0, "optimizer": 0.0, "host_offload": 0.0}
    for count, ranks in groups:
        weights, gradients, optimizer = model_state_bytes(count, ranks, config.zero_stage, "adam", dtype,
                                                          config.offload)
        if config.strategy == "ddp" and config.bf16:  # DDP's --bf16 is bf16 weights: AdamW's moments in bf16, no master
            optimizer = 2.0 * width * count
        host = offloaded_optimizer_bytes(count, ranks, config.zero_stage) if config.offload else 0.0
        for category, value in zip(states, (weights, gradients, optimizer, host)):
            states[category] += float(value)
    return states


def _pair(predicted, measured) -> dict:
    predicted = None if predicted is None else float(predicted)
    return {"predicted": predicted, "measured": measured, "ratio": _ratio(measured, predicted)}


def _ratio(measured, predicted):
    if measured is None or predicted in (None, 0.0):
        return None
    return float(measured) / predicted


def compare_mesh_training(config, result: dict, hardware: Hardware | None = None,
                          assumptions: Assumptions = DEFAULT) -> dict:
    """A --tp/--pp/--cp/--ep run beside predict.training on the same layout: the parameters and model-state bytes rank
    0 holds (`predicted_mesh_states`), bytes each dimension sends per step on rank 0, the pipeline bubble (analytic,
    and simulated on the split's stage costs, vs the executed timeline), and the step time when `hardware` is given. Bytes and bubble do not depend on the hardware: without one they are taken
    from a prediction at the run's dtype on a catalog system (DGX-H100), whose times are not shown.
    Rank 0's bytes are predicted for the first stage's rank (predict.training's stage="first"), its activations by
    predict.memory (the first stage's), and the step time on the slowest rank: all for the layers each stage holds
    under the cost-balanced split, which predict computes as `parallel.pipeline.split` does."""
    from mlsyslab.specs import catalog

    spec = Model(**config.model)
    layout = Layout.of(dp=config.data_parallel, tp=config.tp, pp=config.pp, cp=config.cp, ep=config.ep,
                       zero=config.zero_stage,
                       micro_batch=config.micro_batch,
                       global_batch=config.global_batch, seq=config.seq, schedule=config.schedule,
                       interleave=config.interleave, sequence_parallel=config.sequence_parallel)
    dtype, width = run_dtype(config)  # width: the bytes of an activation and of a gradient on the wire
    carrier = hardware if hardware is not None else Hardware.of(*catalog.hardware("dgx-h100"), dtype)
    assumptions = assumptions.override({"gradient_reduce_bytes": width})
    prediction = predict_training(spec, carrier, layout, assumptions=assumptions, stage="first")
    first_layers = float(prediction.stages.first.reshape(-1)[0])
    # EP: predict's dispatch and combine of every routed copy, balanced over the experts; the measured
    # bytes follow the actual routing (dropped copies stay home, an uneven split sends more or less)
    wire = {name: float(np.asarray(value).reshape(-1)[0]) for name, value in prediction.wire_bytes.items()
            if name != "expert_parallel" or config.ep > 1}
    wire["tensor_parallel"] += vocab_parallel_bytes(config, spec, head=config.pp == 1)  # rank 0: the first stage
    # norm weights a rank applies to part of the data, their gradients summed over TP in every microbatch's backward
    # (parallel.tensor.TensorParallelNorm): under SP every norm (its tokens; rank 0's, the final on the last stage),
    # and Qwen3's query and key head norms (its heads)
    norms = (2 * first_layers + (config.pp == 1)) * spec.hidden if config.sequence_parallel else 0
    norms += 2 * first_layers * spec.attention_head_dim if spec.qk_norm and config.tp > 1 else 0
    if norms:
        wire["tensor_parallel"] += config.microbatches * float(ring_all_reduce_bytes_per_rank(norms * width, config.tp))
    v = config.interleave
    wire["pipeline_p2p"] *= (2 * v - 1) / (2 * v)  # the first stage sends no gradient back from virtual stage 0
    if config.pp > 1 and spec.tied_embeddings:  # the tied embedding's gradient, summed over the pipeline
        # (under ZeRO-2 and -3 each rank's slice of it, of a bucket or unit padded to a multiple of the DP ranks)
        elements = spec.vocab / config.tp * spec.hidden
        elements = -(-elements // config.data_parallel) if config.zero_stage >= 2 else elements
        wire["pipeline_p2p"] += float(ring_all_reduce_bytes_per_rank(elements * width, config.pp))
    if config.cp > 1 and config.zero_stage == 0:  # every rank holds all the weights: their gradients are
        # summed over the CP group (under ZeRO they are reduced over DP × CP instead: predict's DP term)
        wire["context_parallel"] += float(ring_all_reduce_bytes_per_rank(result["parameters"] * width, config.cp))
    if config.clip_grad_norm:  # the squared gradient norm's all-reduce over every rank (parallel/clipping.py): one fp32
        wire["gradient_norm"] = float(ring_all_reduce_bytes_per_rank(4, config.nproc))
    measured_step = float(np.median(result["step_s"][1:] or result["step_s"])) if result["step_s"] else None
    schedule = build(config.schedule, config.pp, config.microbatches, config.interleave) if config.pp > 1 else None
    per_stage = [saved_activation_bytes(spec, layout, prediction.stages, width, assumptions, schedule, stage)
                 for stage in range(config.pp if schedule is not None else 1)]  # rank 0's first
    held = per_stage[0]
    dense, experts = (float(np.asarray(count).reshape(-1)[0])
                      for count in stage_parameters(parameters(spec), layout, prediction.stages, "first"))
    memory = predicted_mesh_states(config, result)
    report = {
        "parameters": _pair(dense + experts, result["parameters"]),
        "memory_bytes": {**{category: _pair(memory[category], result["held_bytes"].get(category))
                            for category in memory}, "activations": _pair(held, result["activation_bytes"])},
        "wire_bytes_per_step": {name: _pair(wire[name], result["wire_bytes_per_step"].get(name, 0.0)) for name in wire},
        "stage_layers": _pair(first_layers, result["stage_layers"]),
        "bubble": _pair(float(np.asarray(prediction.bubble_fraction).reshape(-1)[0]) if config.pp > 1 else None,
                        result.get("bubble")),
        # the same schedule simulated with each virtual stage's forward FLOPs: the split can leave them unequal (the
        # output layer is one piece), which the analytic bubble, of equal stages, does not see
        "bubble_on_split": _pair(timeline(schedule, stage_costs=virtual_stage_costs(spec, config.pp * config.interleave)
                                          ).bubble if schedule is not None else None, result.get("bubble")),
        # the schedule at the executed actions' own times: what the ranks' compute left; the executed bubble over it
        # is the executor's (transfers, waits for a receive)
        "bubble_replayed": _pair(result.get("replayed_bubble"), result.get("bubble")),
        "step_s": _pair(None, measured_step),
    }
    if schedule is not None and result.get("stage_activation_bytes"):  # every stage's, the heaviest beside predict's
        measured = result["stage_activation_bytes"]
        most = int(np.argmax(measured))
        report["heaviest_activations"] = {"stage": most, "predicted_stage": int(np.argmax(per_stage)),
                                          **_pair(per_stage[most], measured[most])}
    heaviest = result.get("heaviest_rank")
    if heaviest:  # the rank holding the most, against predict's heaviest (what the planner's memory per GPU prices)
        dense, experts = stage_parameters(parameters(spec), layout, prediction.stages, "heaviest")
        states = predicted_mesh_states(config, heaviest, heaviest["stage"])
        report["heaviest_rank"] = {
            "rank": heaviest["rank"], "stage": heaviest["stage"],
            "parameters": _pair(float(np.asarray(dense + experts).reshape(-1)[0]), heaviest["parameters"]),
            "memory_bytes": {category: _pair(states[category], heaviest["held_bytes"].get(category))
                             for category in states}}
    if hardware is not None:
        timed = predict_training(spec, carrier, layout, assumptions=assumptions)
        report["step_s"] = _pair(float(timed.step_s.reshape(-1)[0]), measured_step)
    return report


def predicted_mesh_states(config, result: dict, stage: int = 0) -> dict:
    """The model states on a mesh (predict.memory's) of a rank of pipeline stage `stage` holding `result`'s parameters:
    ZeRO shards the dense weights over the DP × CP ranks and the experts over the dp·cp/ep ranks holding the same ones,
    each group padded as the run reports (predict's parameter count without padding is the report's "parameters" row);
    PipeDream also keeps a copy of the stage's weights for each version still owed a backward
    (predict.memory.stashed_versions)."""
    dense_and_experts, experts = result["padded_parameters"], result["padded_expert_parameters"]
    ranks = config.data_parallel * config.cp
    states = predicted_model_states(config, [(dense_and_experts - experts, ranks), (experts, ranks // config.ep)])
    if config.schedule == "pipedream" and config.pp > 1:
        states["weights"] += float(stashed_versions(config.pp, config.microbatches, stage)) * run_dtype(config)[1] \
            * dense_and_experts
    return states


def saved_activation_bytes(spec: Model, layout: Layout, stages, width: float,
                           assumptions: Assumptions = DEFAULT, schedule=None, rank: int = 0) -> float:
    """What pipeline rank `rank` holds for backward at once: predict.memory's count of what nn/ saves (its eager
    accounting) at the run's `width` bytes an activation — for the layers the first stage holds, the embedding and,
    without PP, the head and the loss, times the microbatches the schedule keeps in flight; under PP (`schedule`: a
    `parallel.schedules.Schedule`) each of the rank's chunks weighed by its own layers (the embedding with the first
    virtual stage, the head and the loss with the last) through the rank's order, since the cost-balanced split can
    leave an interleaved rank's chunks unequal where the closed form takes them as equal."""
    eager = assumptions.override({"eager_activations": True})
    if schedule is None:
        return float(np.asarray(first_stage_activation_bytes(spec, layout, stages, width, eager)).reshape(-1)[0])
    p, v = schedule.stages, schedule.chunks
    split = virtual_stage_layers(spec, p * v)
    stage = lambda c: c * p + rank  # noqa: E731 - the virtual stage of the rank's chunk c
    chunks = [float(np.asarray(eager_chunk_activation_bytes(spec, layout, width, *split[stage(c)], stage(c) == 0,
                                                            stage(c) == p * v - 1)).reshape(-1)[0]) for c in range(v)]
    return float(peak_held(schedule.actions[rank], chunks))


def vocab_parallel_bytes(config, spec: Model, head: bool = True) -> float:
    """TP bytes per step outside the decoder layers, which predict.training (4 per layer) leaves out:
    the vocabulary-parallel embedding's all-reduce of b·s·h forward, and on the stage with the head,
    its input-gradient all-reduce of b·s·h backward (in the run's dtype) and the loss's three all-reduces
    of b·s fp32 (maximum, sum of exponentials, target logit), and under SP the head's all-gather of its input
    again in backward — per microbatch, ring volumes."""
    if config.tp == 1:
        return 0.0
    tokens = config.micro_batch * config.seq / config.cp
    width = run_dtype(config)[1]
    per_microbatch = tokens * spec.hidden * width + (tokens * spec.hidden * width + 3 * tokens * 4 if head else 0.0)
    regather = tokens * spec.hidden * width if head and config.sequence_parallel else 0.0  # the head's, in backward
    return config.microbatches * float(ring_all_reduce_bytes_per_rank(per_microbatch, config.tp)
                                       + ring_shard_bytes_per_rank(regather, config.tp))
