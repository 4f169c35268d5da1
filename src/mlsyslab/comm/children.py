"""Child processes that never outlive `mlsys`: ranks spawned here, and torchrun with its ranks.

A job scheduler, `timeout` or `kill` stops a command with a signal sent to it alone; left at Python's
defaults, `mlsys` would die at once and its ranks (torchrun starts them in sessions of their own) would
run on as orphans. So while children run, SIGTERM, SIGINT and SIGHUP are passed on to them (torchrun
stops its ranks on each and waits for them); once they are gone the caller unwinds (temporary files
removed) and ends as the signal would have ended it. Should `mlsys` itself be killed (SIGKILL, where
no handler runs), Linux's parent-death signal (prctl(2) PR_SET_PDEATHSIG) sends torchrun SIGTERM.
"""

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading

PASSED_ON = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))  # no SIGHUP on Windows
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@contextlib.contextmanager
def passing_signals_on(send):
    """Within: each of PASSED_ON received calls `send(signum)` instead of ending the process; yields the list
    of the signals received. (Handlers can only be set from the main thread; elsewhere nothing changes.)"""
    received: list[signal.Signals] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum, frame):
        received.append(signal.Signals(signum))
        send(signum)

    previous = {s: signal.signal(s, handler) for s in PASSED_ON}
    try:
        yield received
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def run_in_foreground(command: list[str], stdout=None) -> tuple[int, signal.Signals | None]:
    """Run `command` to its end; return its exit code and the first signal `mlsys` received meanwhile, if any."""
    child = subprocess.Popen(command, stdout=stdout, preexec_fn=_die_with(os.getpid()) if sys.platform == "linux" else None)
    with passing_signals_on(lambda signum: child.poll() is None and child.send_signal(signum)) as received:
        code = child.wait()  # resumed after each handler (PEP 475) until the child has exited
    return code, received[0] if received else None


def _die_with(parent: int):
    """What the child runs before exec: SIGTERM to it when `parent` dies (and exit now if it already has)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, in the parent: the child only calls it

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died between fork and prctl
            os._exit(128 + signal.SIGTERM)

    return arm
