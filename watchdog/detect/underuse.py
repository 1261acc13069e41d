"""underuse: a running job that keeps its GPU mostly idle for a long time (the MoE fine-tune at 30-40%
for hours). A warning: nobody should be paged for it."""

from __future__ import annotations

import numpy as np

from watchdog.config import UnderuseConfig
from watchdog.detect.evidence import Evidence
from watchdog.detect.levels import UNIT
from watchdog.detect.stretch import Cells, Context, active
from watchdog.vocabulary.model import Signature


def detect(cells: Cells, cfg: UnderuseConfig, ctx: Context) -> dict[int, Evidence]:
    """The evidence of each cell (by its number) whose mean utilization over the window is low but not nil,
    on a GPU of a running job, once the window is nearly full."""
    stretch, tally = cells.stretch, cells.stretch.tally
    assert tally is not None, "a stretch from Frames.add carries its tally"
    sums, counts = tally.sums, tally.counts
    end = cells.end + (stretch.first_row - tally.first_row)  # the cells' rows in the tally's numbering
    now = cells.now()
    start = np.searchsorted(tally.times, now - cfg.window_seconds, "left")
    prior_sum, prior_count = tally.before(start, cells.cols)  # the totals before the window
    kept = counts[end, cells.cols] - prior_count
    mean = (sums[end, cells.cols] - prior_sum) / np.maximum(kept, 1) / UNIT
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
        newest[mine] = np.searchsorted(column, counts[end[chosen[mine]], col], "left")
    span = tally.times[newest] - tally.times[oldest]
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
