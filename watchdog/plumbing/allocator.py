"""Hands the C allocator's free memory back to the system. glibc keeps what Python and numpy free inside its
heaps (one arena per thread that allocated, each at its own high-water mark), so a long-running daemon's
resident memory creeps up with each burst (an incident's bundle, a scrape of 64 GPUs, a reload) and does not
come down. `malloc_trim(0)` returns the free pages: at 64 simulated GPUs after 480 s, 76.8 -> 70.1 MiB
(`bench/daemon_cost.py`). A no-op where the C library has no malloc_trim (musl returns memory on its own)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

TRIM_SECONDS = 60.0  # how often the daemon's loop hands free memory back


def _find_trim() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim  # the C library the interpreter runs on
    except (OSError, AttributeError):
        return None
    return trim


_TRIM = _find_trim()


def release_free_memory() -> bool:
    """Return the allocator's free pages to the system; whether there was an allocator to ask."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
