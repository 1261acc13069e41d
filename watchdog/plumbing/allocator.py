"""Hands the C allocator's free memory back to the system. glibc keeps what Python and numpy free inside its
heaps (one arena per thread that allocated, each at its own high-water mark), so a long-running daemon's
resident memory creeps up with each burst (an incident's bundle, a scrape of 64 GPUs, a reload) and does not
come down. `malloc_trim(0)` returns the free pages: at 64 simulated GPUs after 480 s, 76.8 -> 70.1 MiB
(`bench/daemon_cost.py`). A no-op where the C library has no malloc_trim (musl returns memory on its own)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

TRIM_SECONDS = 60.0  # how often the daemon's loop hands free memory back
_M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 128 << 10  # glibc's own starting value, kept fixed


def _libc(name: str) -> Callable[..., int] | None:
    """A function of the C library the interpreter runs on, or None where it has none of that name."""
    try:
        found: Callable[..., int] = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    return found


_TRIM = _libc("malloc_trim")


def release_free_memory() -> bool:
    """Return the allocator's free pages to the system; whether there was an allocator to ask."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


def large_blocks_apart() -> bool:
    """Keep every allocation of 128 KiB or more in pages of its own, handed back when freed. glibc starts there,
    then raises the threshold to the largest block freed (an incident's page, up to 32 MiB), after which such
    blocks come from the heaps and leave them fragmented: 64 simulated GPUs held 1.2-1.4 MiB more after their
    bundle (traced in process, 480 s). Whether there was an allocator to tell."""
    mallopt = _libc("mallopt")
    return mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
