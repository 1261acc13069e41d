"""What each GPU has shown of itself, learnt tick by tick: the power it draws idle and doing real work (its
own baseline, which busy_spin's power legs compare against), and when its processes last moved on the host.

Worked out over a stretch of ticks at once, every GPU a column, with what carries from the stretch before
held here; the daemon's single tick and a replay's day go through the same steps.
  idle: the lowest mean of 5 consecutive samples at 0% utilization (samples with no reading skipped)
  busy: an average over about _BUSY_SECONDS of the power of samples at 50% utilization or more that draw
        more than idle_power_max_multiple x idle (or x default_idle_power_ratio x the limit): real work; or,
        where higher, the same average over about _SETTLED_SECONDS. A spin that draws more than that (an
        RTX A6000 spins at 165 W of its 260 W of work, past 2.5x its idle) passes for work at first: the short
        average follows it down within a minute, and power_fell would lapse before the spin is judged; the
        long one keeps what the work drew for minutes, and rises as fast as the short one does. Work that draws
        no more than that multiple of idle (a T4 trains at 58-64 W, 27 W held) is learnt, as in a log with no
        idle reading and no limit, from samples near the level learnt so far, but only those with gaps in their
        utilization (real work leaves them; a spin reads 100% every sample), and its first level only after
        _GAP_SAMPLES of them: a spin never passes for such work, nor does a job that spins from its start.
  host: when processes were first seen (again), last seen, and last seen moving (CPU or I/O)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_IDLE_BLOCK = 5  # consecutive util-0 samples averaged before they can lower the idle estimate
_BUSY_SECONDS = 50.0  # time constant of the busy level's average
_SETTLED_SECONDS = 600.0  # ... and of the slower one it never falls below
_DECISIONS = 3  # times a chunk's unsure samples are decided again on the levels worked out from them
_GAP_SAMPLES = 5  # samples at work with gaps in utilization before low power can set a first busy level
_CHUNK = 256  # rows per step of the busy average's recurrence (its weights' product stays well in range)
UNIT = 1 << 30  # utilization summed in these fixed-point steps: exact, in any order
LEARNT = ("idle", "busy", "host_first", "host_seen", "moved")  # learnt when first asked for (Frames.catch_up)
TOTALS = ("samples", "newest", "util_sum", "util_count")  # kept up as each tick comes
LEVELS = LEARNT + TOTALS


@dataclass
class LevelsConfig:
    idle_power_max_multiple: float
    default_idle_power_ratio: float
    fell_max_ratio: float
    pinned_min_ratio: float  # utilization at or above this reads as pinned (busy_spin's utilization_min_ratio)
    short_seconds: float
    progress_cpu_min_ratio: float
    progress_io_min_bytes_per_second: float


def zeroed(values: np.ndarray) -> np.ndarray:
    """Missing readings (NaN) as 0."""
    return np.where(np.isnan(values), 0.0, values)


def _averaged(level: np.ndarray, steps: np.ndarray, work: np.ndarray, working: np.ndarray, first: np.ndarray,
              seconds: float) -> np.ndarray:
    """b += w (p - b) over the working samples, w = 1 - exp(-min(dt, 10) / seconds) for the time dt since the
    GPU's last working sample (`steps`); the first ever sets it. As b_n = A_n (b_0 + sum w_k p_k / A_k) with A
    the running product of (1 - w)."""
    start = level.copy()
    if first.any():
        rows, cols = np.nonzero(first)
        start[cols] = work[rows, cols]  # the first working sample ever sets the level
    weight = np.where(working & ~first, 1.0 - np.exp(steps * (-1.0 / seconds)), 0.0)
    kept = np.cumprod(1.0 - weight, axis=0)
    terms = np.where(weight > 0, weight * work / kept, 0.0)
    return kept * (start + np.cumsum(terms, axis=0))


def _filled(marks: np.ndarray, carry: np.ndarray) -> np.ndarray:
    """Each row's latest marked time (NaN where none), starting from `carry`: times only grow, and fmax
    passes over NaN."""
    return np.fmax.accumulate(np.concatenate([carry[None, :], marks]), axis=0)[1:]


class Levels:
    def __init__(self, config: LevelsConfig, width: int = 0):
        self.config = config
        self.idle = np.full(width, np.nan)
        self.busy = np.full(width, np.nan)
        self.settled = np.full(width, np.nan)  # the slow average (_SETTLED_SECONDS) as of the last working sample
        self.busy_at = np.full(width, np.nan)
        self.gaps = np.zeros(width, np.int64)  # samples at work with gaps in utilization below the work multiple
        self.block = np.zeros((width, _IDLE_BLOCK - 1))  # each GPU's samples at 0% not yet averaged
        self.block_count = np.zeros(width, int)
        self.host = np.full((3, width), np.nan)  # first seen, last seen, last moved
        # Running totals (rows x GPUs, int64): samples seen, the row of the newest (numbered from the first
        # row ever), and the sum and count of utilization readings: a window's are two of them apart.
        self._running = np.zeros((3, width), np.int64)
        self.newest = np.full(width, -1, np.int64)

    def widen(self, width: int) -> None:
        grow = width - len(self.idle)
        nans = np.full(grow, np.nan)
        self.idle, self.busy, self.settled, self.busy_at = (
            np.concatenate([a, nans]) for a in (self.idle, self.busy, self.settled, self.busy_at))
        self.gaps = np.concatenate([self.gaps, np.zeros(grow, np.int64)])
        self.block = np.concatenate([self.block, np.zeros((grow, _IDLE_BLOCK - 1))])
        self.block_count = np.concatenate([self.block_count, np.zeros(grow, int)])
        self.host = np.hstack([self.host, np.full((3, grow), np.nan)])
        self._running = np.hstack([self._running, np.zeros((3, grow), np.int64)])
        self.newest = np.concatenate([self.newest, np.full(grow, -1, np.int64)])

    def learn(self, times: np.ndarray, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The learnt levels (LEARNT) as of each of these rows (rows x GPUs), carried on to the next rows."""
        util, power = values["utilization_ratio"], values["power_watts"]
        idle = self._idle(util, power)
        busy = self._busy(times, util, power, values["power_limit_watts"], idle)
        return {"idle": idle, "busy": busy, **self._host(times, values["host_cpu_ratio"],
                                                         values["host_io_bytes_per_second"])}

    def totals(self, util: np.ndarray, present: np.ndarray, first_row: int) -> dict[str, np.ndarray]:
        """The running totals (TOTALS) as of each of these rows, numbered from `first_row` on."""
        there = ~np.isnan(util)
        fixed = np.where(there, util * UNIT, 0.0).astype(np.int64)
        samples, sums, counts = (np.cumsum(a, axis=0, dtype=np.int64) + carry
                                 for a, carry in zip((present, fixed, there), self._running))
        rows = np.arange(first_row, first_row + len(util), dtype=np.int64)[:, None]
        newest = np.maximum.accumulate(np.concatenate([self.newest[None, :], np.where(present, rows, -1)]), axis=0)[1:]
        self._running = np.stack([samples[-1], sums[-1], counts[-1]])
        self.newest = newest[-1]
        return {"samples": samples, "newest": newest, "util_sum": sums, "util_count": counts}

    def _idle(self, util: np.ndarray, power: np.ndarray) -> np.ndarray:
        count, width = util.shape
        if not self.block_count.any() and not (util == 0.0).any():  # no sample at 0%: the level stands
            return np.broadcast_to(self.idle, util.shape).copy()
        valid = (~np.isnan(util) & ~np.isnan(power)).T  # column by column, each in row order
        cols, rows = np.nonzero(valid)
        carried = np.repeat(np.arange(width), self.block_count)
        carried_power = [self.block[g, :n] for g, n in enumerate(self.block_count.tolist()) if n]
        all_rows = np.concatenate([np.full(len(carried), -1), rows])
        all_cols = np.concatenate([carried, cols])
        order = np.lexsort((all_rows, all_cols))
        rows, cols = all_rows[order], all_cols[order]
        watts = np.concatenate([*carried_power, power.T[valid]])[order]
        zero = np.concatenate([np.ones(len(carried), bool), util.T[valid] == 0.0])[order]
        n = len(cols)
        index = np.arange(n)
        boundary = np.ones(n, bool)
        boundary[1:] = (cols[1:] != cols[:-1]) | ~zero[:-1]
        starts = np.maximum.accumulate(np.where(zero & boundary, index, 0)) if n else index
        position = index - starts
        complete = zero & (position % _IDLE_BLOCK == _IDLE_BLOCK - 1)
        found = np.full((count, width), np.inf)
        ends = np.flatnonzero(complete)
        if len(ends):
            total = watts[ends - 4]
            for back in (3, 2, 1, 0):  # summed oldest first, as the samples came
                total = total + watts[ends - back]
            np.minimum.at(found, (rows[ends], cols[ends]), total / _IDLE_BLOCK)
        start = np.where(np.isnan(self.idle), np.inf, self.idle)
        idle = np.minimum.accumulate(np.concatenate([start[None, :], found]), axis=0)[1:]
        self.idle = np.where(np.isinf(idle[-1]), np.nan, idle[-1]) if count else self.idle
        # What is left of each GPU's last run of samples at 0%: carried to the next stretch.
        self.block_count[:] = 0
        last = np.flatnonzero(np.append(cols[1:] != cols[:-1], True)) if n else index
        for i in last.tolist():
            if zero[i] and not complete[i]:
                size = int(position[i] % _IDLE_BLOCK) + 1
                self.block[cols[i], :size] = watts[i - size + 1:i + 1]
                self.block_count[cols[i]] = size
        return np.where(np.isinf(idle), np.nan, idle)

    def _busy(self, times: np.ndarray, util: np.ndarray, power: np.ndarray, limit: np.ndarray,
              idle: np.ndarray) -> np.ndarray:
        cfg = self.config
        candidate = (util >= 0.5) & ~np.isnan(power)
        reference = np.where(np.isnan(idle), np.where(limit > 0, cfg.default_idle_power_ratio * limit, np.nan), idle)
        working = candidate & (power > cfg.idle_power_max_multiple * reference)
        # With no reference (a log without a power limit that never saw this GPU idle), or below the multiple of
        # it with gaps in utilization (a spin reads 100% every sample), work is learnt from samples that keep
        # near the busy level learnt so far (not from a spin): each such sample decided on the level as of the
        # sample before it. The first level comes from any of them where there is no reference, else only after
        # _GAP_SAMPLES of them. Taken a chunk at a time all the same: the chunk's unsure samples are decided on
        # the level at its start, its levels worked out on that, the samples decided again on those levels (a few
        # times, while some change), and the chunk kept up to the first sample decided otherwise than its levels
        # assumed (that one decided as they say).
        unsure = candidate & np.isnan(reference)
        low = candidate & ~working & ~unsure & (util < cfg.pinned_min_ratio)  # a pinned one may be a spin
        gaps = np.cumsum(low, axis=0) + self.gaps
        if len(gaps):
            self.gaps = gaps[-1]
        first = unsure | (low & (gaps >= _GAP_SAMPLES))  # may set a first level
        doubt = unsure | low

        def decided(span: slice, watts: np.ndarray, level: np.ndarray) -> np.ndarray:
            near = doubt[span] & (watts > cfg.fell_max_ratio * level)
            return working[span] | np.where(np.isnan(level), first[span], near)

        out = np.empty_like(power)
        row, count = 0, len(times)
        while row < count:
            stop = min(count, row + _CHUNK)
            series = None
            span = slice(row, stop)
            work = working[span]
            if doubt[span].any():
                watts = power[span]
                work = decided(span, watts, np.fmax(self.busy, self.settled)[None, :])
                for _ in range(_DECISIONS):
                    series = self._series(times[span], watts, work)
                    before = np.concatenate([np.fmax(self.busy, self.settled)[None, :],
                                             np.fmax(series[0], series[1])[:-1]])
                    again = decided(span, watts, before)
                    wrong = np.flatnonzero((again != work).any(axis=1))
                    if not wrong.size:
                        break
                    work = again
                else:
                    stop = row + int(wrong[0]) + 1
                    work, series = again[:stop - row], None
            out[row:stop] = self._kept(series or self._series(times[row:stop], power[row:stop], work))
            row = stop
        return out

    def _series(self, times: np.ndarray, power: np.ndarray, working: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The short and the long average as of each row (NaN before a GPU's first working sample), and each
        row's latest working sample's time, from the levels as they stand."""
        marks = np.where(working, times[:, None], np.nan)
        last = _filled(marks, self.busy_at)
        before = np.concatenate([self.busy_at[None, :], last[:-1]])
        first = working & np.isnan(before)
        steps = np.minimum(times[:, None] - before, 10.0)
        work = np.where(working, power, 0.0)
        busy = _averaged(self.busy, steps, work, working, first, _BUSY_SECONDS)
        settled = _averaged(self.settled, steps, work, working, first, _SETTLED_SECONDS)
        gone = np.isnan(last)
        busy[gone] = settled[gone] = np.nan
        return busy, settled, last

    def _kept(self, series: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
        """The busy level as of each row, the higher of the short and the long average (_series), the averages
        kept as of the last row."""
        busy, settled, last = series
        gone = np.isnan(last)
        self.busy = np.where(gone[-1], self.busy, busy[-1])
        self.settled = np.where(gone[-1], self.settled, settled[-1])
        self.busy_at = last[-1]
        return np.fmax(busy, settled)

    def _host(self, times: np.ndarray, cpu: np.ndarray, io: np.ndarray) -> dict[str, np.ndarray]:
        cfg = self.config
        host = ~np.isnan(cpu) | ~np.isnan(io)
        stamped = np.where(host, times[:, None], np.nan)
        seen = _filled(stamped, self.host[1])
        before = np.concatenate([self.host[1][None, :], seen[:-1]])
        fresh = host & (np.isnan(before) | (times[:, None] - before > cfg.short_seconds))
        first = _filled(np.where(fresh, times[:, None], np.nan), self.host[0])
        moving = host & ((zeroed(cpu) >= cfg.progress_cpu_min_ratio)
                         | (zeroed(io) >= cfg.progress_io_min_bytes_per_second))
        moved = _filled(np.where(moving, times[:, None], np.nan), self.host[2])
        self.host = np.stack([first[-1], seen[-1], moved[-1]])
        return {"host_first": first, "host_seen": seen, "moved": moved}
