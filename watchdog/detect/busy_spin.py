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

import operator
from collections.abc import Sequence
from typing import TypeVar

from watchdog.config import BusySpinConfig
from watchdog.detect.evidence import Evidence, percentile, run_start
from watchdog.detect.window import GpuRun, GpuView
from watchdog.model import THROTTLE_REASON_MASK, GpuSample, Signature

_T = TypeVar("_T")
_COLUMNS = operator.itemgetter(*(GpuSample._fields.index(name) for name in (
    "clock_event_reasons", "utilization_ratio", "power_watts", "memory_utilization_ratio", "sm_activity_ratio")))
_WEAK = ("power_flat", "power_fell")
_MIN_SAMPLES = 8  # the flatness of fewer samples means little


def evaluate(view: GpuView, cfg: BusySpinConfig) -> Evidence | None:
    latest = view.latest
    floor = cfg.utilization_min_ratio
    if latest.utilization_ratio is None or latest.utilization_ratio < floor:
        return None
    # Cheap pre-gates on the newest sample before the window pass: busy memory or busy SMs now mean
    # real work now (a single skipped tick is absorbed by the episode's hysteresis).
    memory_now = latest.memory_utilization_ratio
    if memory_now is not None and memory_now > 2 * cfg.memory_utilization_max_ratio:
        return None
    if latest.sm_activity_ratio is not None and latest.sm_activity_ratio > 2 * cfg.sm_activity_max_ratio:
        return None
    window = view.recent(_span(view, cfg.window_seconds))
    if len(window) < 3:
        return None

    # The window's columns (this runs every tick for every spinning GPU).
    times, samples = zip(*window)
    reasons, in_order, power_column, memory_column, activity_column = zip(*map(_COLUMNS, samples))
    if any(r & THROTTLE_REASON_MASK for r in set(reasons) if r):
        return None  # throttled: slow, not spinning
    utils = sorted(_present(in_order))
    power = _present(power_column)
    mem = _present(memory_column)
    activity = _present(activity_column)
    if percentile(utils, 0.5) < floor:
        return None
    clock, clock_max = latest.sm_clock_hertz, latest.sm_clock_max_hertz
    if clock is not None and clock_max and clock < cfg.clock_min_ratio * clock_max:
        return None

    legs: list[str] = []
    facts: dict[str, float | str] = {"utilization": utils[len(utils) // 2]}
    if mem:
        mem.sort()
        if percentile(mem, 0.9) > cfg.memory_utilization_max_ratio:
            return None  # the memory controller is busy: real work
        legs.append("memory_idle")
        facts["memory_utilization"] = mem[-1]
    if activity:
        mean_activity = sum(activity) / len(activity)
        if mean_activity > cfg.sm_activity_max_ratio:
            return None  # SMs are busy: real work
        legs.append("sm_activity_low")
        facts["sm_activity"] = mean_activity
    if power:
        power.sort()
        # The median, not the mean: a spinning rank still shows brief bursts of real work.
        median = percentile(power, 0.5)
        facts["power_watts"] = median
        limit = latest.power_limit_watts
        if limit:
            facts["power_limit_watts"] = limit
        busy = view.busy_watts
        idle = view.idle_watts
        if idle is None and limit:
            idle = cfg.default_idle_power_ratio * limit
        # Near idle means nothing where this GPU's work itself draws little more than idle (a T4: 27 W held,
        # 64 W busy): not while the power stays within fell_max_ratio of what it drew working.
        if idle is not None and median <= cfg.idle_power_max_multiple * idle and (
                busy is None or median <= cfg.fell_max_ratio * busy):
            legs.append("power_near_idle")
            facts["idle_watts"] = idle
        if busy is not None and median <= cfg.busy_power_max_ratio * busy:
            legs.append("power_below_busy")
            facts["busy_watts"] = busy
        elif busy is not None and median <= cfg.fell_max_ratio * busy:
            legs.append("power_fell")
            facts["busy_watts"] = busy
        spread = percentile(power, 0.75) - percentile(power, 0.25)
        if spread <= max(cfg.power_flat_max_ratio * median, cfg.power_flat_min_watts):
            legs.append("power_flat")

    substantive = [leg for leg in legs if leg not in _WEAK]
    weak = not substantive and {"power_fell", "power_flat"} <= set(legs)
    if len(legs) < cfg.min_legs or not (substantive or weak):
        return None
    since = run_start(times, [u is not None and u >= floor for u in in_order])
    return Evidence(view.index, Signature.BUSY_SPIN, since=since, legs=tuple(legs), facts=facts, weak=weak)


def _present(values: Sequence[_T | None]) -> list[_T]:
    """The readings that are there (a column may have gaps where a read failed)."""
    return [v for v in values if v is not None] if None in values else list(values)  # type: ignore[arg-type]


def _span(view: GpuView, seconds: float) -> float:
    """The window to judge over: `seconds`, or enough samples to judge flatness when sampling is slow."""
    samples = view.samples
    if len(samples) < 2:
        return seconds
    interval = samples[-1][0] - samples[-2][0]
    return max(seconds, _MIN_SAMPLES * interval)


def pinned(view: GpuView, cfg: BusySpinConfig) -> bool:
    """Utilization pinned at 100% with no memory traffic seen: a GPU like this may spin without enough
    power evidence of its own, and is never the one the others wait on."""
    window = view.recent(_span(view, cfg.window_seconds))
    utils = sorted(s.utilization_ratio for _, s in window if s.utilization_ratio is not None)
    if len(utils) < 3 or percentile(utils, 0.5) < cfg.utilization_min_ratio:
        return False
    mem = sorted(s.memory_utilization_ratio for _, s in window if s.memory_utilization_ratio is not None)
    return not mem or percentile(mem, 0.9) <= cfg.memory_utilization_max_ratio


def steady(run: GpuRun, view: GpuView, cfg: BusySpinConfig) -> bool:
    """evaluate() finds nothing after any of these samples: each fails its first checks (utilization
    below the floor, or the memory controller or the SMs busy now)."""
    floor = cfg.utilization_min_ratio
    utils = run.column("utilization_ratio")
    if max(_present(utils), default=0.0) < floor:
        return True
    memory_busy, sm_busy = 2 * cfg.memory_utilization_max_ratio, 2 * cfg.sm_activity_max_ratio
    memory, activity = run.column("memory_utilization_ratio"), run.column("sm_activity_ratio")
    if None not in memory and min(memory) > memory_busy:
        return True
    return all(u is None or u < floor or (m is not None and m > memory_busy) or (a is not None and a > sm_busy)
               for u, m, a in zip(utils, memory, activity))
