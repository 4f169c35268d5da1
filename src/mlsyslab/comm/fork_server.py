"""The process every local rank is forked from: Python's fork server, once per process, with torch imported.

A rank started as a fresh interpreter imports torch (~2 s on 2 cores, each rank beside the others) and, at its
first torch.optim optimizer, torch._dynamo (~2 s more); forked from a server that imported them once, it starts
in a fraction of a second. The server runs no torch op itself, so no thread pool is forked, and it exits when the
process that started it does. A rank sees the environment variables the server started with, plus those its
launcher sets for it (torchrun's RANK, WORLD_SIZE, ...): not what the parent changed in between. Importing this
file does not import torch: `start` lets the server's imports run beside the caller's own (`mlsys train` starts it
before it imports torch itself).
"""

import multiprocessing
import multiprocessing.forkserver

PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "mlsyslab.comm.launch")
_preload = list(PRELOAD)  # what the server will import when it starts: PRELOAD and what callers added
AVAILABLE = "forkserver" in multiprocessing.get_all_start_methods()  # not on Windows


def preload(modules: tuple[str, ...]) -> None:
    """Have the server import `modules` too when it starts (each rank imports what its function needs anyway:
    ~0.3 s for the parallel and train packages). Once the server runs this changes nothing."""
    _preload.extend(name for name in modules if name not in _preload)
    if AVAILABLE:
        multiprocessing.get_context("forkserver").set_forkserver_preload(_preload)


def start_method(modules: tuple[str, ...] = ()) -> str:
    """The start method for local ranks: the fork server, `modules` added to what it imports when it starts;
    spawn where there is none (Windows)."""
    preload(modules)
    return "forkserver" if AVAILABLE else "spawn"


def start(modules: tuple[str, ...] = ()) -> None:
    """Start the server now, if it is not running, rather than at the first rank."""
    if start_method(modules) == "forkserver":
        multiprocessing.forkserver.ensure_running()
