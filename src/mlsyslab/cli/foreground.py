"""Run a launcher (torchrun) as a foreground child that never outlives `mlsys`.

A job scheduler or `timeout` stops a command with SIGTERM sent to it alone; left at Python's default,
`mlsys` would die at once and torchrun with its ranks would train on as orphans. Here the signal is
passed on to the child (torchrun stops its ranks on SIGTERM, SIGINT and SIGHUP and waits for them),
`mlsys` waits for it, then unwinds normally (its temporary files removed) and exits 128 + the signal,
as a shell reports a process killed by it. Should `mlsys` itself be killed (SIGKILL, where no handler
runs), Linux's parent-death signal (prctl(2) PR_SET_PDEATHSIG) sends the child SIGTERM.
"""

import ctypes
import os
import signal
import subprocess
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def run_in_foreground(command: list[str], stdout=None) -> tuple[int, signal.Signals | None]:
    """Run `command` to its end; return its exit code and the first signal `mlsys` received meanwhile, if any."""
    received: list[signal.Signals] = []
    child = subprocess.Popen(command, stdout=stdout, preexec_fn=_die_with(os.getpid()) if sys.platform == "linux" else None)

    def forward(signum, frame):
        received.append(signal.Signals(signum))
        if child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        code = child.wait()  # resumed after each handler (PEP 475) until the child has exited
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code, received[0] if received else None


def _die_with(parent: int):
    """What the child runs before exec: SIGTERM to it when `parent` dies (and exit now if it already has)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, in the parent: the child only calls it

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died between fork and prctl
            os._exit(128 + signal.SIGTERM)

    return arm
