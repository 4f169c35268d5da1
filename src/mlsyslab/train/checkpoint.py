"""Checkpoints with torch.distributed.checkpoint (DCP): every rank writes what only it holds.

Data parallelism (`trainer_state`): replicated state (DDP's and ZeRO-1/2's full weights and DDP's
optimizer state) is stored once; sharded state (ZeRO's master slices, optimizer slices, ZeRO-3
parameter shards) under rank-specific keys. On a device mesh (`mesh_state`) every rank holds a
different piece — its TP shards, pipeline stages, experts, ZeRO slices — so all of it is stored under
the rank's keys. Either way a run resumes on the same ranks and layout: each checkpoint keeps the fields of the run
that wrote it that decide its keys and shapes (`run.json`: the model, strategy, ranks and layout), and a resume that
differs in one is refused by name before launch (`check_resumable`). A checkpoint is written to
`step_N.partial` and renamed to `step_N` only after every rank finished, so a run killed mid-write
leaves the previous checkpoint as the newest complete one. Resuming restores weights, fp32 masters
and AdamW state in place: the following steps reproduce an uninterrupted run bitwise on CPU
(tests/train/test_train.py, both trainers).
"""

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from mlsyslab.comm.launch import Rank
from mlsyslab.errors import InvalidValue

RUN_FILE = "run.json"


def save(directory: str, step: int, rank: Rank, state: dict, run: dict) -> Path:
    """Write `state` (`trainer_state` or `mesh_state`) as checkpoint `step` of `directory`, with `run` (the writing
    run's fields a resume must match, `TrainConfig.checkpoint_fields`)."""
    root = Path(directory)
    final, partial = root / f"step_{step:08d}", root / f"step_{step:08d}.partial"
    if rank.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        (partial / RUN_FILE).write_text(json.dumps(run, sort_keys=True))
    dist.barrier(group=rank.group)
    import torch.distributed.checkpoint as dcp  # here, not at the top: its import (DTensor's) costs every rank ~1 s

    dcp.save(state, checkpoint_id=str(partial))
    dist.barrier(group=rank.group)
    if rank.rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
    dist.barrier(group=rank.group)
    return final


def check_complete(checkpoint: Path) -> None:
    """Raise unless every file DCP's metadata lists is there, holding at least the bytes it says (a shard lost or cut
    short would fail inside the ranks, after launch)."""
    if not (checkpoint / ".metadata").is_file():
        raise InvalidValue("checkpoint_dir", str(checkpoint), "a checkpoint mlsys train wrote (it has no .metadata)")
    import torch.distributed.checkpoint as dcp  # (~1 s to import: only when resuming)

    try:
        storage = dcp.FileSystemReader(str(checkpoint)).read_metadata().storage_data
    except Exception as error:  # noqa: BLE001 — any failure to read it is a damaged checkpoint
        raise InvalidValue("checkpoint_dir", str(checkpoint), f"a checkpoint whose .metadata reads ({error!r:.200})") from None
    needed: dict = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    damaged = [name for name, size in sorted(needed.items())
               if not (checkpoint / name).is_file() or (checkpoint / name).stat().st_size < size]
    if damaged:
        raise InvalidValue("checkpoint_dir", str(checkpoint), f"a whole checkpoint ({', '.join(damaged[:4])} missing or "
                           "cut short): move it away to resume from the one before")


def check_resumable(checkpoint: Path, run: dict) -> None:
    """Raise unless `run` matches the fields of the run that wrote `checkpoint` (one written before they were kept
    passes: DCP then names the first key or shape that differs, in the ranks)."""
    if not (checkpoint / RUN_FILE).is_file():
        return
    try:
        written = json.loads((checkpoint / RUN_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InvalidValue("checkpoint_dir", str(checkpoint), f"a checkpoint mlsys train wrote ({RUN_FILE} is damaged: "
                           f"{error}); move it away to resume from an earlier one") from None
    if not isinstance(written, dict):
        raise InvalidValue("checkpoint_dir", str(checkpoint), f"a checkpoint mlsys train wrote ({RUN_FILE} is not a "
                           "mapping)")
    for field, value in json.loads(json.dumps(run)).items():  # as JSON keeps it: tuples as lists
        if written.get(field) != value:
            shown = value if field != "model" else value.get("name")
            kept = written.get(field) if field != "model" else (written.get(field) or {}).get("name")
            raise InvalidValue("resume", f"{field}={shown!r}", f"the {field} of the run that wrote {checkpoint} "
                               f"({field}={kept!r}{' (another shape)' if shown == kept else ''}): a checkpoint resumes "
                               "on the same model, strategy, ranks and layout")


def load_latest(directory: str, optimizers: list, state: Callable[[], dict]) -> int:
    """Restore the newest complete checkpoint in place; return its step (0 when there is none).
    `state()` is called after the `optimizers`' AdamW state exists, so that it has tensors to load into."""
    complete = completed(directory)
    if not complete:
        return 0
    for optimizer in optimizers:
        _allocate_adam_state(optimizer)
    import torch.distributed.checkpoint as dcp

    dcp.load(state(), checkpoint_id=str(complete[-1]))
    return int(complete[-1].name.split("_")[1])


def completed(directory: str) -> list[Path]:
    """The checkpoints `save` finished in `directory`, oldest first (not the .partial one a kill left)."""
    return sorted(p for p in Path(directory).glob("step_*") if p.is_dir() and not p.name.endswith(".partial"))


def trainer_state(rank: Rank, wrapped, optimizer) -> dict:
    """The data-parallel trainer's: `wrapped` a DataParallel or ZeroDataParallel, `optimizer` its optimizer."""
    sharded = hasattr(wrapped, "stage")
    state = {f"model.{k}": v for k, v in wrapped.module.state_dict(keep_vars=True).items()}
    prefix = f"rank{rank.rank}." if sharded else ""
    if sharded:
        state.update(_zero_state(prefix, wrapped))
    state.update(_optimizer_state(prefix, optimizer))
    return _live(state)


def mesh_state(rank: Rank, module: torch.nn.Module, optimizer, zeros: list) -> dict:
    """The mesh trainer's: what `module` (this rank's part of the model) holds, and either `optimizer`
    or the ZeroDataParallels that own the optimizers (`parallel.mesh_zero.MeshZero.zeros`)."""
    prefix = f"rank{rank.rank}."
    state = {f"{prefix}model.{k}": v for k, v in module.state_dict(keep_vars=True).items()}
    for index, zero in enumerate(zeros):
        state.update(_zero_state(f"{prefix}zero{index}.", zero))
        state.update(_optimizer_state(f"{prefix}zero{index}.", zero.optimizer))
    if optimizer is not None:
        state.update(_optimizer_state(prefix, optimizer))
    return _live(state)


def _zero_state(prefix: str, zero) -> dict:
    """ZeRO-3's parameter shards and the fp32 masters (when separate from the weights)."""
    state = {f"{prefix}shard.{i}": s for i, s in enumerate(zero.partition.shards)} if zero.stage == 3 else {}
    if zero._separate_masters:
        state.update({f"{prefix}master.{i}": m for i, m in enumerate(zero.masters)})
    return state


def _optimizer_state(prefix: str, optimizer) -> dict:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {f"{prefix}optimizer.{index}.{name}": value for index, param in enumerate(params)
            for name, value in optimizer.state.get(param, {}).items() if torch.is_tensor(value)}


def _live(state: dict) -> dict:
    """Flat {key: tensor}; tensors are the live ones, so loading writes straight into the run."""
    return {k: v.data if isinstance(v, torch.nn.Parameter) else v for k, v in state.items()}


def _allocate_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Empty AdamW state of the right shapes, for DCP to load into."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise InvalidValue("optimizer", type(optimizer).__name__, "Adam or AdamW (the state layout resumed here)")
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param not in optimizer.state or not optimizer.state[param]:
                optimizer.state[param] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                                          "exp_avg_sq": torch.zeros_like(param)}
