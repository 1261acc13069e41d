"""Rows appended to arrays with room to spare: a tick appended costs its own rows, not a copy of every row
kept. The detectors' stretch (detect/stretch.py) and underuse's tally (detect/tally.py) keep their rows so."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def appended(store: list[np.ndarray | None] | None, lo: int, kept: Sequence[np.ndarray | None],
             later: Sequence[np.ndarray | None]) -> tuple[list[np.ndarray | None], int, list[np.ndarray | None]]:
    """The rows `kept` (views of `store` from row `lo`, or of nothing yet) followed by `later`'s, part by part
    (None: a part neither has): the buffers now holding them, where they begin, and the joined parts as views
    of those buffers. The buffers are reused while the new rows fit after the kept ones, else made anew with a
    quarter to spare (the rows kept are most of the memory)."""
    size = len(kept[0]) if kept[0] is not None else 0
    count = len(later[0]) if later[0] is not None else 0
    hi = lo + size
    fits = store is not None and hi + count <= len(store[0]) and all(  # type: ignore[arg-type]
        (part is None) if buffer is None else (part is not None and buffer.shape[1:] == part.shape[1:])
        for buffer, part in zip(store, later))
    if store is None or not fits:
        total = size + count
        room = max(total + max(total // 4, 64), 128)
        store = [None if part is None else np.empty((room, *part.shape[1:]), part.dtype) for part in kept]
        for buffer, part in zip(store, kept):
            if buffer is not None:
                buffer[:size] = part
        lo, hi = 0, size
    for buffer, part in zip(store, later):
        if buffer is not None:
            buffer[hi:hi + count] = part
    views: list[Any] = [None if buffer is None else buffer[lo:hi + count] for buffer in store]
    return store, lo, views
