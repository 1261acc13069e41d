"""The GPUs of a judgement's due ticks as the node's verdict looks at them (detect/node.py's GpuView): worked out
together for every tick whose evidence asks for the job's verdict, then handed out a tick at a time."""

from __future__ import annotations

from functools import partial

import numpy as np

from watchdog.config import BusySpinConfig
from watchdog.detect import busy_spin
from watchdog.detect.node import GpuView
from watchdog.detect.stretch import HEALTH_CODES, Cells, Context, active


class JobViews:
    """The cells of the ticks `wanted` (by due tick), with whether each GPU works, whether it is pinned at 100%
    along with the others (asked only of those with no evidence of their own: not in `judged`), and what its host
    progress last said."""

    def __init__(self, cells: Cells, tick: np.ndarray, wanted: list[bool], judged: set[int], context: Context,
                 spin: BusySpinConfig, still_seconds: float):
        self.stretch, self.still = cells.stretch, still_seconds
        chosen = np.flatnonzero(np.asarray(wanted, bool)[tick]) if len(tick) else np.empty(0, int)
        some = cells.subset(chosen)
        working = active(some, context) if len(chosen) else np.empty(0, bool)
        pinned = np.zeros(len(chosen), bool)
        rest = np.flatnonzero([cell not in judged for cell in chosen.tolist()])
        if len(rest):
            pinned[rest] = busy_spin.pinned(some.subset(rest), spin, context)
        rows, cols = some.end, some.cols
        host = [some.stretch.level(name)[rows, cols].tolist() for name in ("host_first", "host_seen", "moved")]
        self.where: dict[int, list[int]] = {}
        for k, cell in enumerate(chosen.tolist()):
            self.where.setdefault(int(tick[cell]), []).append(k)
        # What at() quotes of each chosen cell, as plain values: a tick asks for a handful of them, one by one.
        stretch = some.stretch
        gpus = [stretch.gpus[col] for col in cols.tolist()]
        health = [HEALTH_CODES[code] for code in stretch.health[rows, cols].tolist()]
        last_host = [tuple(None if v != v else v for v in values) for values in zip(*host)]
        self.quoted = list(zip(gpus, rows.tolist(), cols.tolist(), stretch.times[rows].tolist(), health,
                               working.tolist(), pinned.tolist(), last_host))

    def at(self, n: int) -> tuple[dict[int, GpuView], set[int]]:
        """Due tick n's GPUs as the verdict sees them, and those of them pinned along."""
        views, pinned = {}, set()
        for k in self.where.get(n, []):
            gpu, row, col, t, health, is_active, is_pinned, (first, seen, moved) = self.quoted[k]
            views[gpu] = GpuView(partial(self.stretch.sample, row, col), health, is_active, t, first, seen, moved,
                                 self.still)
            if is_pinned:
                pinned.add(gpu)
        return views, pinned
