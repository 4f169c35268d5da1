"""One rank of `mlsys train`, started by torchrun: `python -m mlsyslab.train.worker CONFIG.json RESULT.json`.

Reads the (already validated) TrainConfig, joins the process group from torchrun's environment,
trains, and on rank 0 writes the TrainResult as JSON. Rank 0 draws a progress bar (loss, tokens/s).
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from mlsyslab.comm.launch import init_from_torchrun
from mlsyslab.train.trainer import TrainConfig, train


def main(config_path: str, result_path: str) -> None:
    config = TrainConfig(**json.loads(open(config_path).read()))
    rank = init_from_torchrun()
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, int(rank.world_size))))
    tokens = torch.load(config_path + ".tokens.pt")
    try:
        if rank.rank == 0 and sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            columns = (TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                       TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tps]:,.0f} tokens/s"),
                       TimeRemainingColumn())
            with Progress(*columns) as bar:
                task = bar.add_task("train", total=config.steps, loss=float("nan"), tps=0.0)
                report = lambda step, loss, tps: bar.update(task, completed=step, loss=loss, tps=tps)  # noqa: E731
                result = train(rank, config, tokens, report)
        else:
            result = train(rank, config, tokens)
        if rank.rank == 0:
            with open(result_path, "w") as out:
                json.dump(result.to_dict(), out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # Exit without the interpreter's finalization: gloo's worker thread can still hold the last reference to a
    # tensor of the final collective when main returns, and dropping it needs the GIL; during finalization that
    # ends the thread with pthread_exit, whose unwinding through a noexcept destructor calls std::terminate
    # (a rank aborted at exit in ~1 of 12 runs, after writing its result: core dump, thread in
    # ProcessGroupGloo::runLoop -> ~AsyncAllgatherWork -> decref -> take_gil -> PyThread_exit_thread).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
