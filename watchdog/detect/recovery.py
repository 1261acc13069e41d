"""Evidence that a stall has ended on a GPU: the job gone from it (memory released, no kernel), or real
work on it again. A fired stall episode ends on this evidence only (detect/episodes.py), so that a
condition lapsing for a tick or two (an utilization blip, a dropped sample, an `[N/A]`) ends nothing.

Real work: the median utilization of the last few seconds at least WORK_MIN_RATIO, and either below
busy_spin's pinned level (real work leaves gaps: 80-99%) or, pinned at 100%, with the power or the memory
traffic of work (a spinning kernel reads 100% too, at near-idle power and no memory traffic).
"""

from __future__ import annotations

import numpy as np

from watchdog.config import BusySpinConfig
from watchdog.detect.stretch import MIN_WINDOW_SAMPLES, Cells, Context, active, nearest_rank, ranked

WORK_MIN_RATIO = 0.5  # a training step's input-pipeline dips go lower, its median does not
_SECONDS = 10.0  # the recent stretch judged; the episode asks for clear_seconds of this in a row


def recovered(cells: Cells, cfg: BusySpinConfig, ctx: Context) -> np.ndarray:
    """For each cell, whether its GPU shows that its stall has ended."""
    window = cells.window(cells.span(_SECONDS, MIN_WINDOW_SAMPLES), ctx.short_seconds)
    utils, count = ranked(window.readings("utilization_ratio"))
    util = nearest_rank(utils, count, 0.5)
    power, watts = ranked(window.readings("power_watts"))
    memory, memories = ranked(window.readings("memory_utilization_ratio"))
    busy = cells.level("busy")
    working = (util < cfg.utilization_min_ratio) | (
        (watts > 0) & (nearest_rank(power, watts, 0.5) > cfg.fell_max_ratio * busy)) | (
        (memories > 0) & (nearest_rank(memory, memories, 0.5) > cfg.memory_utilization_max_ratio))
    at_work = (count >= MIN_WINDOW_SAMPLES) & (util >= WORK_MIN_RATIO) & working
    return ~active(cells, ctx) | at_work
