"""`mlsys primer NAME --nproc N`: run one of the first distributed programs on local ranks."""

from typing import Annotated

import typer

from mlsyslab.cli.options import Json, check_positive
from mlsyslab.cli.render import console, emit_json, human, seconds, table
from mlsyslab.comm import fork_server
from mlsyslab.errors import InvalidValue

PROGRAMS = ("hello", "chain", "deadlock", "cheat-sheet", "mean", "argmax", "bandwidth")


def primer_command(
    name: Annotated[str, typer.Argument(help=", ".join(PROGRAMS))],
    nproc: Annotated[int, typer.Option("--nproc", help="ranks (gloo, this machine)")] = 4,
    json: Json = False,
):
    """Hello distributed, a send/recv chain, the deadlock and its fix, every collective, mean, argmax, bandwidth."""
    if name not in PROGRAMS:
        raise InvalidValue("name", name, ", ".join(PROGRAMS))
    check_positive(64, nproc=nproc)  # processes on this machine
    if name in ("deadlock", "bandwidth") and nproc < 2:  # one rank has no one to deadlock with or send to
        raise InvalidValue("--nproc", nproc, f">= 2 for the {name}")
    fork_server.start(("mlsyslab.comm.primer",))  # the ranks' server imports torch beside this process
    import torch

    from mlsyslab.comm import primer
    from mlsyslab.comm.launch import spawn

    values = torch.randn(10 * nproc + 3, generator=torch.Generator().manual_seed(0))
    shards = list(values.tensor_split(nproc))
    offsets = [sum(len(s) for s in shards[:r]) for r in range(nproc)]
    run = {
        "hello": lambda: spawn(primer.hello, nproc)[0],
        "chain": lambda: spawn(primer.chain, nproc),
        "deadlock": lambda: spawn(primer.deadlock, nproc)[:2],
        "cheat-sheet": lambda: spawn(primer.cheat_sheet, nproc),
        "mean": lambda: {"distributed": spawn(_mean, nproc, shards)[0], "single process": values.double().mean().item()},
        "argmax": lambda: {"distributed": spawn(_argmax, nproc, shards, offsets)[0],
                           "single process": (values.max().item(), int(values.argmax()))},
        "bandwidth": lambda: spawn(primer.bandwidth, nproc)[0],
    }[name]()
    if json:
        return emit_json({"program": name, "nproc": nproc, "result": run})
    if name == "bandwidth":
        console.print(table(f"all-reduce on {nproc} ranks (bus bandwidth = algorithm · 2(n−1)/n)", [
            (human(r["bytes"], "B"), seconds(r["ours_s"]), seconds(r["gloo_s"]), human(r["ours_bus_bw"], "B/s"),
             human(r["gloo_bus_bw"], "B/s")) for r in run], ("message", "ours", "gloo", "ours bus bw", "gloo bus bw")))
    elif name == "cheat-sheet":
        for collective in run[0]:
            console.print(table(collective, [(r, run[r][collective][0], run[r][collective][1]) for r in range(nproc)],
                                ("rank", "before", "after")))
    else:
        console.print(run)


def _mean(rank, shards):
    from mlsyslab.comm import primer

    return primer.mean(rank, shards[rank.rank])


def _argmax(rank, shards, offsets):
    from mlsyslab.comm import primer

    return primer.argmax(rank, shards[rank.rank], offsets[rank.rank])
