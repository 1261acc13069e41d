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

import bisect
import itertools
import math
import operator
from collections import deque

from watchdog.config import BusySpinConfig
from watchdog.detect.evidence import Evidence, percentile, run_start
from watchdog.detect.window import GpuRun, GpuView, span
from watchdog.model import THROTTLE_REASON_MASK, GpuSample, Signature

_MIN_SAMPLES = 8  # the flatness of fewer samples means little
_MAX_SPAN_SECONDS = 40.0  # a spin is critical within a minute at any sampling interval
# A window that still holds the work before a spin vetoes it (memory traffic, SM activity) until the spin
# fills most of it. When the window finds nothing on a GPU whose processes are known (their stacks can be
# looked at), its newest samples alone, all pinned, are judged too: such evidence is `early`, enough to
# suspect the stall and look at its stacks, never to alert on by itself (detect/episodes.py).
_EARLY_SAMPLES = 8


def evaluate(view: GpuView, cfg: BusySpinConfig) -> Evidence | None:
    latest = view.latest
    floor = cfg.utilization_min_ratio
    if latest.utilization_ratio is not None and latest.utilization_ratio < floor:
        return None  # an [N/A] reading is judged on the window's others
    if working_now(latest, cfg):  # a cheap pre-gate before the window pass
        return None
    span = _span(view, cfg.window_seconds)
    count = view.recent_count(span)
    if count < 3:
        return None
    readings = _readings(view, count)
    found = _legs(view, cfg, readings)
    early = False
    if found is None and count > _EARLY_SAMPLES and latest.pids:
        newest = _readings(view, _EARLY_SAMPLES, "busy_spin_newest")
        if newest.utils and newest.utils[0] >= floor:  # the spin's own samples, without the work before it
            found, early = _legs(view, cfg, newest), True
    if found is None:
        return None
    legs, facts, weak = found
    utils = readings.utils
    if not early and len(utils) == count and utils[0] >= floor:  # every sample holds: run_start's answer
        since = view.samples[len(view.samples) - count][0]
    else:
        window = view.recent(span)
        since = run_start([t for t, _ in window], [s.utilization_ratio is not None and s.utilization_ratio >= floor
                                                    for _, s in window])
    return Evidence(view.index, Signature.BUSY_SPIN, since=since, legs=legs, facts=facts, weak=weak, early=early)


def working_now(sample: GpuSample, cfg: BusySpinConfig) -> bool:
    """Busy memory or busy SMs in this sample: real work now, whatever the window holds (a single tick
    judged so is absorbed by the episode's hysteresis)."""
    memory, activity = sample.memory_utilization_ratio, sample.sm_activity_ratio
    return (memory is not None and memory > 2 * cfg.memory_utilization_max_ratio) or (
        activity is not None and activity > 2 * cfg.sm_activity_max_ratio)


def _legs(view: GpuView, cfg: BusySpinConfig, readings: _Readings
          ) -> tuple[tuple[str, ...], dict[str, float | str], bool] | None:
    """The legs that fire over these readings, the facts they quote, and whether they are weak; None when
    a veto holds or too few legs fire. This runs every tick for every spinning GPU: the medians and
    quartiles are nearest ranks of the sorted readings (as evidence.percentile takes them), by index."""
    if readings.throttled:
        return None  # throttled: slow, not spinning
    utils = readings.utils
    if not utils:
        return None
    utilization = utils[len(utils) // 2]
    if utilization < cfg.utilization_min_ratio:
        return None
    latest = view.latest
    clock, clock_max = latest.sm_clock_hertz, latest.sm_clock_max_hertz
    if clock is not None and clock_max and clock < cfg.clock_min_ratio * clock_max:
        return None

    legs: list[str] = []
    facts: dict[str, float | str] = {"utilization": utilization}
    substantive = False  # a leg other than power_fell and power_flat fired
    mem = readings.memory
    if mem:
        if percentile(mem, 0.9) > cfg.memory_utilization_max_ratio:
            return None  # the memory controller is busy: real work
        legs.append("memory_idle")
        facts["memory_utilization"] = mem[-1]
        substantive = True
    activity = readings.activity
    if activity:
        mean_activity = sum(activity) / len(activity)
        if mean_activity > cfg.sm_activity_max_ratio:
            return None  # SMs are busy: real work
        legs.append("sm_activity_low")
        facts["sm_activity"] = mean_activity
        substantive = True
    fell = flat = False
    power = readings.power
    if power:
        # The median, not the mean: a spinning rank still shows brief bursts of real work.
        watts = len(power)
        median = power[watts // 2]
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
            substantive = True
        if busy is not None and median <= cfg.busy_power_max_ratio * busy:
            legs.append("power_below_busy")
            facts["busy_watts"] = busy
            substantive = True
        elif busy is not None and median <= cfg.fell_max_ratio * busy:
            legs.append("power_fell")
            facts["busy_watts"] = busy
            fell = True
        if power[3 * watts // 4] - power[watts // 4] <= max(cfg.power_flat_max_ratio * median,
                                                            cfg.power_flat_min_watts):
            legs.append("power_flat")
            flat = True

    weak = not substantive and fell and flat
    if len(legs) < cfg.min_legs or not (substantive or weak):
        return None
    return tuple(legs), facts, weak


class _Readings:
    """The readings of busy_spin's window, kept as the window slides: a tick brings a sample and drops
    one, and the sorted lists are updated in place rather than sorted afresh. They always hold exactly
    the window's readings, so each percentile is the one sorting the window would give."""

    __slots__ = ("start", "end", "samples", "utils", "memory", "power", "activity", "throttled")

    def __init__(self, start: int = 0) -> None:
        self.start = self.end = start  # the samples held: numbers start..end-1 (see GpuView.added)
        self.samples: deque[GpuSample] = deque()
        self.utils: list[float] = []  # sorted, readings that are there only (a read may have failed)
        self.memory: list[float] = []
        self.power: list[float] = []
        self.activity: deque[float] = deque()  # in window order: summed as the window's own list would be
        self.throttled = 0  # samples with a hardware or thermal slowdown reason

    # The readings kept sorted are utilization, memory-controller utilization and power, each where it
    # is there; take() and drop() spell them out, as they run for every spinning GPU on every tick.
    def take(self, sample: GpuSample) -> None:
        self.samples.append(sample)
        util, memory, power = sample.utilization_ratio, sample.memory_utilization_ratio, sample.power_watts
        if util is not None:
            bisect.insort(self.utils, util)
        if memory is not None:
            bisect.insort(self.memory, memory)
        if power is not None:
            bisect.insort(self.power, power)
        if sample.sm_activity_ratio is not None:
            self.activity.append(sample.sm_activity_ratio)
        if _throttled(sample):
            self.throttled += 1

    def drop(self) -> None:
        sample = self.samples.popleft()
        util, memory, power = sample.utilization_ratio, sample.memory_utilization_ratio, sample.power_watts
        if util is not None:
            del self.utils[bisect.bisect_left(self.utils, util)]
        if memory is not None:
            del self.memory[bisect.bisect_left(self.memory, memory)]
        if power is not None:
            del self.power[bisect.bisect_left(self.power, power)]
        if sample.sm_activity_ratio is not None:
            self.activity.popleft()
        if _throttled(sample):
            self.throttled -= 1


def _throttled(sample: GpuSample) -> bool:
    """A hardware or thermal slowdown reason is set."""
    return bool(sample.clock_event_reasons and sample.clock_event_reasons & THROTTLE_REASON_MASK)


def _readings(view: GpuView, count: int, memo: str = "busy_spin") -> _Readings:
    """The readings of the view's newest `count` samples: those kept under `memo` for the last tick, slid
    on (the window's, and the newest _EARLY_SAMPLES alone)."""
    end = view.added
    start = end - count
    readings: _Readings | None = view.memo.get(memo)
    if readings is None or not readings.start <= start <= readings.end:  # not a slide of what is kept
        readings = view.memo[memo] = _Readings(start)
    for _ in range(start - readings.start):
        readings.drop()
    samples, new = view.samples, end - readings.end
    if new == 1:  # the usual tick: one sample more
        readings.take(samples[-1][1])
    else:
        for _, sample in itertools.islice(samples, len(samples) - new, None):
            readings.take(sample)
    readings.start, readings.end = start, end
    return readings


def _span(view: GpuView, seconds: float) -> float:
    """The window to judge over: `seconds`, or enough samples to judge flatness when sampling is slow
    (window.span), but no more than _MAX_SPAN_SECONDS (at -l 10: four or five samples rather than a window
    of minutes)."""
    stretch = span(view, seconds, _MIN_SAMPLES)
    return stretch if stretch <= _MAX_SPAN_SECONDS else max(seconds, _MAX_SPAN_SECONDS)


def pinned(view: GpuView, cfg: BusySpinConfig) -> bool:
    """Utilization pinned at 100% with no memory traffic seen: a GPU like this may spin without enough
    power evidence of its own, and is never the one the others wait on."""
    readings = _readings(view, view.recent_count(_span(view, cfg.window_seconds)))
    utils, mem = readings.utils, readings.memory
    if len(utils) < 3 or percentile(utils, 0.5) < cfg.utilization_min_ratio:
        return False
    return not mem or percentile(mem, 0.9) <= cfg.memory_utilization_max_ratio


def steady(run: GpuRun, view: GpuView, cfg: BusySpinConfig) -> bool:
    """evaluate() finds nothing after any of these samples: each fails its first checks (utilization
    below the floor, or the memory controller or the SMs busy now; an [N/A] utilization fails none)."""
    floor = cfg.utilization_min_ratio
    utils = run.column("utilization_ratio")
    if None not in utils and max(utils, default=0.0) < floor:
        return True
    memory_busy, sm_busy = 2 * cfg.memory_utilization_max_ratio, 2 * cfg.sm_activity_max_ratio
    memory, activity = run.column("memory_utilization_ratio"), run.column("sm_activity_ratio")
    if None not in memory and min(memory) > memory_busy:
        return True
    if None not in activity and min(activity) > sm_busy:
        return True  # the SMs busy at every sample: training on a GPU with GPM
    if None not in utils and None not in memory:  # each sample at or above the floor: memory or SMs busy
        hot = list(map(floor.__le__, utils))
        if activity.count(None) == len(activity):
            return min(itertools.compress(memory, hot), default=math.inf) > memory_busy
        if None not in activity:
            return all(map(operator.or_, map(memory_busy.__lt__, itertools.compress(memory, hot)),
                           map(sm_busy.__lt__, itertools.compress(activity, hot))))
    return all((u is not None and u < floor) or (m is not None and m > memory_busy) or (a is not None and a > sm_busy)
               for u, m, a in zip(utils, memory, activity))
