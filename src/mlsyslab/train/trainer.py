"""The data-parallel trainer: one loop for DDP and ZeRO-1/2/3 (+ offload, bf16) over the nn/ Llama.

Each rank builds the same model (seeded), wraps it in its strategy, and runs `steps` optimizer
steps of `global_batch` sequences: its share split into microbatches whose gradients accumulate
(DDP and ZeRO-1 communicate only on the last one). Every `checkpoint_every` steps it saves a
checkpoint (train/checkpoint.py); with `resume` it continues from the newest complete one, seeing the
very batches the uninterrupted run would have. It measures what predict states: bytes held per
category (from the tensors), activations saved for backward, bytes sent per op (the CommLog), and
the time per step. Launched by `mlsys train` under torchrun's agent (comm/launch.py, train/worker.py). AdamW's
learning rate is set before each step, constant or warmed up and cosine-decayed (`TrainConfig.lr_at`), on every
optimizer the rank steps, in both trainers; the report lists each step's. --clip-grad-norm clips the gradient to
the whole model's L2 norm before each update, reporting each step's norm: DDP with torch's clip_grad_norm_ on its
whole gradients, ZeRO from the shards (`ZeroDataParallel.step`), the mesh trainer from every rank's pieces, each
counted once (parallel/clipping.py; not under PipeDream's schedule, whose stages step after each microbatch).

With --tp / --pp / --cp > 1 the same loop runs `parallel.mesh.composed_step` on a device mesh
(DP × PP × CP × TP, with EP inside DP; `train_on_mesh`) and measures the bytes each dimension sends, the
activations rank 0 holds at once (in its first step) and, under PP, the bubble of the executed timeline (and of
the schedule replayed at the executed actions' times), for
`verify.training.compare_mesh_training`;
`--strategy zero1` shards the optimizer state along DP, and zero2 / zero3 also the gradients / weights
(with every layout: parallel/mesh_zero.py). An MoE model (a catalog spec with
`moe`, e.g. from --model-spec) always takes the mesh trainer, which adds its load-balancing loss; --ep
splits its experts over the DP ranks, --tp splits every expert (and with both, each TP slice of the
experts is spread over EP). --sequence-parallel (under TP) splits the activations between
blocks, and between pipeline stages, along the sequence and sums the norms' gradients over TP in backward.
Under --cp every ZeRO stage shards over the DP and CP ranks together (they hold the same weights);
under --ep an MoE model's experts are sharded over the DP × CP ranks that hold the same experts.
Under --pp, ZeRO-2 and -3 sum the tied embedding's gradient over the pipeline slice by slice (it has a
bucket, or a unit, of its own on both stages). Checkpoints inside the mesh hold every rank's own part
(`checkpoint.mesh_state`) and resume on the same layout. --bf16 and --offload work there too: under ZeRO
mixed precision (bf16 compute and wire, fp32 masters; CP's gradient accumulators stay fp32), under DDP
bf16 weights. With or without --pp each rank's share runs as --micro-batch-sized microbatches whose
gradients accumulate — except under --schedule pipedream, where each stage steps its optimizer after every
microbatch's backward (weight stashing, parallel/weight_stash.py): a pipeline alone (no DP, TP, CP, EP or ZeRO,
whose reductions happen once a step) of a model with untied embeddings (the first and last stage would update
their two copies apart).
"""

import math
import statistics
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from mlsyslab.comm.launch import Rank
from mlsyslab.comm.log import CommLog
from mlsyslab.errors import InvalidValue
from mlsyslab.measure.memory import ActivationMeter, model_state_bytes, plain_model_state_tensors
from mlsyslab.nn.llama import Llama, LlamaConfig
from mlsyslab.nn.optimizer import adamw
from mlsyslab.parallel.clipping import clip_gradients, piece_weights
from mlsyslab.parallel.ddp import DataParallel
from mlsyslab.parallel.mesh import MeshLayout, build_mesh, composed_step, expert_parameters, prepare
from mlsyslab.parallel.mesh_zero import MeshZero
from mlsyslab.parallel.pipeline import executed_timeline, replayed_timeline
from mlsyslab.parallel.schedules import SCHEDULES, chrome_trace, render_png
from mlsyslab.parallel.schedules import build as build_schedule
from mlsyslab.parallel.tensor import split_parameters
from mlsyslab.parallel.zero import ZeroDataParallel
from mlsyslab.specs.schema import Model
from mlsyslab.train import checkpoint
from mlsyslab.train.data import TokenBatches

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
LR_SCHEDULES = ("constant", "cosine")


@dataclass
class TrainConfig:
    model: dict  # a catalog Model spec (specs.schema.Model fields)
    strategy: str = "ddp"
    nproc: int = 2
    steps: int = 10
    seq: int = 128
    global_batch: int = 8
    micro_batch: int = 2  # sequences per microbatch per rank
    lr: float = 3e-4  # the peak, after any warmup
    lr_schedule: str = "constant"  # or "cosine": decay to min_lr_ratio · lr at the last step (`lr_at`)
    warmup_steps: int = 0  # linear warmup to lr over the first steps
    min_lr_ratio: float = 0.1
    clip_grad_norm: float = 0.0  # > 0: clip the gradient to this global L2 norm before each update (not under pipedream)
    bf16: bool = False
    offload: bool = False
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # 0: only at the end (when checkpoint_dir is set)
    resume: bool = False
    bucket_bytes: int = 25_000_000
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int | None = None  # None: nproc / (tp · pp · cp)
    schedule: str = "1f1b"
    interleave: int = 1  # model chunks per pipeline rank (interleaved 1F1B)
    timeline: str | None = None  # under PP: where rank 0 draws the last step's executed timeline (.png or .json)
    sequence_parallel: bool = False  # under TP: activations between blocks split along the sequence (Korthikanti)

    @property
    def on_mesh(self) -> bool:
        """The mesh trainer: any model parallelism, or an MoE model (its loss adds the load-balancing term)."""
        return self.tp * self.pp * self.cp * self.ep > 1 or bool(self.model.get("moe"))

    @property
    def zero_stage(self) -> int:
        """0 for plain data parallelism (ddp), else the ZeRO stage the strategy names."""
        return 0 if self.strategy == "ddp" else int(self.strategy[-1])

    @property
    def layout(self) -> MeshLayout:
        return MeshLayout(self.data_parallel, self.pp, self.cp, self.tp, self.ep)

    @property
    def data_parallel(self) -> int:
        return self.dp if self.dp is not None else max(1, self.nproc // (self.tp * self.pp * self.cp))

    def validate(self) -> None:
        """Every rule, checked before any process starts."""
        if self.strategy not in STRATEGIES:
            raise InvalidValue("strategy", self.strategy, ", ".join(STRATEGIES))
        for name in ("tp", "pp", "cp", "ep", "interleave", "nproc", "steps", "seq", "global_batch", "micro_batch"):
            if getattr(self, name) < 1:
                raise InvalidValue(name, getattr(self, name), "an integer >= 1")
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise InvalidValue("lr", self.lr, "a finite number >= 0")
        if self.lr_schedule not in LR_SCHEDULES:
            raise InvalidValue("lr_schedule", self.lr_schedule, ", ".join(LR_SCHEDULES))
        if not 0 <= self.warmup_steps <= self.steps:
            raise InvalidValue("warmup_steps", self.warmup_steps, f"0..{self.steps} (--steps)")
        if self.lr_schedule == "cosine" and self.warmup_steps >= self.steps:
            raise InvalidValue("warmup_steps", self.warmup_steps, f"fewer than the {self.steps} --steps, for the "
                               "cosine to decay after the warmup")
        if not 0 <= self.min_lr_ratio <= 1:
            raise InvalidValue("min_lr_ratio", self.min_lr_ratio, "in [0, 1]")
        if not (math.isfinite(self.clip_grad_norm) and self.clip_grad_norm >= 0):
            raise InvalidValue("clip_grad_norm", self.clip_grad_norm, "a finite number >= 0 (0: off)")
        if self.clip_grad_norm and self.schedule == "pipedream" and self.pp > 1:
            raise InvalidValue("clip_grad_norm", self.clip_grad_norm, "0 under --schedule pipedream (its stages step "
                               "after every microbatch's backward, with no whole-step gradient to clip)")
        if self.checkpoint_every < 0:
            raise InvalidValue("checkpoint_every", self.checkpoint_every, "an integer >= 0 (0: at the end only)")
        if self.schedule not in SCHEDULES:
            raise InvalidValue("schedule", self.schedule, ", ".join(SCHEDULES))
        if self.interleave > 1 and (self.schedule != "interleaved" or self.pp == 1):
            raise InvalidValue("interleave", self.interleave, "1 unless --schedule interleaved with --pp > 1")
        if self.dp is not None and self.dp < 1:
            raise InvalidValue("dp", self.dp, "an integer >= 1")
        model_ranks = self.tp * self.pp * self.cp
        if self.on_mesh and self.dp is None and self.nproc % model_ranks:
            raise InvalidValue("nproc", self.nproc, f"a multiple of tp·pp·cp = {model_ranks}; without --dp, data "
                               "parallelism takes the rest")
        if self.on_mesh:
            self._validate_mesh()
        elif self.dp is not None and self.dp != self.nproc:
            raise InvalidValue("dp", self.dp, f"nproc={self.nproc} when tp, pp and cp are 1")
        if self.sequence_parallel and (self.tp == 1 or self.seq % (self.tp * self.cp)):
            raise InvalidValue("sequence_parallel", True, f"with --tp > 1, --tp × --cp dividing --seq "
                               f"(tp={self.tp}, seq={self.seq}, cp={self.cp})")
        if self.timeline is not None and (self.pp == 1 or Path(self.timeline).suffix not in (".png", ".json")
                                          or not Path(self.timeline).parent.is_dir()):
            raise InvalidValue("timeline", self.timeline, "a .png (chart) or .json (Chrome / Perfetto trace) path in an "
                               "existing folder, with --pp > 1")
        if self.offload and not self.strategy.startswith("zero"):
            raise InvalidValue("offload", True, "with --strategy zero1, zero2 or zero3 (ZeRO-Offload)")
        dp = self.data_parallel
        if dp > self.global_batch:
            raise InvalidValue("nproc" if not self.on_mesh else "dp", dp, f"<= the global batch of {self.global_batch} sequences")
        if self.global_batch % dp:
            raise InvalidValue("global_batch", self.global_batch, f"a multiple of the data-parallel size {dp}")
        if (self.global_batch // dp) % self.micro_batch:
            raise InvalidValue("micro_batch", self.micro_batch,
                               f"a divisor of the {self.global_batch // dp} sequences per data-parallel rank")
        if self.resume and not self.checkpoint_dir:
            raise InvalidValue("resume", True, "only with --checkpoint-dir (the run to resume)")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise InvalidValue("checkpoint_every", self.checkpoint_every, "with --checkpoint-dir (where to write them)")
        if self.pp == 1 and self.schedule != "1f1b":
            raise InvalidValue("schedule", self.schedule, "1f1b (the default) without --pp: there is no pipeline")
        newest = checkpoint.completed(self.checkpoint_dir)[-1:] if self.resume else []
        if newest:
            checkpoint.check_complete(newest[0])
            checkpoint.check_resumable(newest[0], self.checkpoint_fields)
        spec = Model(**self.model)
        if self.seq > spec.max_seq:
            raise InvalidValue("seq", self.seq, f"<= the {spec.max_seq}-token context of {spec.name}")
        model = LlamaConfig.from_spec(spec)  # raises for an architecture nn/ does not build
        if self.on_mesh:
            self.layout.validate(model, self.nproc, self.seq, self.microbatches)
            if self.pp > 1:
                if self.pp * self.interleave > model.layers:  # uneven stages are fine: the split balances cost
                    raise InvalidValue("interleave", self.interleave,
                                       f"pp·interleave at most the {model.layers} layers (pp={self.pp})")
                build_schedule(self.schedule, self.pp, self.microbatches, self.interleave)
        if self.checkpoint_dir:  # last: the only check that leaves something behind (the folder)
            try:
                Path(self.checkpoint_dir).mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise InvalidValue("checkpoint_dir", self.checkpoint_dir,
                                   f"a folder this process can create ({error.strerror})") from None

    def _validate_mesh(self) -> None:
        """What the mesh trainer does not do yet, named before launch."""
        if self.schedule == "pipedream" and (self.data_parallel * self.tp * self.cp * self.ep > 1 or self.strategy != "ddp"
                                             or self.model.get("tied_embeddings")):
            # each stage updates after every backward: DP's or ZeRO's reduction and the tied embedding's summed
            # gradient (first and last stage) all happen once a step, so none of them can follow
            raise InvalidValue("schedule", self.schedule, "gpipe, 1f1b or interleaved; pipedream on a pipeline alone "
                               "(--dp/--tp/--cp/--ep 1, --strategy ddp) and a model with untied embeddings")

    def lr_at(self, step: int) -> float:
        """The learning rate of update `step` (0-based): linear warmup to `lr` over `warmup_steps` updates, then
        constant, or a cosine decay reaching min_lr_ratio · lr at the last step (the schedule of Llama's and
        Chinchilla's runs: Touvron et al. 2023, Hoffmann et al. 2022). A function of the step alone, so a resumed run
        takes up the schedule where it stopped."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.lr_schedule == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.steps - 1 - self.warmup_steps))
        low = self.min_lr_ratio * self.lr
        return low + (self.lr - low) * 0.5 * (1 + math.cos(math.pi * progress))

    @property
    def checkpoint_fields(self) -> dict:
        """What decides a checkpoint's keys and shapes, kept with it: a resume must match each."""
        return {"model": self.model, "strategy": self.strategy, "nproc": self.nproc, "tp": self.tp, "pp": self.pp,
                "cp": self.cp, "ep": self.ep, "dp": self.data_parallel, "interleave": self.interleave,
                "schedule": self.schedule if self.pp > 1 else None, "bf16": self.bf16, "offload": self.offload,
                # the mesh's ZeRO-3 shards a decoder layer a unit since 2026-11-27 (before: each module), so its
                # slices' shapes changed; a checkpoint without this field is refused before launch, not by DCP
                "zero3_unit": "decoder layer" if self.on_mesh and self.zero_stage == 3 else None}

    @property
    def microbatches(self) -> int:
        return self.global_batch // self.data_parallel // self.micro_batch


@dataclass
class TrainResult:
    losses: list = field(default_factory=list)  # mean over ranks, per step run in this process
    lrs: list = field(default_factory=list)  # the learning rate of each of those steps
    grad_norms: list = field(default_factory=list)  # with clip_grad_norm: each step's gradient norm before clipping
    first_step: int = 0
    step_s: list = field(default_factory=list)
    parameters: int = 0
    padded_parameters: int = 0
    padded_expert_parameters: int = 0  # on a mesh under ZeRO with EP: those of the experts (their own ZeRO group)
    held_bytes: dict = field(default_factory=dict)  # rank 0, by category
    held_bytes_max: dict = field(default_factory=dict)  # the largest over ranks
    heaviest_rank: dict = field(default_factory=dict)  # on a mesh: the rank holding the most parameters (the first
    # of them), its pipeline stage, parameters (and padded as ZeRO pads them) and model-state bytes by category
    activation_bytes: int = 0  # saved for backward on rank 0: by one microbatch; on a mesh, the most held at once
    stage_activation_bytes: list = field(default_factory=list)  # on a mesh: the most held at once on each pipeline
    # stage's ranks
    stage_layers: int = 0  # on a mesh: the decoder layers rank 0 holds (its pipeline stages')
    wire_bytes_per_step: dict = field(default_factory=dict)  # rank 0, by op (on a mesh: by dimension)
    tokens_per_s: float = 0.0
    bubble: float | None = None  # on a mesh with pp > 1: median executed bubble (steps after the first)
    replayed_bubble: float | None = None  # the schedule at the executed actions' times, waits left out (same steps)

    def to_dict(self) -> dict:
        return asdict(self)


def set_lr(optimizers: list, lr: float) -> float:
    """Every param group of `optimizers` at `lr` for the coming update(s); returns lr."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr
    return lr


def build_model(config: TrainConfig, dtype: torch.dtype) -> Llama:
    spec = Model(**config.model)
    generator = torch.Generator().manual_seed(config.seed)
    return Llama(LlamaConfig.from_spec(spec)).initialize(generator=generator).to(dtype)


def train(rank: Rank, config: TrainConfig, tokens: torch.Tensor, progress=None) -> TrainResult:
    """Run on every rank; returns the measurements (meaningful on every rank, reported from rank 0)."""
    if config.on_mesh:
        return train_on_mesh(rank, config, tokens, progress)
    torch.manual_seed(config.seed)
    log = CommLog()
    model = build_model(config, torch.float32)
    parameters = sum(p.numel() for p in model.parameters())
    optimizer_factory = lambda params: adamw(params, config.lr)  # noqa: E731
    if config.strategy == "ddp":
        if config.bf16:
            model = model.to(torch.bfloat16)
        wrapped = DataParallel(model, rank, config.bucket_bytes, log)
        optimizer = optimizer_factory(wrapped.parameters())

        def step_fn():  # DDP's gradients are whole and the same on every rank: torch's clipping as on one process
            norm = torch.nn.utils.clip_grad_norm_(wrapped.parameters(), config.clip_grad_norm).item() \
                if config.clip_grad_norm else None
            optimizer.step()
            return norm
        zero_grad = lambda: optimizer.zero_grad(set_to_none=True)  # noqa: E731
        state_tensors = lambda: plain_model_state_tensors(model, optimizer)  # noqa: E731
        padded = sum(p.numel() for p in model.parameters())
    else:
        wrapped = ZeroDataParallel(model, rank, config.zero_stage, optimizer_factory, mixed_precision=config.bf16,
                                   offload=config.offload, bucket_bytes=config.bucket_bytes, log=log,
                                   units=list(model.layers))  # ZeRO-3 gathers one decoder layer at a time
        optimizer = wrapped.optimizer
        step_fn = lambda: wrapped.step(config.clip_grad_norm)  # noqa: E731
        zero_grad, state_tensors = wrapped.zero_grad, wrapped.model_state_tensors
        padded = wrapped.padded_numel
    start = 0
    if config.resume:
        start = checkpoint.load_latest(config.checkpoint_dir, [optimizer],
                                       lambda: checkpoint.trainer_state(rank, wrapped, optimizer))
    data = TokenBatches(tokens, config.seq, config.global_batch, config.seed)
    result = TrainResult(first_step=start, parameters=parameters, padded_parameters=padded)
    log.reset()
    meter = ActivationMeter()
    for step in range(start, config.steps):
        began = time.perf_counter()
        result.lrs.append(set_lr([optimizer], config.lr_at(step)))
        inputs, targets = data.step(step, rank.rank, rank.world_size)
        total = torch.zeros(())
        for micro, (x, y) in enumerate(zip(inputs.split(config.micro_batch), targets.split(config.micro_batch))):
            last = micro == config.microbatches - 1
            measure = last and step == config.steps - 1
            with (wrapped.no_sync() if not last else nullcontext()), (meter.track([*model.parameters(), x, y]) if measure else nullcontext()):
                logits = wrapped(x)
                loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
                (loss / config.microbatches).backward()
            total += loss.detach() / config.microbatches
        norm = step_fn()
        if norm is not None:
            result.grad_norms.append(norm)
        if step == config.steps - 1:
            held = model_state_bytes(state_tensors())
        zero_grad()
        result.step_s.append(time.perf_counter() - began)
        dist.all_reduce(total, group=rank.group)  # metrics only: not logged as training traffic
        result.losses.append(total.item() / rank.world_size)
        if progress is not None:
            progress(step + 1, result.losses[-1], config.global_batch * config.seq / result.step_s[-1])
        if config.checkpoint_dir and _checkpoint_due(config, step):
            checkpoint.save(config.checkpoint_dir, step + 1, rank, checkpoint.trainer_state(rank, wrapped, optimizer),
                            config.checkpoint_fields)
    steps_run = max(1, config.steps - start)
    result.wire_bytes_per_step = {op: v["bytes_sent"] / steps_run for op, v in log.as_dict().items()}
    if config.steps > start:
        result.held_bytes = held
        result.activation_bytes = meter.saved_bytes
        everyone = [None] * rank.world_size
        dist.all_gather_object(everyone, held, group=rank.group)
        result.held_bytes_max = {k: max(d[k] for d in everyone) for k in held}
        steady = result.step_s[1:] or result.step_s
        result.tokens_per_s = config.global_batch * config.seq / statistics.median(steady)
    return result


def train_on_mesh(rank: Rank, config: TrainConfig, tokens: torch.Tensor, progress=None) -> TrainResult:
    """The loop above on a DP × PP × CP × TP mesh: every rank reads the global batch and
    `composed_step` takes its share; AdamW steps on the parameters this rank holds."""
    torch.manual_seed(config.seed)
    logs = {dimension: CommLog() for dimension in ("tensor_parallel", "expert_parallel", "pipeline_p2p",
                                                    "context_parallel", "data_parallel")
            + (("gradient_norm",) if config.clip_grad_norm else ())}
    compute = torch.bfloat16 if config.bf16 else torch.float32  # ZeRO casts its weights to it (mixed precision)
    model = build_model(config, compute if config.strategy == "ddp" else torch.float32)
    mesh = build_mesh(rank, config.layout)
    model, pipeline = prepare(model, mesh, config.microbatches, config.schedule, config.interleave, logs, compute,
                              config.sequence_parallel)
    module = pipeline.chunks if pipeline is not None else model
    held = list(module.parameters())
    optimizer_factory = lambda params: adamw(params, config.lr)  # noqa: E731
    zero = None
    tied = (model.embed_tokens.weight,) if pipeline is not None and model.config.tied_embeddings else ()
    if config.strategy != "ddp":
        zero = MeshZero(model, module, mesh, config.zero_stage, optimizer_factory, config.bucket_bytes, logs["data_parallel"], tied,
                        mixed_precision=config.bf16, offload=config.offload, norm_log=logs.get("gradient_norm"))
    weights = None if zero else piece_weights(held, mesh, split_parameters(module), expert_parameters(model), tied,
                                              sharded=False)  # clipping's count of each gradient piece
    optimizer = optimizer_factory(held) if zero is None else None  # under ZeRO the wrappers own the optimizers
    zeros = zero.zeros if zero is not None else []
    state = lambda: checkpoint.mesh_state(rank, module, optimizer, zeros)  # noqa: E731
    start = 0
    if config.resume:
        start = checkpoint.load_latest(config.checkpoint_dir, [z.optimizer for z in zeros] or [optimizer], state)
    data = TokenBatches(tokens, config.seq, config.global_batch, config.seed)
    count = sum(p.numel() for p in held)
    result = TrainResult(first_step=start, parameters=count, padded_parameters=count)
    if zero is not None:
        dense, experts = zero.padded_numel
        result.padded_parameters, result.padded_expert_parameters = dense + experts, experts
    result.stage_layers = sum(len(chunk.layers) for chunk in pipeline.chunks) if pipeline else model.config.layers
    bubbles, replayed, executed, meter = [], [], None, ActivationMeter()
    for step in range(start, config.steps):
        began = time.perf_counter()
        result.lrs.append(set_lr([z.optimizer for z in zeros] or [optimizer], config.lr_at(step)))
        inputs, targets = data.step(step, 0, 1)  # the global batch: composed_step shards it
        measure = meter if step == start else None  # the activations held at once, in the first step run
        last = step == config.steps - 1  # the bytes each rank holds are measured after its update
        if config.schedule == "pipedream":  # the stages stepped the optimizer after every backward
            loss = composed_step(model, mesh, inputs, targets, config.microbatches, pipeline, logs, optimizer=optimizer,
                                 meter=measure)
            if last:  # besides the live weights, the most the stash held; each version's gradient lived until its update
                result.held_bytes = held_by_rank(plain_model_state_tensors(module, optimizer), model)
                result.held_bytes["weights"] += sum(stash.peak_copy_bytes for stash in pipeline.stashes)
                result.held_bytes["gradients"] = sum(stash.peak_gradient_bytes for stash in pipeline.stashes)
        elif zero is None:
            loss = composed_step(model, mesh, inputs, targets, config.microbatches, pipeline, logs, meter=measure)
            if config.clip_grad_norm:
                result.grad_norms.append(clip_gradients(held, weights, config.clip_grad_norm, logs["gradient_norm"]))
            optimizer.step()
            if last:
                result.held_bytes = held_by_rank(plain_model_state_tensors(module, optimizer), model)
            optimizer.zero_grad(set_to_none=True)
        else:
            loss, norm = zero.train_step(lambda tied_gradient: composed_step(
                model, mesh, inputs, targets, config.microbatches, pipeline, logs, reduce_data_parallel=False,
                tied_gradient=tied_gradient, meter=measure), config.clip_grad_norm,
                (lambda tensors: result.held_bytes.update(held_by_rank(tensors, model))) if last else None)
            if norm is not None:
                result.grad_norms.append(norm)
        result.step_s.append(time.perf_counter() - began)
        result.losses.append(loss)
        if pipeline is not None:
            spans = [None] * config.pp
            dist.all_gather_object(spans, pipeline.last_spans, group=mesh.pp.group)
            executed = executed_timeline(pipeline.schedule, spans)
            bubbles.append(executed.bubble)
            replayed.append(replayed_timeline(pipeline.schedule, spans).bubble)
        if progress is not None:
            progress(step + 1, loss, config.global_batch * config.seq / result.step_s[-1])
        if config.checkpoint_dir and _checkpoint_due(config, step):
            checkpoint.save(config.checkpoint_dir, step + 1, rank, state(), config.checkpoint_fields)
    if config.timeline and executed is not None and rank.rank == 0:
        if config.timeline.endswith(".png"):
            render_png(pipeline.schedule, executed, config.timeline, "seconds")
        else:
            Path(config.timeline).write_text(chrome_trace(executed))
    result.activation_bytes = meter.peak_bytes
    if config.steps > start:  # the rank whose model states the planner's memory per accelerator prices
        mine = {"rank": rank.rank, "stage": mesh.pp.rank, "parameters": result.parameters,
                "padded_parameters": result.padded_parameters,
                "padded_expert_parameters": result.padded_expert_parameters, "held_bytes": result.held_bytes,
                "activation_bytes": result.activation_bytes}
        everyone = [None] * rank.world_size
        dist.all_gather_object(everyone, mine, group=rank.group)
        result.heaviest_rank = max(everyone, key=lambda r: r["parameters"])
        result.stage_activation_bytes = [max(r["activation_bytes"] for r in everyone if r["stage"] == stage)
                                         for stage in range(config.pp)]
    steps_run = max(1, config.steps - start)
    result.wire_bytes_per_step = {name: sum(log.bytes_sent.values()) / steps_run for name, log in logs.items()}
    result.bubble = statistics.median(bubbles[1:] or bubbles) if bubbles else None
    result.replayed_bubble = statistics.median(replayed[1:] or replayed) if replayed else None
    if result.step_s:
        result.tokens_per_s = config.global_batch * config.seq / statistics.median(result.step_s[1:] or result.step_s)
    return result


def held_by_rank(tensors: dict, model: Llama) -> dict:
    """Bytes by category of the model states `tensors` (the rank's share), its weights counted with every weight the
    rank's copy of the whole model still holds — none beyond its share where the other pipeline stages' parts are on
    the meta device (`parallel.pipeline.release_other_stages`), which is what the count checks."""
    kept = [p for p in model.parameters() if p.device.type != "meta"]
    return model_state_bytes({**tensors, "weights": [*tensors["weights"], *kept]})


def _checkpoint_due(config: TrainConfig, step: int) -> bool:
    done = step + 1
    return done == config.steps or (config.checkpoint_every > 0 and done % config.checkpoint_every == 0)


def default_micro_batch(global_batch: int, nproc: int, pp: int = 1) -> int:
    """Sequences per microbatch when none is asked: the most, up to 4, that divide a rank's share and leave at least
    `pp` microbatches to fill a pipeline (the default once ignored it, and the layout was then refused)."""
    per_rank = global_batch // nproc
    fitting = [d for d in range(1, min(per_rank, 4) + 1) if per_rank % d == 0 and per_rank // d >= pp]
    return max(fitting) if fitting else 1
