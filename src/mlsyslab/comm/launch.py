"""Start ranks: under torchrun's agent (`torchrun`, what `mlsys train` uses) or spawned locally (tests, lessons).

Backend by device: NCCL when the rank drives a CUDA device, gloo otherwise. Every rank gets a
`Rank` (rank, world size, device, default timeout) that is passed explicitly — no globals below
this file. `spawn(fn, world_size, *args)` runs `fn(rank, *args)` in new processes (forks of a server that
has imported torch: `comm.fork_server`) on a free port and returns each rank's result, re-raising the first
failure with the rank's traceback (or the exit code of a rank that died without one). A SIGTERM, SIGINT or SIGHUP
to the parent meanwhile stops the ranks first, then the parent (`comm.children`): none runs on as an orphan.
`torchrun(fn, args, nproc, ...)` runs `fn(*args)` on this node's ranks under torch elastic's agent, the one the
`torchrun` command runs, here in this process and with its ranks forked from the same server.
"""

import datetime
import os
import pickle
import queue
import signal
import socket
import tempfile
import traceback
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mlsyslab.comm import fork_server
from mlsyslab.comm.children import die_with_launcher, passing_signals_on
from mlsyslab.comm.heap import keep_freed_memory

DEFAULT_TIMEOUT_S = 60.0


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


def build_cpu_kernels() -> None:
    """Build the C++ kernels (`nn.cpu_kernels`: the model's backward uses them on CPU) before any CPU rank starts: on
    first use the build takes 1-2 minutes, and a rank building them while another waits on it in a collective would
    outlast the collective's timeout (60 s). Built, they load in well under a second."""
    if not torch.cuda.is_available():
        from mlsyslab.nn import cpu_kernels

        cpu_kernels.load()


def spawn(fn, world_size: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S, threads_per_rank: int = 1):
    """Run `fn(rank: Rank, *args)` on `world_size` local CPU ranks; return the list of their results."""
    build_cpu_kernels()
    port = free_port()
    context = mp.get_context(fork_server.start_method())
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
    die_with_launcher()
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


def torchrun(fn, args: tuple, nproc: int, nnodes: int = 1, node_rank: int = 0, master_addr: str | None = None,
             master_port: int | None = None, preload: tuple[str, ...] = ()) -> dict:
    """Run `fn(*args)` on this node's `nproc` ranks as `torchrun` would, and return {local rank: what fn returned}.

    The agent is torch elastic's (`elastic_launch`), run here rather than in a `torchrun` process of its own: the
    same rendezvous (c10d on a free port on one node; static at master_addr:master_port, node `node_rank`, across
    nodes), the same variables for `init_from_torchrun`, no restarts (torchrun's default). Its ranks are forks of
    `comm.fork_server`, which imports torch, torch._dynamo and `preload` once, where the command would start a
    fresh interpreter per rank (~4 s of those imports on 2 cores) after its own (~2 s). Each rank dies with this
    process (`comm.children.die_with_launcher`), even when SIGKILL leaves no handler to stop it. Raises elastic's
    SignalException after a SIGTERM, SIGINT, SIGHUP or SIGQUIT to this process (the agent stops the ranks first)
    and ChildFailedError, with the first failure's traceback, when a rank fails; the signal handlers it sets are
    put back after, and its directory of the ranks' errors removed (torchrun leaves one in /tmp per run)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    build_cpu_kernels()
    if nnodes == 1 and master_addr is None:
        rendezvous = dict(rdzv_backend="c10d", rdzv_endpoint="localhost:0", run_id=str(uuid.uuid4()))  # as --standalone
    else:
        rendezvous = dict(rdzv_backend="static", rdzv_endpoint=f"{master_addr or '127.0.0.1'}:{master_port or 29500}",
                          rdzv_configs={"rank": node_rank}, run_id="none")
    handled = [getattr(signal, name) for name in LaunchConfig.signals_to_handle.split(",") if hasattr(signal, name)]
    previous = {signum: signal.getsignal(signum) for signum in handled}
    with tempfile.TemporaryDirectory(prefix="mlsys-ranks-") as errors:  # where each rank's traceback goes
        config = LaunchConfig(min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc, max_restarts=0,
                              start_method=fork_server.start_method(preload), logs_specs=DefaultLogsSpecs(errors),
                              **rendezvous)
        try:
            return elastic_launch(config, _torchrun_rank)(fn, *args)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def _torchrun_rank(fn, *args):
    die_with_launcher()
    return fn(*args)
