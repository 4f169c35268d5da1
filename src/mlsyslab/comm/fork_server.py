"""The process every local rank is forked from: Python's fork server, once per process, with torch imported.

A rank started as a fresh interpreter imports torch (~2 s on 2 cores, each rank beside the others) and, at its
first torch.optim optimizer, torch._dynamo (~2 s more); forked from a server that imported them once, it starts
in a fraction of a second. The server runs no torch op itself, so no thread pool is forked, and it exits when the
process that started it does. Importing this file does not import torch: `start` lets the server's imports run
beside the caller's own (`mlsys train` starts it before it imports torch itself).
"""

import multiprocessing
import multiprocessing.forkserver

PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "mlsyslab.comm.launch")


def start_method(preload: tuple[str, ...] = ()) -> str:
    """The start method for local ranks: the fork server, set to import PRELOAD and `preload` when it starts (once
    per process: later calls change nothing); spawn where there is none (Windows)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload([*PRELOAD, *preload])
    return "forkserver"


def start(preload: tuple[str, ...] = ()) -> None:
    """Start the server now, if it is not running, rather than at the first rank."""
    if start_method(preload) == "forkserver":
        multiprocessing.forkserver.ensure_running()
