"""One rank of `mlsys train`, started by torchrun's agent (`comm.launch.torchrun`): `main(config, tokens, ...)`.

Joins the process group from torchrun's environment, trains on the (already validated) TrainConfig, and on global
rank 0 returns the TrainResult as a dict. Rank 0 draws a progress bar (loss, tokens/s) on a terminal.
"""

import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from mlsyslab.comm.launch import init_from_torchrun
from mlsyslab.train.trainer import TrainConfig, train


def main(config: TrainConfig, tokens: np.ndarray, stdout_to_stderr: bool) -> dict | None:
    """`stdout_to_stderr`: keep this rank's output off stdout (`mlsys train --json` writes only its report there)."""
    if stdout_to_stderr:
        sys.stdout.flush()
        os.dup2(2, 1)
    rank = init_from_torchrun()
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, int(rank.world_size))))
    data = torch.from_numpy(tokens)
    try:
        if rank.rank == 0 and sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            columns = (TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                       TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tps]:,.0f} tokens/s"),
                       TimeRemainingColumn())
            with Progress(*columns) as bar:
                task = bar.add_task("train", total=config.steps, loss=float("nan"), tps=0.0)
                report = lambda step, loss, tps: bar.update(task, completed=step, loss=loss, tps=tps)  # noqa: E731
                result = train(rank, config, data, report)
        else:
            result = train(rank, config, data)
        return result.to_dict() if rank.rank == 0 else None
    finally:
        dist.destroy_process_group()
