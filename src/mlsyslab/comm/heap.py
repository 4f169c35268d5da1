"""Keep a rank's freed CPU buffers in its heap, so that the next step's large temporaries reuse warm pages.

Why: glibc's malloc serves every block over its mmap threshold (at most 32 MB, however it adapts) with fresh pages
from the kernel and unmaps them on free. An eager training step on a CPU allocates several such blocks and frees
them again — the logits and their gradient are tokens × vocab × 4 bytes (100 MB for 512 tokens of a 49,152-word
vocabulary) — so every step pays a page fault, and the kernel's zeroing, on every 4 KB of them. Measured here
(llama-tiny, 512 tokens, one thread, Zen 4, 2026-11-25): 545 ms a forward + backward, of which the logits' matmul
124 ms at 52 GFLOP/s (96 at 1,024 words) and a 46 ms `fill_`; 355-370 ms with the heap kept. PyTorch's CPU tuning
guide reaches the same end by preloading jemalloc or TCMalloc; `mallopt` does it with the C library already loaded.

`keep_freed_memory()` sets M_MMAP_THRESHOLD to 1 GiB (blocks under it come from the heap) and M_TRIM_THRESHOLD to
its maximum (the heap is not given back to the kernel), for this process. The cost: the process keeps its peak
heap until it exits — a training rank, which reaches that peak every step anyway. Called by every rank that
`comm.launch` starts; glibc only (elsewhere it does nothing and says so by returning False); MLSYS_KEEP_HEAP=0
leaves malloc as it is. `environment()` is the same setting as glibc's environment variables, for a process we do
not start ourselves (a benchmark's peer, which must run under the same allocator as our ranks).

Not covered: threads other than the process's main one allocate from glibc's other arenas, whose heaps hold at most
64 MB, so there a 64 MB block still comes fresh from the kernel every time (measured, 2026-11-27: the test's 16
cross-entropy passes in a second thread faulted 49,155 pages each with the heap kept, as without; with M_ARENA_MAX=1
every thread shares the main heap and they settle too). Our ranks step on their main thread, so it is not set. And
a kept heap can still grow now and then, most likely where freed blocks were split by smaller ones
(tests/comm/test_heap.py).
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1  # glibc malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 30
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int


def keep_freed_memory() -> bool:
    """Serve blocks under 1 GiB from the heap and never trim it (glibc `mallopt`); whether it was set."""
    libc = _glibc()
    if libc is None or _switched_off():
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def return_freed_memory() -> bool:
    """Give the heap's free pages back to the kernel now (glibc `malloc_trim(0)`), after a one-time build that freed
    more than it keeps — the serving engine's copies of a model's weights freed ~470 MB of SmolLM2's temporaries,
    which the process went on holding. Whether it was done (glibc only)."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def _glibc() -> ctypes.CDLL | None:
    """The process's own symbols, glibc's among them, where the C library is glibc (`ctypes.util.find_library` ran
    `ldconfig -p` as a child process of every starting rank: 9 ms, and a stray process for whoever counts a rank's
    children)."""
    return ctypes.CDLL(None) if platform.libc_ver()[0] == "glibc" else None


def environment() -> dict[str, str]:
    """`keep_freed_memory()` as glibc's environment variables (empty under MLSYS_KEEP_HEAP=0)."""
    if _switched_off():
        return {}
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD_BYTES)}


def _switched_off() -> bool:
    return os.environ.get("MLSYS_KEEP_HEAP", "1") == "0"
