"""What this machine has, read from the OS without torch (the server's HTTP process checks its options with it)."""

import functools
import os
import platform
from pathlib import Path


def machine_memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


@functools.cache
def cpu_description() -> tuple[str, frozenset[str]]:
    """The CPU's model name and feature flags (Linux /proc/cpuinfo; the platform's names and no flags
    where it cannot tell)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.processor()} {platform.machine()}", frozenset()
    first = lambda key: next((line.split(":", 1)[1].strip() for line in lines if line.startswith(key)), "")  # noqa: E731
    return first("model name"), frozenset(first("flags").split())


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles for bf16 (False where it cannot tell)."""
    return "amx_bf16" in cpu_description()[1]


def cpu_has_bf16_dot() -> bool:
    """Whether this CPU multiplies bf16 pairs in one instruction (AVX512_BF16's dot product or AMX tiles), so
    that oneDNN's bf16 GEMM does twice the multiply-adds of its fp32 one (False where it cannot tell)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_description()[1])
