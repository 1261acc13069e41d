"""zero_util: utilization 0 while the job's memory stays held, neither growing (start-up) nor released
(the job exiting). An idle GPU with a context shows brief 1-4% blips: at least half the window at
utilization_max_ratio and none of it above blip_max_ratio is idle. A pause shorter than the episode's
for_seconds (a checkpoint) never fires."""

from __future__ import annotations

import numpy as np

from watchdog.config import ZeroUtilConfig
from watchdog.detect.evidence import Evidence
from watchdog.detect.stretch import MIN_WINDOW_SAMPLES, Cells, Context, at_rank, nearest_rank, ranked, run_start
from watchdog.vocabulary.model import Signature


def detect(cells: Cells, cfg: ZeroUtilConfig, ctx: Context) -> dict[int, Evidence]:
    """The evidence of each cell (by its number) that sits idle with the job's memory held."""
    util, used = cells.latest("utilization_ratio"), cells.latest("memory_used_bytes")
    blip = cfg.blip_max_ratio
    chosen = np.flatnonzero(~(util > blip) & ~(used < ctx.memory_min_bytes))  # an [N/A] is judged on the window
    if not len(chosen):
        return {}
    cells = cells.subset(chosen)
    window = cells.window(cells.span(cfg.window_seconds, MIN_WINDOW_SAMPLES), ctx.short_seconds)
    readings = window.readings("utilization_ratio")
    utils, count = ranked(readings)
    idle = ((window.count >= MIN_WINDOW_SAMPLES) & (count > 0)
            & (nearest_rank(utils, count, 0.5) <= cfg.utilization_max_ratio))
    idle &= ~(at_rank(utils, count - 1) > blip)  # at work, or more than the blips of an idle GPU: not idle
    memory = window.readings("memory_used_bytes")
    held = np.count_nonzero(~np.isnan(memory), axis=1)
    first, last = _first(memory), _first(memory[:, ::-1])
    lowest = np.where(np.isnan(memory), np.inf, memory).min(axis=1, initial=np.inf)
    idle &= (held > 0) & ~(lowest < ctx.memory_min_bytes)
    idle &= ~(last - first > cfg.memory_growth_max_bytes)  # still allocating: start-up
    if not idle.any():
        return {}
    since = run_start(window.times(), np.isnan(readings) | (readings <= blip), window.count)
    power = cells.latest("power_watts")
    out = {}
    for n in np.flatnonzero(idle).tolist():
        facts: dict[str, float | str] = {"memory_used_bytes": float(last[n])}
        if not np.isnan(power[n]):
            facts["power_watts"] = float(power[n])
        out[int(chosen[n])] = Evidence(int(cells.stretch.gpus[cells.cols[n]]), Signature.ZERO_UTIL,
                                       since=float(since[n]), facts=facts)
    return out


def _first(readings: np.ndarray) -> np.ndarray:
    """Each row's first reading (NaN where it has none)."""
    there = ~np.isnan(readings)
    picked = np.take_along_axis(readings, np.argmax(there, axis=1)[:, None], axis=1)[:, 0]
    return np.where(there.any(axis=1), picked, np.nan)
