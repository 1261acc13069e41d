"""busy_spin: utilization pinned at 100% while the GPU does no real work.

NVML's utilization only says a kernel was resident during the sample period, so one NCCL kernel
spinning on a flag reads 100%. Independent legs say whether real work is happening; the verdict names
the legs that fired. A single "power below X% of the limit" rule is not enough: a T4 spins at 58% of
its cap while a healthy tensor-parallel job at batch 1 sits near 30%.

Legs:
  power_near_idle    median power <= idle_power_max_multiple x this GPU's idle power (learned at 0% util,
                     else default_idle_power_ratio x the power limit)
  power_below_busy   median power <= busy_power_max_ratio x the power this GPU drew doing real work
  power_fell         median power <= fell_max_ratio x that power (weak: low-range GPUs such as a T4 spin
                     at 60-65% of their busy power, so it counts only when the whole job is pinned with it)
  power_flat         interquartile range of power <= power_flat_max_ratio x its median, or within
                     power_flat_min_watts (sensor noise)
  memory_idle        memory-controller utilization ~0 (a spinning kernel moves no memory)
  sm_activity_low    GPM SM activity low (Hopper and later)
Vetoes: hardware/thermal clock slowdown, SM clock far below max (that is throttle, not a spin),
memory-controller busy, SM activity high.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from watchdog.config import BusySpinConfig
from watchdog.detect.evidence import Evidence
from watchdog.detect.levels import zeroed
from watchdog.detect.stretch import (
    MIN_WINDOW_SAMPLES,
    Cells,
    Context,
    Window,
    at_rank,
    nearest_rank,
    ranked,
    run_start,
    seen_busy,
)
from watchdog.vocabulary.model import THROTTLE_REASON_MASK, GpuSample, Signature

_FLAT_MIN_SAMPLES = 8  # the flatness of fewer samples means little
_AT_WORK_FACTOR = 2  # memory traffic or SM activity this many times a spin's most, in one sample: real work
_MAX_SPAN_SECONDS = 40.0  # a spin is critical within a minute at any sampling interval
# A window that still holds the work before a spin vetoes it (memory traffic, SM activity) until the spin
# fills most of it. When the window finds nothing on a GPU whose processes are known (their stacks can be
# looked at), its newest samples alone, all pinned, are judged too: such evidence is `early`, enough to
# suspect the stall and look at its stacks, never to alert on by itself (detect/episodes.py).
_EARLY_SAMPLES = 8
_LEG_ORDER = ("memory_idle", "sm_activity_low", "power_near_idle", "power_below_busy", "power_fell", "power_flat")
_NAMED = [tuple(leg for bit, leg in enumerate(_LEG_ORDER) if mask >> bit & 1) for mask in range(1 << len(_LEG_ORDER))]


def detect(cells: Cells, cfg: BusySpinConfig, ctx: Context) -> dict[int, Evidence]:
    """The evidence of each cell (by its number) that spins."""
    util = cells.latest("utilization_ratio")
    memory, activity = cells.latest("memory_utilization_ratio"), cells.latest("sm_activity_ratio")
    due = ~(util < cfg.utilization_min_ratio)  # an [N/A] reading is judged on the window's others
    due &= ~at_work(memory, activity, cfg)
    chosen = np.flatnonzero(due)  # the gate: no work seen now (a tick judged so is absorbed by hysteresis)
    if not len(chosen):
        return {}
    cells = cells.subset(chosen)
    window = cells.window(_span(cells, cfg.window_seconds), ctx.short_seconds)
    enough = window.count >= 3
    legs, facts, weak = _legs(cells, cfg, window)
    early = np.zeros(len(cells), bool)
    maybe = enough & np.isnan(legs).all(axis=1) & (window.count > _EARLY_SAMPLES)
    if maybe.any() and (maybe := maybe & cells.has_pids()).any():
        newest = window.newest(_EARLY_SAMPLES)
        utils = newest.readings("utilization_ratio")
        low = np.where(np.isnan(utils), np.inf, utils).min(axis=1, initial=np.inf)
        maybe &= np.isfinite(low) & (low >= cfg.utilization_min_ratio)  # the spin's own samples, pinned
        early_legs, early_facts, early_weak = _legs(cells, cfg, newest)
        early = maybe & ~np.isnan(early_legs).all(axis=1)
        legs[early], weak[early] = early_legs[early], early_weak[early]
        for name in facts:
            facts[name][early] = early_facts[name][early]
    found = enough & ~np.isnan(legs).all(axis=1)
    if not found.any():
        return {}
    utils = window.readings("utilization_ratio")
    since = run_start(window.times(), ~np.isnan(utils) & (utils >= cfg.utilization_min_ratio), window.count)
    hits = np.flatnonzero(found)
    bits = (zeroed(legs[hits]) @ (1 << np.arange(len(_LEG_ORDER)))).astype(int).tolist()
    names = list(facts)
    quoted = np.column_stack([facts[name][hits] for name in names]).tolist()
    gpus = [cells.stretch.gpus[c] for c in cells.cols[hits].tolist()]
    out = {}
    for cell, mask, values, gpu, start, is_weak, is_early in zip(
            chosen[hits].tolist(), bits, quoted, gpus, since[hits].tolist(), weak[hits].tolist(),
            early[hits].tolist()):
        out[cell] = Evidence(gpu, Signature.BUSY_SPIN, since=start, legs=_NAMED[mask],
                             facts={k: v for k, v in zip(names, values) if v == v}, weak=is_weak, early=is_early)
    return out


def legs_markdown() -> str:
    """The table of the legs in docs/how-it-works.md (make docs), from the legs' order here and the settings that
    define each: a setting of BusySpinConfig whose description begins "Leg <name>" is that leg's."""
    fields = BusySpinConfig.model_fields
    rows = ["| leg | fires when | setting (default) |", "|---|---|---|"]
    for leg in _LEG_ORDER:
        keys = [k for k, f in fields.items() if re.match(rf"Leg {leg}\b", f.description or "")]
        if not keys:
            raise ValueError(f"leg {leg}: no setting of detectors.busy_spin describes it")
        said = [re.match(rf"Leg {leg}\b(?: \(([^)]*)\))?:? ?(.*)", fields[k].description or "", re.S) for k in keys]
        notes = "".join(f" ({m.group(1)})" for m in said if m and m.group(1))
        text = "; ".join(m.group(2).rstrip(".") for m in said if m) + "."
        settings = ", ".join(f"`{k}` ({fields[k].default})" for k in keys)
        rows.append(f"| `{leg}`{notes} | {text} | {settings} |")
    return "\n".join(rows)


def at_work(memory: Any, activity: Any, cfg: BusySpinConfig) -> Any:
    """Busy memory or busy SMs in a sample: real work now, whatever the window holds (a single tick judged
    so is absorbed by the episode's hysteresis). Readings as arrays or numbers, missing ones NaN."""
    return ((memory > _AT_WORK_FACTOR * cfg.memory_utilization_max_ratio)
            | (activity > _AT_WORK_FACTOR * cfg.sm_activity_max_ratio))


def working_now(sample: GpuSample, cfg: BusySpinConfig) -> bool:
    """at_work for one sample (the daemon reads the host progress only of the processes not at work)."""
    memory, activity = sample.memory_utilization_ratio, sample.sm_activity_ratio
    return bool(at_work(math.nan if memory is None else memory, math.nan if activity is None else activity, cfg))


def _legs(cells: Cells, cfg: BusySpinConfig, window: Window) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
    """For each cell, the legs that fire (1.0 for a leg that fired, 0.0 for one that did not; a row all
    NaN when a veto holds or too few legs fire), the facts they quote (NaN: not quoted) and whether the
    evidence is weak. Medians and quartiles are nearest ranks of the sorted readings."""
    n = len(cells)
    utils, count = ranked(window.readings("utilization_ratio"))
    utilization = at_rank(utils, count // 2)
    vetoed = (count == 0) | ~(utilization >= cfg.utilization_min_ratio)
    reasons = zeroed(window.readings("clock_event_reasons")).astype(np.int64)
    vetoed |= ((reasons & THROTTLE_REASON_MASK) != 0).any(axis=1)  # throttled: slow, not spinning
    clock, clock_max = cells.latest("sm_clock_hertz"), cells.latest("sm_clock_max_hertz")
    vetoed |= (clock_max > 0) & (clock < cfg.clock_min_ratio * clock_max)

    fired = np.zeros((n, len(_LEG_ORDER)))
    nan = np.full(n, np.nan)
    facts = {"utilization": utilization.copy(), "memory_utilization": nan.copy(), "sm_activity": nan.copy(),
             "power_watts": nan.copy(), "power_limit_watts": nan.copy(), "idle_watts": nan.copy(),
             "busy_watts": nan.copy()}
    memory, memories = ranked(window.readings("memory_utilization_ratio"))
    seen = memories > 0
    vetoed |= seen & (seen_busy(memory, memories) > cfg.memory_utilization_max_ratio)  # work
    fired[:, 0] = seen
    facts["memory_utilization"] = np.where(seen, at_rank(memory, memories - 1), np.nan)
    activity = window.readings("sm_activity_ratio")
    active = np.count_nonzero(~np.isnan(activity), axis=1)
    mean_activity = zeroed(activity).sum(axis=1) / np.maximum(active, 1)
    vetoed |= (active > 0) & (mean_activity > cfg.sm_activity_max_ratio)  # SMs busy: real work
    fired[:, 1] = active > 0
    facts["sm_activity"] = np.where(active > 0, mean_activity, np.nan)

    power, watts = ranked(window.readings("power_watts"))
    has_power = watts > 0
    # The median, not the mean: a spinning rank still shows brief bursts of real work.
    median = np.where(has_power, at_rank(power, watts // 2), np.nan)
    facts["power_watts"] = median
    limit = cells.latest("power_limit_watts")
    facts["power_limit_watts"] = np.where(has_power & (limit > 0), limit, np.nan)
    busy, idle = cells.level("busy"), cells.level("idle")
    idle = np.where(np.isnan(idle) & (limit > 0), cfg.default_idle_power_ratio * limit, idle)
    # Near idle means nothing where this GPU's work itself draws little more than idle (a T4: 27 W held,
    # 64 W busy): not while the power stays within fell_max_ratio of what it drew working.
    near = has_power & (median <= cfg.idle_power_max_multiple * idle) & (
        np.isnan(busy) | (median <= cfg.fell_max_ratio * busy))
    fired[:, 2] = near
    facts["idle_watts"] = np.where(near, idle, np.nan)
    below = has_power & (median <= cfg.busy_power_max_ratio * busy)
    fell = has_power & ~below & (median <= cfg.fell_max_ratio * busy)
    fired[:, 3], fired[:, 4] = below, fell
    facts["busy_watts"] = np.where(below | fell, busy, np.nan)
    spread = at_rank(power, 3 * watts // 4) - at_rank(power, watts // 4)
    flat = has_power & (spread <= np.maximum(cfg.power_flat_max_ratio * median, cfg.power_flat_min_watts))
    fired[:, 5] = flat

    substantive = fired[:, [0, 1, 2, 3]].any(axis=1)
    weak = ~substantive & fell & flat
    vetoed |= (fired.sum(axis=1) < cfg.min_legs) | ~(substantive | weak)
    fired[vetoed] = np.nan
    return fired, facts, weak


def _span(cells: Cells, seconds: float) -> np.ndarray:
    """The window to judge over: `seconds`, or enough samples to judge flatness when sampling is slow
    (Cells.span), but no more than _MAX_SPAN_SECONDS (at -l 10: four or five samples rather than a window
    of minutes), and never too short to hold the MIN_WINDOW_SAMPLES a window needs, half an interval to spare
    (at -l 25 and slower 40 s held one or two samples, and no spin was ever found; at -l 20, by the jitter)."""
    stretch = cells.span(seconds, _FLAT_MIN_SAMPLES)
    capped = np.where(stretch <= _MAX_SPAN_SECONDS, stretch, max(seconds, _MAX_SPAN_SECONDS))
    return np.maximum(capped, cells.span(seconds, MIN_WINDOW_SAMPLES - 0.5))


def pinned(cells: Cells, cfg: BusySpinConfig, ctx: Context) -> np.ndarray:
    """Utilization pinned at 100% with no memory traffic seen: a GPU like this may spin without enough
    power evidence of its own, and is never the one the others wait on."""
    window = cells.window(_span(cells, cfg.window_seconds), ctx.short_seconds)
    utils, count = ranked(window.readings("utilization_ratio"))
    memory, memories = ranked(window.readings("memory_utilization_ratio"))
    return (count >= MIN_WINDOW_SAMPLES) & (nearest_rank(utils, count, 0.5) >= cfg.utilization_min_ratio) & (
        (memories == 0) | (seen_busy(memory, memories) <= cfg.memory_utilization_max_ratio))
