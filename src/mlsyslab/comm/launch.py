"""Start ranks: under `torchrun` (environment variables) or spawned locally (tests, lessons).

Backend by device: NCCL when the rank drives a CUDA device, gloo otherwise. Every rank gets a
`Rank` (rank, world size, device, default timeout) that is passed explicitly — no globals below
this file. `spawn(fn, world_size, *args)` runs `fn(rank, *args)` in new processes (forks of a server
that has imported torch) on a free port and returns each rank's result, re-raising the first failure
with the rank's traceback (or the exit code of a rank that died without one). A SIGTERM, SIGINT or SIGHUP
to the parent meanwhile stops the ranks first, then the parent (`comm.children`): none runs on as an orphan.
"""

import datetime
import os
import pickle
import queue
import signal
import socket
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mlsyslab.comm.children import passing_signals_on
from mlsyslab.comm.heap import keep_freed_memory

DEFAULT_TIMEOUT_S = 60.0
# Imported once by the fork server that `spawn` starts ranks from, so that each rank starts as a fork of a
# process that has them (not a fresh interpreter importing torch, ~3 s a rank on 2 cores, and torch._dynamo,
# which a rank's first torch.optim optimizer imports, ~2 s more). The server itself runs no torch op, so
# no thread pool is forked.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "mlsyslab.comm.launch"]


@dataclass(frozen=True)
class Rank:
    rank: int
    world_size: int
    device: torch.device
    timeout_s: float = DEFAULT_TIMEOUT_S
    group: object = None  # None: the default (world) group
    peers: tuple | None = None  # global rank of each member of `group` (None: the world, in order)

    def global_rank(self, member: int) -> int:
        """The global rank of the group's member `member` (what torch.distributed's send/recv take)."""
        return member if self.peers is None else self.peers[member]

    @property
    def backend(self) -> str:
        return dist.get_backend(self.group)


def init(rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device | None = None,
         timeout_s: float = DEFAULT_TIMEOUT_S) -> Rank:
    """Join the process group; NCCL if this rank has a CUDA device, gloo otherwise. The rank's process keeps its
    freed CPU memory in its heap from here on (`comm.heap`: a step's large temporaries reuse warm pages)."""
    keep_freed_memory()
    if device is None:
        device = torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() else torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    return Rank(rank, world_size, device, timeout_s)


def init_from_torchrun(timeout_s: float = DEFAULT_TIMEOUT_S) -> Rank:
    """Join using the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)."""
    env = os.environ
    local = int(env.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    return init(int(env["RANK"]), int(env["WORLD_SIZE"]), env["MASTER_ADDR"], int(env["MASTER_PORT"]), device, timeout_s)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def spawn(fn, world_size: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S, threads_per_rank: int = 1):
    """Run `fn(rank: Rank, *args)` on `world_size` local CPU ranks; return the list of their results."""
    port = free_port()
    if "forkserver" in mp.get_all_start_methods():
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
    else:  # Windows
        context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_worker, args=(fn, r, world_size, port, timeout_s, threads_per_rank, results, args))
                 for r in range(world_size)]
    for process in processes:
        process.start()
    with passing_signals_on(lambda signum: [p.terminate() for p in processes if p.is_alive()]) as received:
        outcomes = _collect(processes, results, world_size, timeout_s)
    if received:  # the ranks are gone: end as the signal would have ended us
        signal.raise_signal(received[0])
    failures = {r: v for r, (ok, v) in outcomes.items() if not ok}
    if failures:
        rank = min(failures)
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{failures[rank]}")
    return [outcomes[r][1] for r in range(world_size)]


def _collect(processes, results, world_size: int, timeout_s: float) -> dict:
    """Each rank's (ok, value) until all have one or one fails; the ranks joined (or killed) after."""
    outcomes = {}
    while len(outcomes) < world_size:
        try:
            rank, ok, value = results.get(timeout=0.5)
        except queue.Empty:  # a rank that exited without a result (killed, or it could not start) fails the run
            silent = [r for r, p in enumerate(processes) if r not in outcomes and p.exitcode is not None]
            if not silent:
                continue
            try:
                rank, ok, value = results.get(timeout=1.0)  # what it put before it exited, if anything
            except queue.Empty:
                rank, ok, value = silent[0], False, (f"the process exited with code {processes[silent[0]].exitcode} "
                                                     "without a result (see its output above)")
        outcomes[rank] = (ok, pickle.loads(value) if ok else value)
        if not ok:
            break
    for process in processes:
        process.join(timeout=timeout_s if len(outcomes) == world_size else 5)
        if process.is_alive():
            process.kill()
    return outcomes


def _worker(fn, rank, world_size, port, timeout_s, threads, results, args):
    torch.set_num_threads(threads)
    try:
        ctx = init(rank, world_size, "127.0.0.1", port, torch.device("cpu"), timeout_s)
        value = fn(ctx, *args)
        results.put((rank, True, pickle.dumps(value)))  # plain pickle: tensors are copied, not shared
    except BaseException:  # report any failure to the parent, with this rank's traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
