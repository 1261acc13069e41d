"""underuse: a running job that keeps its GPU mostly idle for a long time (the MoE fine-tune at 30-40%
for hours). A warning: nobody should be paged for it."""

from __future__ import annotations

import numpy as np

from watchdog.config import UnderuseConfig
from watchdog.detect.evidence import Evidence
from watchdog.detect.levels import UNIT, zeroed
from watchdog.detect.stretch import Cells, Context, active
from watchdog.vocabulary.model import Signature


def detect(cells: Cells, cfg: UnderuseConfig, ctx: Context) -> dict[int, Evidence]:
    """The evidence of each cell (by its number) whose mean utilization over the window is low but not nil,
    on a GPU of a running job, once the window is nearly full."""
    stretch = cells.stretch
    sums, counts = stretch.levels["util_sum"], stretch.levels["util_count"]
    now = cells.now()
    start = np.searchsorted(stretch.times, now - cfg.window_seconds, "left")
    before = np.maximum(start - 1, 0)
    util = stretch.values["utilization_ratio"]
    # The totals before the window: those of the row before its first, or of the stretch's first row less
    # what that row adds itself.
    first = (~np.isnan(util[0]))[cells.cols]
    prior_count = np.where(start > 0, counts[before, cells.cols], counts[0, cells.cols] - first)
    prior_sum = np.where(start > 0, sums[before, cells.cols], sums[0, cells.cols] - np.where(
        first, (zeroed(util[0]) * UNIT).astype(np.int64)[cells.cols], 0))
    kept = counts[cells.end, cells.cols] - prior_count
    mean = (sums[cells.end, cells.cols] - prior_sum) / np.maximum(kept, 1) / UNIT
    chosen = np.flatnonzero((kept > 0) & (mean >= cfg.utilization_min_ratio) & (mean <= cfg.utilization_max_ratio))
    if not len(chosen):
        return {}
    # The window's span: from its first reading (the one after those before it) to its newest.
    oldest = np.empty(len(chosen), int)
    newest = np.empty(len(chosen), int)
    for col in np.unique(cells.cols[chosen]).tolist():
        mine = np.flatnonzero(cells.cols[chosen] == col)
        column = counts[:, col]
        oldest[mine] = np.searchsorted(column, prior_count[chosen[mine]] + 1, "left")
        newest[mine] = np.searchsorted(column, counts[cells.end[chosen[mine]], col], "left")
    span = stretch.times[newest] - stretch.times[oldest]
    full = span >= 0.9 * cfg.window_seconds
    chosen, span = chosen[full], span[full]
    if not len(chosen):
        return {}
    working = active(cells.subset(chosen), ctx)
    out = {}
    for index, width in zip(chosen[working].tolist(), span[working].tolist()):
        out[index] = Evidence(int(stretch.gpus[cells.cols[index]]), Signature.UNDERUSE, since=float(now[index] - width),
                              facts={"mean_utilization": float(mean[index]), "window_seconds": float(width)})
    return out
