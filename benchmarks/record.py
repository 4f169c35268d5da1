"""What every benchmark records beside its numbers: the machine, its load, and where results go."""

import json
import os
import platform
import resource
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def machine(**versions) -> dict:
    """Date, cores, load average at start, Python and platform, plus the given library versions."""
    return {"date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpus": os.cpu_count(),
            "load_avg_start": os.getloadavg(), "python": platform.python_version(), **versions,
            "platform": platform.platform()}


class OtherProcesses:
    """The share of the machine's CPUs other processes used while a measurement ran (competing work)."""

    def __init__(self):
        self.began, self.busy, self.own = time.perf_counter(), _busy_cpu_s(), _own_cpu_s()

    def share(self) -> float:
        wall = time.perf_counter() - self.began
        other = (_busy_cpu_s() - self.busy) - (_own_cpu_s() - self.own)
        return max(0.0, other) / (wall * os.cpu_count())


def save(out: dict, path: Path, print_table) -> None:
    """Write `out` as JSON to `path`, then print its table and where it went."""
    out["load_avg_end"] = os.getloadavg()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print_table(out)
    print(f"\nwrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


def paired_ratio(theirs: list[float], ours: list[float]) -> float:
    """The median of step i's theirs / ours over the steps, where each step ran the two back to back: on a host whose
    speed drifts between steps, steadier than the ratio of the medians."""
    return statistics.median(t / o for t, o in zip(theirs, ours, strict=True))


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (all processes, from /proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def _own_cpu_s() -> float:
    """CPU seconds of this process, its finished children (a peer's interpreter), and its live children with their
    finished ones (the fork server `comm.launch.spawn` starts ranks from, which reaps them)."""
    finished = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                   for f in ("ru_utime", "ru_stime"))
    return finished + sum(_process_cpu_s(pid) for pid in _live_children())


def _live_children() -> list[int]:
    me = os.getpid()
    return [int(entry.name) for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))) and int(fields[1]) == me]


def _process_cpu_s(pid: int) -> float:
    """utime + stime + cutime + cstime of a live process (/proc/PID/stat fields 14-17), 0 if it is gone."""
    fields = _stat_fields(pid)
    return sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK") if fields else 0.0


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (index 0 is field 3, the state; 1 the parent), [] if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return []
