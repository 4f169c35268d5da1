"""`comm.launch.torchrun`: torchrun's agent in this process, its ranks forked from the fork server."""

import os
import signal
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from mlsyslab.comm.launch import init_from_torchrun, torchrun


def world_sum(offset: int) -> tuple:
    """What torchrun's environment says, and an all-reduce over the group it sets up."""
    rank = init_from_torchrun()
    value = torch.tensor([rank.rank + offset])
    dist.all_reduce(value)
    dist.destroy_process_group()
    return os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"], int(value)


def fails_on_rank_1() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 fails on purpose")


HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def test_each_rank_returns_what_its_function_returns():
    """...and the signal handlers the agent sets while its ranks run are taken back."""
    before = {s: signal.getsignal(s) for s in HANDLED}
    assert torchrun(world_sum, (10,), 2) == {0: ("0", "0", "2", 21), 1: ("1", "1", "2", 21)}
    assert {s: signal.getsignal(s) for s in HANDLED} == before


def test_a_failing_rank_raises_with_its_traceback_and_leaves_nothing(tmp_path, monkeypatch):
    """ChildFailedError names the rank and carries its traceback; the directory of the ranks' errors is removed and
    the agent's signal handlers are taken back."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = {s: signal.getsignal(s) for s in HANDLED}
    with pytest.raises(ChildFailedError) as failure:
        torchrun(fails_on_rank_1, (), 2)
    assert "rank      : 1" in str(failure.value) and "ValueError: rank 1 fails on purpose" in str(failure.value)
    assert not list(tmp_path.glob("mlsys-ranks-*"))  # (torch.multiprocessing leaves a failed process's own error file)
    assert {s: signal.getsignal(s) for s in before} == before
