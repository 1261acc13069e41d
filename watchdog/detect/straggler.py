"""straggler: one GPU of a job computing slower than its peers, so that every step of the job waits for it
(a warning, never a page by itself).

In a synchronous job the peers of a slow GPU finish each step early and wait for it in the collective. From
outside the job a sick GPU shows in its clocks: held below its peers' by the hardware (a hardware slowdown,
thermal slowdown or the power brake, in its clock event reasons) while all of them work. A step that is
compute-bound scales with the clock, so the job runs about peers' clock / its clock slower than it would
without it: the estimated slowdown.

Gate: the newest SM clock at most (1 - clock_deficit_ratio) x the median newest clock of the tick's working
GPUs (utilization >= busy_min_ratio), with at least min_gpus of them.
Window: over window_seconds, its median clock against the median of every working GPU's median clock of
that tick, and a hardware reason in the window; named while it holds.
A GPU slower for no hardware reason is not named here: uneven work (pipeline stages, MoE experts, rank 0's
extra logging) and power capping move clocks too (a heavy stage draws more and is capped more; a GPU waiting
in a collective runs at full clock), and only the ranks' own stacks tell those apart.
"""

from __future__ import annotations

import numpy as np

from watchdog.config import StragglerConfig
from watchdog.detect.evidence import Evidence
from watchdog.detect.levels import zeroed
from watchdog.detect.stretch import MIN_WINDOW_SAMPLES, Cells, Context, nearest_rank, ranked, run_start
from watchdog.vocabulary.model import THROTTLE_REASON_MASK, Signature, throttle_reason_names


def below_peers(cells: Cells, cfg: StragglerConfig) -> tuple[np.ndarray, np.ndarray]:
    """The gate: whether each cell's GPU works at a newest clock this far below its working peers' (a candidate
    the window then judges), and which cells work."""
    clock, util = cells.latest("sm_clock_hertz"), cells.latest("utilization_ratio")
    working = (util >= cfg.busy_min_ratio) & _plausible(clock, cells.latest("sm_clock_max_hertz"))
    peers, counted = _tick_median(cells.at, np.where(working, clock, np.nan))
    return working & (counted >= cfg.min_gpus) & (clock <= (1 - cfg.clock_deficit_ratio) * peers), working


def detect(cells: Cells, cfg: StragglerConfig, ctx: Context) -> dict[int, Evidence]:
    """The evidence of each cell (by its number) whose GPU computes at clocks its working peers do not."""
    candidates, working = below_peers(cells, cfg)
    chosen = np.flatnonzero(candidates)
    if not len(chosen):
        return {}
    # The window of every working GPU of the ticks that have a candidate: their medians make the reference.
    ticks = np.isin(cells.at, cells.at[chosen]) & working
    judged = np.flatnonzero(ticks)
    some = cells.subset(judged)
    window = some.window(cfg.window_seconds, ctx.short_seconds)
    readings = window.readings("sm_clock_hertz")
    utils = window.readings("utilization_ratio")
    plausible = _plausible(readings, some.latest("sm_clock_max_hertz")[:, None])
    readings = np.where((utils >= cfg.busy_min_ratio) & plausible, readings, np.nan)  # its working samples only
    sorted_clocks, count = ranked(readings)
    median = nearest_rank(sorted_clocks, count, 0.5)
    median = np.where(count >= MIN_WINDOW_SAMPLES, median, np.nan)
    reference, peers_counted = _tick_median(some.at, median)
    held = zeroed(window.readings("clock_event_reasons")).astype(np.int64) & THROTTLE_REASON_MASK
    reasons = np.bitwise_or.reduce(held, axis=1) if held.shape[1] else np.zeros(len(held), np.int64)
    slow = (peers_counted >= cfg.min_gpus) & (median <= (1 - cfg.clock_deficit_ratio) * reference) & (reasons != 0)
    out: dict[int, Evidence] = {}
    if not slow.any():
        return out
    since = run_start(window.times(), readings <= (1 - cfg.clock_deficit_ratio) * reference[:, None], window.count)
    for k in np.flatnonzero(slow).tolist():
        cell = int(judged[k])
        named = throttle_reason_names(int(reasons[k]))
        facts: dict[str, float | str] = {"clock_hertz": float(median[k]), "peers_clock_hertz": float(reference[k]),
                                         "slowdown": float(reference[k] / median[k])}
        facts["reasons"] = ", ".join(named)
        out[cell] = Evidence(int(cells.stretch.gpus[cells.cols[cell]]), Signature.STRAGGLER, since=float(since[k]),
                             legs=("clock_below_peers", *named), facts=facts)
    return out


def _plausible(clock: np.ndarray, clock_max: np.ndarray) -> np.ndarray:
    """An SM clock that is a reading: above 0, and not above its maximum (where known) by more than boost slack."""
    return (clock > 0) & ~(clock > 1.1 * clock_max)


def _tick_median(at: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each cell, the median of the values of its tick's cells (NaN ignored) and how many there were."""
    if not len(at):
        return np.empty(0), np.empty(0, int)
    order = np.lexsort((values, at))
    ticks, ordered = at[order], values[order]
    starts = np.concatenate([[True], ticks[1:] != ticks[:-1]])  # where each tick's cells begin, in that order
    first = np.flatnonzero(starts)
    counts = np.add.reduceat(~np.isnan(ordered), first)
    medians = np.where(counts > 0, ordered[np.minimum(first + counts // 2, len(ordered) - 1)], np.nan)
    group = np.cumsum(starts) - 1
    out_median, out_count = np.empty(len(at)), np.empty(len(at), int)
    out_median[order], out_count[order] = medians[group], counts[group]
    return out_median, out_count
