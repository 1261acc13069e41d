"""Evidence that a stall has ended on a GPU: the job gone from it (memory released, no kernel), or real
work on it again. A fired stall episode ends on this evidence only (detect/episodes.py), so that a
condition lapsing for a tick or two (an utilization blip, a dropped sample, an `[N/A]`) ends nothing.

Real work: the median utilization of the last few seconds at least WORK_MIN_RATIO, and either below
busy_spin's pinned level (real work leaves gaps: 80-99%) or, pinned at 100%, with the power or the memory
traffic of work (a spinning kernel reads 100% too, at near-idle power and no memory traffic).
"""

from __future__ import annotations

from watchdog.config import BusySpinConfig
from watchdog.detect.evidence import percentile
from watchdog.detect.window import GpuView, span

WORK_MIN_RATIO = 0.5  # a training step's input-pipeline dips go lower, its median does not
_SECONDS = 10.0  # the recent stretch judged; the episode asks for clear_seconds of this in a row
_MIN_SAMPLES = 3


def recovered(view: GpuView, cfg: BusySpinConfig) -> bool:
    if not view.active:
        return True
    window = view.recent(span(view, _SECONDS, _MIN_SAMPLES))
    utils = sorted(s.utilization_ratio for _, s in window if s.utilization_ratio is not None)
    if len(utils) < _MIN_SAMPLES:
        return False
    util = percentile(utils, 0.5)
    if util < WORK_MIN_RATIO:
        return False
    if util < cfg.utilization_min_ratio:
        return True
    power = sorted(s.power_watts for _, s in window if s.power_watts is not None)
    busy = view.busy_watts
    if power and busy is not None and percentile(power, 0.5) > cfg.fell_max_ratio * busy:
        return True
    memory = sorted(s.memory_utilization_ratio for _, s in window if s.memory_utilization_ratio is not None)
    return bool(memory) and percentile(memory, 0.5) > cfg.memory_utilization_max_ratio
