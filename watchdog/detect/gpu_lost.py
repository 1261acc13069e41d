"""gpu_lost: the GPU stopped answering NVML (GPU is lost / unknown error) or an NVML call on it hung.

A call that hangs is a slow reading until it persists: only a run of hung samples that has lasted
hung_for_seconds (driver lock contention holds a call for seconds) counts; a lost reading counts at once, and
the episode's for_seconds then asks that either last."""

from __future__ import annotations

import numpy as np

from watchdog.config import GpuLostConfig
from watchdog.detect.evidence import Evidence
from watchdog.detect.stretch import HEALTH_CODES, Cells, Context
from watchdog.vocabulary.model import GpuHealth, Signature


def detect(cells: Cells, cfg: GpuLostConfig, ctx: Context) -> dict[int, Evidence]:
    """The evidence of each cell (by its number) whose GPU has stopped answering: since the first of the
    samples it has kept that did not answer, in a row up to the newest."""
    stretch = cells.stretch
    chosen = np.flatnonzero(stretch.health[cells.end, cells.cols] != 0)
    if not len(chosen):
        return {}
    cells = cells.subset(chosen)
    window = cells.window(np.inf, max(ctx.short_seconds, cfg.hung_for_seconds))
    answered = np.where(window.rows >= 0, stretch.health[window.rows, cells.cols[:, None]] == 0, True)
    lost = ~answered[:, ::-1]
    run = np.where(lost.all(axis=1), window.count, np.argmin(lost, axis=1))  # the trailing run of lost samples
    times = window.times()
    lost_code = HEALTH_CODES.index(GpuHealth.LOST)
    out = {}
    for n in range(len(cells)):
        latest = stretch.sample(int(cells.end[n]), int(cells.cols[n]))
        first = window.count[n] - max(int(run[n]), 1)
        since = float(times[n, first])
        rows = window.rows[n, first:window.count[n]]
        if not (stretch.health[rows[rows >= 0], cells.cols[n]] == lost_code).any() and \
                float(times[n, window.count[n] - 1]) - since < cfg.hung_for_seconds:
            continue  # only hung calls, for less than hung_for_seconds: a slow reading
        errors = "; ".join(f"{k}: {v}" for k, v in latest.errors)
        out[int(chosen[n])] = Evidence(latest.index, Signature.GPU_LOST, since=since, legs=(latest.health.value,),
                                       facts={"errors": errors})
    return out
