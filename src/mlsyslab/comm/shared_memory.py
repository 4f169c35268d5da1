"""All-reduce, all-gather and reduce-scatter through shared memory, for the ranks of a group that all run on one x86
host with CPU tensors.

Why: gloo's all-reduce between two processes of this 2-core machine took ~3.5 ms whatever the size (128 KB-2 MB)
whenever the ranks computed between calls — its TCP loopback and I/O threads wait on the scheduler — and 2.3 ms for
512 KB back to back (benchmarks/README.md, `tensor.py`); our ZeRO-3 step's backward waited on gloo's all-gathers a
quarter of its time (`data_parallel.py --profile ours-zero3`). Ranks on one host can instead each write their tensor
into one shared buffer, wait until every rank has, and each read what it needs from all the copies, as DeepSpeed's CPU
`inference_all_reduce` (deepspeed/csrc/cpu/comm/shm.cpp) and vLLM's CPU shared-memory communicator do.

Protocol of call n (its sequence number, the same on every rank), `_exchange`:
  1. wait until every rank has read call n - 1 (`read[r] >= n - 1`), write this rank's part into its slot,
     `written[me] = n`;
  2. wait until `written[r] >= n` for every rank r, read the slots, `read[me] = n`.
What is written and read makes the collective:
  - all-reduce: x into the slot; x = slot_0 + slot_1 + ... in rank order (or their elementwise maximum; every rank
    gets the same bits, as from a collective), ranks 0 and 1 starting from their own x rather than a copy of slot_0
    (IEEE addition commutes: 1.20-1.37x faster at 1-48 MB on 2 ranks, AVX2 host);
  - all-gather: this rank's shard into the slot; output[r] = slot_r;
  - reduce-scatter: input's chunks but this rank's own into the slot, one after another; output = the sum of chunk
    `me` over the ranks in rank order, this rank's own from its input (n − 1 chunks written, not n: for 2 ranks half
    the copy into the slot).
A tensor larger than a slot goes through in slot-sized pieces, each a call. The flags are int64 words on cache lines
of their own. x86 makes a core's stores visible in program order (TSO), so a rank that sees a flag also sees the
slot written before it: this transport is used on x86-64 only (elsewhere, and for CUDA tensors or ranks on several
hosts, gloo / NCCL as before). A waiting rank spins briefly, then yields its core (`os.sched_yield`: with more ranks
than cores a spinning rank would hold the core of the rank it waits for), and gives up after the rank's timeout.
The segment lives in /dev/shm only until every rank has mapped it: rank 0 of the group then unlinks its name, so
nothing is left behind whatever way the processes end. Each rank checks that it mapped rank 0's segment (a token rank 0
wrote; a rank on another host with the same host name would map a new, empty file): if any did not, every rank keeps
the process group's collectives. Calls are synchronous: every rank of the group must make them in the same order (as
for the process group's); each call's flag line also carries what the rank is doing (the collective, its whole size and
the piece's), and ranks that find another doing something else all raise `CollectiveMismatch` naming every rank's call,
rather than combining unrelated bytes. Tested against gloo's collectives in tests/comm/test_shared_memory.py.
"""

from __future__ import annotations

import os
import platform
import socket
import time
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mlsyslab.comm.launch import Rank
from mlsyslab.comm.log import CommLog, nbytes, traced
from mlsyslab.comm.torch_ops import all_gather_single, reduce_scatter_single

SLOT_BYTES = 4 << 20  # per rank: a piece of up to 4 MB per call
WORD = 8  # int64 flags, one per 64-byte line
SPINS_BEFORE_YIELD = 64
SHM = Path("/dev/shm")


class NotShared(RuntimeError):
    """Some rank of the group did not map the same segment as rank 0 (raised on every rank alike)."""


class CollectiveMismatch(RuntimeError):
    """The ranks of a group made different shared-memory calls at the same point (raised on every rank alike)."""


OPS = ("all_reduce (sum)", "all_reduce (maximum)", "all_gather", "reduce_scatter")  # a call's collective, by its index


class SharedMemoryCollectives:
    """All-reduce, all-gather and reduce-scatter of CPU tensors over the ranks of `rank.group`, through a segment they
    all map (module docstring)."""

    def __init__(self, rank: Rank, slot_bytes: int = SLOT_BYTES):
        self.rank, self.size, self.slot_bytes = rank, rank.world_size, slot_bytes
        self.calls = 0
        names = [uuid.uuid4().hex if rank.rank == 0 else None]
        dist.broadcast_object_list(names, src=rank.global_rank(0), group=rank.group)
        path, token = SHM / f"mlsyslab_collectives_{names[0]}", bytes.fromhex(names[0])
        flag_bytes = 2 * self.size * 64
        total = 64 + flag_bytes + self.size * slot_bytes  # a line for rank 0's token, the flags, the slots
        if rank.rank == 0:
            with open(path, "wb") as file:
                file.write(token)
                file.truncate(total)
        dist.barrier(group=rank.group)
        memory = torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)
        mine = bytes(memory[:len(token)].tolist()) == token  # rank 0's segment, not a new file on another host
        mapped = [None] * self.size
        dist.all_gather_object(mapped, mine, group=rank.group)
        if rank.rank == 0 or not mine:  # every rank has it mapped: the name can go
            path.unlink(missing_ok=True)
        if not all(mapped):
            raise NotShared(f"ranks {[r for r, ok in enumerate(mapped) if not ok]} did not map rank 0's segment {path}")
        memory = memory[64:]
        lines = memory[:flag_bytes].view(torch.int64).view(2, self.size, 64 // WORD)
        # numpy views of the flags: a few hundred ns to set or test, where a torch op costs a few µs
        self.written, self.read = lines[0, :, 0].numpy(), lines[1, :, 0].numpy()
        self.doing = lines[0, :, 1:4].numpy()  # per rank, beside its written flag: (collective, whole bytes, piece bytes)
        self.slots = memory[flag_bytes:].view(self.size, slot_bytes)

    @staticmethod
    def applies(rank: Rank) -> bool:
        """Whether every rank of the group is a CPU process on this x86-64 host (a collective over the group)."""
        hosts = [None] * rank.world_size
        dist.all_gather_object(hosts, socket.gethostname() if _usable(rank) else None, group=rank.group)
        return all(host == hosts[0] for host in hosts) and hosts[0] is not None

    def all_reduce(self, x: torch.Tensor, maximum: bool = False) -> None:
        """x = the sum (`maximum`: the elementwise maximum) of every rank's x, in place (x contiguous, on the CPU, the
        same shape and dtype everywhere)."""
        flat = _flat(x, "x")
        per = self.slot_bytes // x.element_size()
        for first in range(0, flat.numel(), per):
            values = flat[first:first + per]
            self._exchange((int(maximum), flat.nbytes, values.nbytes),
                           lambda slot: slot.view(x.dtype)[:values.numel()].copy_(values),
                           lambda slots: _combine(values, slots.view(x.dtype)[:, :values.numel()], maximum,
                                                  holding=self.rank.rank))

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> None:
        """output = every rank's shard, in rank order (`all_gather_into_tensor`: output has world size x shard's
        elements, both contiguous CPU tensors of one dtype)."""
        flat, out = _flat(shard, "shard"), _flat(output, "output")
        if out.numel() != self.size * flat.numel() or output.dtype != shard.dtype:
            raise ValueError(f"output: {self.size} x {flat.numel()} elements of {shard.dtype}, got {output.numel()} "
                             f"of {output.dtype}")
        gathered = out.view(self.size, -1)
        per = self.slot_bytes // shard.element_size()
        for first in range(0, flat.numel(), per):
            piece = flat[first:first + per]
            self._exchange((2, flat.nbytes, piece.nbytes), lambda slot: slot.view(shard.dtype)[:piece.numel()].copy_(piece),
                           lambda slots: gathered[:, first:first + piece.numel()].copy_(
                               slots.view(shard.dtype)[:, :piece.numel()]))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """output = the sum over ranks of chunk `rank` of input (`reduce_scatter_tensor`: input has world size x
        output's elements, both contiguous CPU tensors of one dtype), summed in rank order."""
        out, full = _flat(output, "output"), _flat(input, "input")
        if full.numel() != self.size * out.numel() or output.dtype != input.dtype:
            raise ValueError(f"input: {self.size} x {out.numel()} elements of {output.dtype}, got {input.numel()} "
                             f"of {input.dtype}")
        chunks, me = full.view(self.size, -1), self.rank.rank
        others = [r for r in range(self.size) if r != me]
        per = self.slot_bytes // input.element_size() // len(others)
        for first in range(0, out.numel(), per):
            count = min(per, out.numel() - first)

            def write(slot, first=first, count=count):
                pieces = slot.view(input.dtype)[:len(others) * count].view(len(others), count)
                for piece, r in zip(pieces, others):
                    piece.copy_(chunks[r, first:first + count])

            def read(slots, first=first, count=count):
                """Chunk `me` from every rank in rank order: this rank's own from its input, rank r's from r's slot,
                where r wrote every chunk but its own (at index me, or me - 1 past r's own)."""
                at = [(me - (me > r)) * count for r in range(self.size)]
                parts = [chunks[me, first:first + count] if r == me else slots[r].view(input.dtype)[at[r]:at[r] + count]
                         for r in range(self.size)]
                _combine(out[first:first + count], parts, False)

            self._exchange((3, full.nbytes, len(others) * count * input.element_size()), write, read)

    def _exchange(self, doing: tuple[int, int, int], write, read) -> None:
        """One call of the protocol: write(this rank's slot, bytes), then read(every slot, [ranks, bytes]); `doing` is
        (the collective's index in OPS, its whole bytes, this piece's bytes), checked equal on every rank."""
        self.calls += 1
        n, me = self.calls, self.rank.rank
        self._wait(self.read, n - 1)
        self.doing[me] = doing
        write(self.slots[me])
        self.written[me] = n
        self._wait(self.written, n)
        calls = self.doing.tolist()
        if calls.count(calls[me]) != self.size:
            calls = "; ".join(f"rank {r}: {OPS[op]} of {whole} bytes (a piece of {piece})"
                              for r, (op, whole, piece) in enumerate(calls))
            raise CollectiveMismatch(f"shared-memory collectives, call {n}: the ranks disagree ({calls}); every rank "
                                     "must make the same collectives in the same order")
        read(self.slots)
        self.read[me] = n

    def _wait(self, flags: np.ndarray, n: int) -> None:
        spins, deadline = 0, time.monotonic() + self.rank.timeout_s
        while min(flags.tolist()) < n:
            spins += 1
            if spins > SPINS_BEFORE_YIELD:
                os.sched_yield()
                if spins % 4096 == 0 and time.monotonic() > deadline:
                    late = [r for r, flag in enumerate(flags.tolist()) if flag < n]
                    raise TimeoutError(f"shared-memory collectives: call {n} still waits for ranks {late} after "
                                       f"{self.rank.timeout_s:.0f} s")


_GROUPS: dict[tuple, SharedMemoryCollectives | None] = {}


def for_group(rank: Rank) -> SharedMemoryCollectives | None:
    """The group's shared-memory collectives, made at the group's first call (a collective: every rank of the group
    calls in the same order), or None where they do not apply or MLSYS_SHM_COLLECTIVES=0 (then the process
    group's)."""
    key = (id(rank.group), rank.peers)
    if key not in _GROUPS:
        wanted = os.environ.get("MLSYS_SHM_COLLECTIVES", "1") != "0" and rank.world_size > 1
        _GROUPS[key] = None
        if wanted and SharedMemoryCollectives.applies(rank):
            try:
                _GROUPS[key] = SharedMemoryCollectives(rank)
            except NotShared:  # every rank raises it alike (the check is gathered): all keep the process group's
                pass
    return _GROUPS[key]


def for_data_parallel(rank: Rank) -> SharedMemoryCollectives | None:
    """The shared-memory collectives for DDP's and ZeRO's gradients and weights where data parallelism is all the ranks
    do (`rank.group` is the world), else None (the process group's, asynchronous). Through shared memory they are
    synchronous: inside a mesh a rank blocked in one would never return while its peer waits for it in another group's
    point-to-point (ring attention's, the pipeline's)."""
    return for_group(rank) if rank.group is None else None


def _usable(rank: Rank) -> bool:
    return rank.device.type == "cpu" and platform.machine() in ("x86_64", "AMD64") and SHM.is_dir()


def _flat(x: torch.Tensor, name: str) -> torch.Tensor:
    if not x.is_contiguous() or x.device.type != "cpu":
        raise ValueError(f"{name}: a contiguous CPU tensor, got {'non-contiguous' if x.device.type == 'cpu' else x.device}")
    return x.view(-1)


def _combine(values: torch.Tensor, slots, maximum: bool, holding: int | None = None) -> None:
    """values = slots[0] + slots[1] + ... in rank order (`maximum`: their elementwise maximum), each step one pass
    writing values. `holding`: the rank whose part values already holds (an all-reduce's own x); if rank 0's or 1's,
    the sum starts from it and skips that slot — a + b is b + a bit for bit, so (s1 + s0) + s2 is the rank order's
    sum."""
    combine = torch.maximum if maximum else torch.add
    if holding in (0, 1):
        rest = [part for r, part in enumerate(slots) if r != holding]
    else:  # the first two parts into values in one pass, not a copy and then an add
        combine(slots[0], slots[1], out=values)
        rest = slots[2:]
    for other in rest:
        combine(values, other, out=values)


def start_sharded(log: CommLog | None, op: str, shared: SharedMemoryCollectives | None, rank: Rank,
                  output: torch.Tensor, input: torch.Tensor) -> list:
    """`op` ("all_gather" or "reduce_scatter") of `input` into `output` over `rank.group`, logged: through `shared`,
    done on return (no work to wait for), or started on the process group (its work, in a list)."""
    full = output if op == "all_gather" else input
    if shared is not None:
        traced(log, op, nbytes(full), rank.world_size, getattr(shared, op), output, input)
        return []
    single = all_gather_single if op == "all_gather" else reduce_scatter_single
    return [traced(log, op, nbytes(full), rank.world_size, single, output, input, group=rank.group, async_op=True)]
