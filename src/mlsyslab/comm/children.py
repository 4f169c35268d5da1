"""Child processes that never outlive `mlsys`: the ranks it starts.

A job scheduler, `timeout` or `kill` stops a command with a signal sent to it alone; left at Python's
defaults, `mlsys` would die at once and its ranks would run on as orphans. So while `spawn`'s ranks run,
SIGTERM, SIGINT and SIGHUP are passed on to them; once they are gone the caller unwinds and ends as the
signal would have ended it (under `mlsys train`, torch elastic's agent does the same: `comm.launch.torchrun`).
Should `mlsys` itself be killed (SIGKILL, where no handler runs), each rank, which watches it
(`die_with_launcher`), ends too.
"""

import contextlib
import multiprocessing
import os
import select
import signal
import threading

PASSED_ON = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))  # no SIGHUP on Windows


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


def die_with_launcher() -> None:
    """In a rank: SIGKILL to it once the process that started it has ended (at once, if it has). The rank's parent
    is the fork server (`comm.fork_server`), which lives on while any of its forks does, so the parent-death signal
    (prctl PR_SET_PDEATHSIG) cannot tie the rank to `mlsys`: a thread waits on a pidfd of the launcher instead
    (Linux 5.3 on; where there are none, nothing is watched)."""
    launcher = multiprocessing.parent_process()
    if launcher is None or not hasattr(os, "pidfd_open"):
        return
    try:
        watched = os.pidfd_open(launcher.pid)
    except ProcessLookupError:  # it has ended already
        os.kill(os.getpid(), signal.SIGKILL)
    except OSError:  # no pidfds here (a kernel before 5.3, or a sandbox that refuses the call): nothing is watched
        return

    def wait_for_its_end() -> None:
        select.select([watched], [], [])  # a pidfd reads ready once its process has ended
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait_for_its_end, name="die-with-launcher", daemon=True).start()
