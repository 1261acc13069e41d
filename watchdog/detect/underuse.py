"""underuse: a running job that keeps its GPU mostly idle for a long time (the MoE fine-tune at 30-40%
for hours). A warning: nobody should be paged for it."""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Sequence

from watchdog.config import UnderuseConfig
from watchdog.detect.evidence import Evidence
from watchdog.detect.window import GpuRun, GpuView, fixed_utilizations
from watchdog.model import Signature


def evaluate(view: GpuView, cfg: UnderuseConfig) -> Evidence | None:
    mean = view.long_mean_utilization
    if mean is None or not cfg.utilization_min_ratio <= mean <= cfg.utilization_max_ratio:
        return None
    if not view.active or view.long_span_seconds < 0.9 * cfg.window_seconds:
        return None
    return Evidence(
        view.index,
        Signature.UNDERUSE,
        since=view.now - view.long_span_seconds,
        facts={"mean_utilization": mean, "window_seconds": view.long_span_seconds},
    )


def steady(run: GpuRun, view: GpuView, cfg: UnderuseConfig) -> bool:
    """evaluate() finds nothing after any of these samples (`view` is the window before them): the
    trailing mean stays outside [min, max] at every one, or the window stays too short to judge.

    Each tick's mean averages what is left of the window before the run and the run so far. A bound
    on all of them comes first (no old sample has left, or all that will have); when it does not
    settle the question, each tick's mean is worked out exactly from the window's fixed-point sums."""
    times, utils = run.times, run.column("utilization_ratio")
    if None in utils:
        kept = [(t, u) for t, u in zip(times, utils) if u is not None]
        if not kept:
            return True
        times, utils = tuple(t for t, _ in kept), tuple(u for _, u in kept)
    history, window = view.long_history(), cfg.window_seconds
    if times[-1] - (history[0][0] if history else times[0]) < 0.9 * window:
        return True  # the window is still too short to judge at the run's last tick
    if times[-1] - window >= times[0]:
        return False  # the run outlasts the window: not worked out here
    unit, count = view.long_unit, len(history)
    low, high = cfg.utilization_min_ratio * unit, cfg.utilization_max_ratio * unit
    margin = 1e-6 * unit  # floating point against exact sums: stay well clear of the thresholds
    cutoff = times[-1] - window
    leaving = bisect.bisect_left(history, cutoff, key=_TIME)
    gone = sum(map(_FIXED, itertools.islice(history, leaving)))
    # Cheapest first: each tick's lowest and highest possible means (below) pool the window before the
    # run (less what leaves, or all of it) with the run so far, so they lie between that part of the
    # window's own mean and the run's lowest (or highest) sample.
    if count and min((view.long_sum - gone) / count, min(utils) * unit) > high + margin:
        return True
    if count > leaving and max(view.long_sum / (count - leaving), max(utils) * unit) < low - margin:
        return True
    added = list(itertools.accumulate(map(operator.mul, utils, itertools.repeat(unit))))
    sizes = range(count + 1, count + 1 + len(added))
    # Lowest possible: the oldest samples gone, yet counted as if still there; highest: the reverse.
    lowest = min(map(operator.truediv, map(operator.add, itertools.repeat(view.long_sum - gone), added), sizes))
    if lowest > high + margin:
        return True
    highest = max(map(operator.truediv, map(operator.add, itertools.repeat(view.long_sum), added),
                      map(operator.sub, sizes, itertools.repeat(leaving))))
    if highest < low - margin:
        return True
    return _exact(times, utils, view, window, low, high, margin)


def _exact(times: Sequence[float], utils: Sequence[float], view: GpuView, window: float, low: float,
           high: float, margin: float) -> bool:
    history = view.long_history()
    fixed = fixed_utilizations(utils)  # as GpuWindow sums them
    cutoffs = list(map(operator.sub, times, itertools.repeat(window)))
    leaving = list(itertools.islice(history, bisect.bisect_left(history, cutoffs[-1], key=_TIME)))
    gone = list(itertools.accumulate(map(_FIXED, leaving), initial=0))  # sums of the oldest n entries
    dropped = list(map(bisect.bisect_left, itertools.repeat(list(map(_TIME, leaving))), cutoffs))
    left = map(operator.sub, itertools.repeat(view.long_sum), map(gone.__getitem__, dropped))
    sums = map(operator.add, left, itertools.accumulate(fixed))
    size = len(history) + 1
    means = list(map(operator.truediv, sums, map(operator.sub, range(size, size + len(utils)), dropped)))
    return min(means) > high + margin or max(means) < low - margin


_TIME, _FIXED = operator.itemgetter(0), operator.itemgetter(1)
