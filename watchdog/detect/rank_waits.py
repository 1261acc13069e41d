"""The straggler from the ranks' own stacks: the rank its peers wait for waits least.

In a synchronous job every rank waits inside the step's collectives (or a sync) until the slowest arrives; the
slowest waits only for the communication itself. So each rank's share of stack samples spent waiting
(GpuSample.rank_waits, counted by stacks/sampling.py) is compared with the median share of its job's other
ranks on the node over wait_window_seconds, and over four times that (a smaller gap needs more samples to
stand out of chance; the short window is as long as the straggler's for_seconds, so what it names has held
that long and is warned of at once). A rank that waits at least wait_gap_ratio less, by wait_sigmas
standard errors of the two shares (each a proportion of its samples), is the one they wait for; once named it
stays named while the gap holds by half as many (so that a gap near the line does not come and go). The gap g is
the share of each step the others spend waiting for it: without it the step would take (1 - g) of the time,
so the job runs about 1 / (1 - g) slower than without it (or less: see WaitLedger._slowdown); a gap that grew
within the window is sized by the window's newest half (SIZED_SHARE), what it is now. A rank is named
only where the job runs at least wait_gap_ratio slower for it by that estimate, which also asks whether its
peers wait more than at their first look: a gap that chance alone drew among ranks that wait as they always
did (a few in a thousand GPU-days at wait_sigmas) leaves the peers' waits where they were.

Two differences are not a rank that became slow, and are said as "uneven work" (never an episode):
- one it already had when first sampled (its first look, RANK_WAITS first_*): pipeline stages of different
  size, rank 0's extra logging, experts that always get more tokens. Found with the same test on the first
  look's counts, looser: a gap there of at least half today's and two standard errors;
- one spent mostly in planned extra work (checkpoint I/O, an evaluation): the others wait for it, by design.
A rank slow since the watchdog first saw the job cannot be told from uneven work: it is said as uneven work,
and so is any difference while the first look lasts (there is no before yet).

A share moves from record to record by more than coin flips (a slow batch, a pause): that spread is taken from
the job's records, both the recent window's and its last SPREAD_RECORDS (half an hour), whichever is larger, so
that a few quiet records do not make the chance look small (Spread.of).

Where a job's ranks write NCCL Inspector logs, a second ledger (timed=True) judges GpuSample.nccl_waits by the
same rule: wall milliseconds for samples, milliseconds inside collectives (NCCL's own timing) for waits.
Milliseconds are not coin flips: there the chance a gap must beat is the record-to-record spread alone, and
nothing is judged before the spread is known.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from watchdog.config import StragglerConfig
from watchdog.detect.evidence import Evidence
from watchdog.vocabulary.model import RANK_WAITS, Signature
from watchdog.vocabulary.model import WAIT_FIRST_SAMPLES as _FIRST_SAMPLES
from watchdog.vocabulary.model import WAIT_FIRST_WAITS as _FIRST_WAITS
from watchdog.vocabulary.model import WAIT_JOB as _JOB
from watchdog.vocabulary.model import WAIT_PLANNED as _PLANNED
from watchdog.vocabulary.model import WAIT_RANK as _RANK
from watchdog.vocabulary.model import WAIT_SAMPLES as _SAMPLES
from watchdog.vocabulary.model import WAIT_WAITS as _WAITS

LONG_WINDOWS = 4  # the longer window, in short ones: a 10% slower rank stands out of chance there
REJUDGE_SECONDS = 5.0  # with no new counts, judged again this long after the last time
_STALE_WINDOWS = 2  # a GPU whose counts have not moved for this many windows is not compared (its rank left)
MIN_SPREAD_DEGREES = 4  # differences between records, across the job, for their spread to count
MIN_TIMED_MS = 10_000  # of a rank's timed collectives (nccl_waits) in a window, for it to be compared
MAX_READ_GAP_MS = 60_000  # timed counts may run ahead of the samples' clock by this much (a late read), no more
SPREAD_KEPT = 0.75  # of the record-to-record differences, the smallest this share give the spread
_KEPT_EDGE = statistics.NormalDist().inv_cdf((1 + SPREAD_KEPT) / 2)  # |Z| below it SPREAD_KEPT of the time
# The mean of the smallest SPREAD_KEPT of |Z| for Z normal with unit spread (0.515 for 75%).
_KEPT_MEAN = math.sqrt(2 / math.pi) * (1 - math.exp(-_KEPT_EDGE ** 2 / 2)) / SPREAD_KEPT
SPREAD_RECORDS = 120  # of each GPU's records (30 minutes of 15 s ones) for the spread, besides the recent window's
_BEFORE_SIGMAS = 2.0
_PLANNED_SHARE = 0.5  # a rank whose working samples are mostly planned work is uneven work, not a straggler
# A named rank's figures (its gap, the slowdown) come from the whole short window, which decides whether it is
# beyond chance, unless the gap over the window's newest SIZED_SHARE is larger by SIZED_SIGMAS of its errors: right
# after a rank slows most of the window is from before, and would say half the slowdown (a 1.18x job as 1.07x).
SIZED_SHARE = 0.5
SIZED_SIGMAS = 1.0


@dataclass(frozen=True)
class Gap:
    """One rank against its peers: their median wait share, its own, and whether the gap is beyond chance."""

    share: float
    peers: float
    samples: int
    beyond_chance: bool
    error: float = math.inf  # the standard error of the gap

    def beyond(self, sigmas: float) -> bool:
        """Beyond chance by `sigmas` standard errors rather than the ones it was judged by."""
        return self.beyond_chance and self.size >= sigmas * self.error

    @property
    def size(self) -> float:
        return self.peers - self.share


def gap(waits: int, samples: int, peer_waits: list[tuple[int, int]], least: float, sigmas: float,
        spread: Spread | None = None, counted: bool = True) -> Gap:
    """A rank's wait share against the median of its peers' ((waits, samples) each): beyond chance when at least
    `least` and `sigmas` standard errors apart. The shares are smoothed (one wait and one not added) so that 0 of
    n does not claim certainty. A share's error is the larger of two: as if each sample were a coin flip of its
    own, and from how much the job's ranks' shares moved from one record to the next (`spread`: a slow batch,
    a pause, the steps' own rhythm move a share more than coin flips do). The error of the peers' median is that
    of a median of k shares of a typical peer (pi/2 times the variance of their mean). Not `counted` (timed
    milliseconds, not samples): the spread alone, and no gap is beyond chance without one."""
    share = waits / samples
    shares = [w / n for w, n in peer_waits]
    peers = statistics.median(shares)
    typical = statistics.median(n for _, n in peer_waits)
    p, q = (waits + 1) / (samples + 2), (peers * typical + 1) / (typical + 2)
    mine, theirs = (p * (1 - p) / (samples + 2), q * (1 - q) / (typical + 2)) if counted else (0.0, 0.0)
    if spread is None and not counted:
        return Gap(share, peers, samples, False)
    if spread is not None:
        mine = max(mine, spread.variance * spread.per_sample / samples)
        theirs = max(theirs, spread.variance * spread.per_sample / typical)
    median_of = 1.0 if len(peer_waits) < 3 else math.pi / 2 / len(peer_waits)  # one or two peers: as one
    error = math.sqrt(mine + median_of * theirs)
    size = peers - share
    return Gap(share, peers, samples, size >= least and size >= sigmas * error, error)


@dataclass(frozen=True)
class Spread:
    """How much a job's ranks' wait shares move from one record to the next: the variance of one record's share
    and the samples of a typical record (a share over n samples then varies by variance * per_sample / n)."""

    variance: float
    per_sample: float

    @staticmethod
    def of(records: list[list[tuple[int, int]]]) -> Spread | None:
        """From each rank's records in order ((samples, waits) each), by the differences between a record's share
        and the next's, pooled: half their mean square is one record's variance while the share stands still.
        The mean is taken of the smallest SPREAD_KEPT of the differences, scaled as for normal ones (a change of
        level, the job slowing at a moment, is one large difference a rank and is left out). Not their median:
        shares of 120 samples move in steps of 1/120, and the median of such steps falls a step short (a third
        of the variance) as often as not. None with fewer than MIN_SPREAD_DEGREES differences to go on."""
        steps, sizes = [], []
        for mine in records:
            shares = [w / n for n, w in mine if n > 0]
            steps += [abs(b - a) for a, b in zip(shares, shares[1:])]
            sizes += [n for n, _ in mine if n > 0]
        if len(steps) < MIN_SPREAD_DEGREES:
            return None
        kept = sorted(steps)[:max(1, round(SPREAD_KEPT * len(steps)))]
        typical = statistics.fmean(kept) / _KEPT_MEAN  # the spread of a difference, were it normal
        return Spread(typical * typical / 2, statistics.median(sizes))

    @staticmethod
    def larger(a: Spread | None, b: Spread | None) -> Spread | None:
        """The one with the larger variance of one record's share, or the one there is."""
        if a is None or b is None:
            return a or b
        return a if a.variance * a.per_sample >= b.variance * b.per_sample else b


@dataclass(frozen=True)
class Uneven:
    """A standing difference: one rank its peers wait for by design or since it was first seen."""

    gpu: int
    rank: int
    gap: float  # the share of each step the others wait for it
    why: str  # "planned" (checkpoint I/O, evaluation) or "from_start"

    def sentence(self) -> str:
        where = ("while it saves a checkpoint or evaluates" if self.why == "planned"
                 else "as it has since it was first sampled")
        return (f"uneven work: rank {self.rank} (GPU {self.gpu}) is waited for {self.gap:.0%} of each step {where}; "
                "a standing difference in the work, not a rank that became slow")


class WaitLedger:
    """Each GPU's rank_waits counts over the recent past; judge(t) names the ranks the others wait for.
    timed: the counts are milliseconds from NCCL Inspector logs (nccl_waits), not stack samples."""

    def __init__(self, cfg: StragglerConfig, timed: bool = False):
        self.cfg, self.timed = cfg, timed
        self.history: dict[int, deque[tuple[float, tuple[int, ...]]]] = {}
        # Each GPU's latest SPREAD_RECORDS records ((samples, waits) each), for the spread: longer than the history
        self.records: dict[int, deque[tuple[int, int]]] = {}
        self.uneven: dict[int, Uneven] = {}  # as the latest judge() found it
        self.shares: dict[int, float] = {}  # each compared rank's wait share, as the latest judge() found it
        self.named: set[int] = set()  # GPUs judge() last named: they stay named on half the sigmas
        self._moved = False  # counts came since the last judgement
        self._judged: tuple[float, list[Evidence]] | None = None  # (when, what) the last judgement found

    @property
    def reported(self) -> bool:
        return bool(self.history)

    def observe(self, t: float, gpu: int, counts: tuple[int, ...]) -> None:
        """One sample's counts of a GPU's rank. Counts that did not move are not kept; counts of which any went
        back, that name another rank or job, that come at an earlier time, or (timed) that add more wall time
        than passed start the GPU's history afresh (a new process, or counts not to be trusted)."""
        if (len(counts) != len(RANK_WAITS) or counts[_WAITS] + counts[_PLANNED] > counts[_SAMPLES]
                or counts[_FIRST_WAITS] > counts[_FIRST_SAMPLES] or counts[_FIRST_SAMPLES] > counts[_SAMPLES]):
            return  # not counts the sampler writes: nothing to learn from them
        kept = self.history.setdefault(gpu, deque())
        if kept:
            at, last = kept[-1]
            if last == counts:
                return
            if (t < at or counts[:_SAMPLES] != last[:_SAMPLES] or any(c < b for c, b in zip(counts, last))
                    or (self.timed and counts[_SAMPLES] - last[_SAMPLES] > (t - at) * 1000 + MAX_READ_GAP_MS)):
                kept.clear()  # a new process, a clock gone back, or more wall time than passed: start afresh
                self.records.pop(gpu, None)
            else:
                self.records.setdefault(gpu, deque(maxlen=SPREAD_RECORDS)).append(
                    (counts[_SAMPLES] - last[_SAMPLES], counts[_WAITS] - last[_WAITS]))
        kept.append((t, counts))
        self._moved = True
        horizon = t - (LONG_WINDOWS + 1) * self.cfg.wait_window_seconds
        while len(kept) > 2 and kept[1][0] <= horizon:
            kept.popleft()

    def judge(self, t: float) -> list[Evidence]:
        """The stragglers at t, as straggler evidence (facts: rank, wait shares, slowdown); the standing
        differences go to self.uneven. Judged over wait_window_seconds and over LONG_WINDOWS times it, where a
        smaller gap stands out of chance: named in either is named (with the shorter window's numbers). Counts
        move once a record (15 s): judged again when one came, or REJUDGE_SECONDS on (a rank that left), the
        answer standing in between (64 GPUs: tens of milliseconds a judgement)."""
        if not self._moved and self._judged is not None and 0 <= t - self._judged[0] < REJUDGE_SECONDS:
            return list(self._judged[1])
        self._moved = False
        found = self._judge(t)
        self._judged = (t, found)
        return list(found)

    def _judge(self, t: float) -> list[Evidence]:
        window = self.cfg.wait_window_seconds
        long_recent, noise = self._recent(t, LONG_WINDOWS * window)
        spreads: dict[int, Spread | None] = {}  # each job's, found over the longer window and kept for the shorter
        newest = self._recent(t, window * SIZED_SHARE)[0]
        found, uneven, _ = self._judge_over(t, LONG_WINDOWS * window, long_recent, noise, spreads, newest)
        short, short_uneven, self.shares = self._judge_over(t, window, self._recent(t, window)[0], noise, spreads,
                                                            newest)
        found.update(short)
        uneven.update(short_uneven)
        for gpu in found:
            uneven.pop(gpu, None)
        self.uneven = uneven
        self.named = set(found)
        return list(found.values())

    def _recent(self, t: float, window: float) -> tuple[dict[int, tuple[float, tuple[int, ...], tuple[int, ...]]],
                                                           dict[int, list[tuple[int, int]]]]:
        """Each GPU with enough samples in the trailing `window`: (its window's start, the counts there, the newest
        counts), and its records in the window ((samples, waits) of each)."""
        cfg = self.cfg
        recent: dict[int, tuple[float, tuple[int, ...], tuple[int, ...]]] = {}
        records: dict[int, list[tuple[int, int]]] = {}
        for gpu, kept in self.history.items():
            newest = next((item for item in reversed(kept) if item[0] <= t), None)
            if newest is None or t - newest[0] > _STALE_WINDOWS * cfg.wait_window_seconds:
                continue
            start = next((item for item in reversed(kept) if item[0] <= t - window), kept[0])
            if newest[1][_SAMPLES] - start[1][_SAMPLES] >= self._min_samples:
                recent[gpu] = (start[0], start[1], newest[1])
                inside = [c for when, c in kept if start[0] <= when <= newest[0]]
                records[gpu] = [(b[_SAMPLES] - a[_SAMPLES], b[_WAITS] - a[_WAITS]) for a, b in zip(inside, inside[1:])]
        return recent, records

    @property
    def _min_samples(self) -> int:
        return MIN_TIMED_MS if self.timed else self.cfg.wait_min_samples

    def _judge_over(self, t: float, window: float, recent: dict[int, tuple[float, tuple[int, ...], tuple[int, ...]]],
                    noise: dict[int, list[tuple[int, int]]], spreads: dict[int, Spread | None],
                    newest: dict[int, tuple[float, tuple[int, ...], tuple[int, ...]]]
                    ) -> tuple[dict[int, Evidence], dict[int, Uneven], dict[int, float]]:
        """(stragglers, uneven work, every compared rank's wait share) over the trailing `window`. The chance a gap
        must beat is the larger spread (Spread.of) of two: of the job's records in the longer window (`noise`: it
        moves as the job does) and of their last SPREAD_RECORDS (a figure from more differences: fewer err low);
        `spreads` keeps each job's for the next window judged."""
        cfg = self.cfg
        jobs: dict[int, list[int]] = {}
        for gpu, (_, _, newest_counts) in recent.items():
            jobs.setdefault(newest_counts[_JOB], []).append(gpu)
        found: dict[int, Evidence] = {}
        uneven: dict[int, Uneven] = {}
        shares: dict[int, float] = {}
        for job, gpus in jobs.items():
            if len(gpus) < 2:
                continue
            deltas = {g: _delta(recent[g][1], recent[g][2]) for g in gpus}
            if job not in spreads:
                recent_spread = Spread.of([noise[o] for o in gpus if o in noise])  # moves as the job does
                spreads[job] = Spread.larger(recent_spread, Spread.of([list(self.records.get(o, ())) for o in gpus]))
            spread = spreads[job]
            for g in gpus:
                samples, waits, planned = deltas[g]
                shares[g] = round(waits / samples, 4)
                # Hysteresis: named or said to be uneven work, it stays so while the gap holds by half the sigmas
                # (but a rank said to be uneven work is named only by the full ones).
                sigmas = cfg.wait_sigmas / 2 if g in self.named or g in self.uneven else cfg.wait_sigmas
                now = gap(waits, samples, [(deltas[o][1], deltas[o][0]) for o in gpus if o != g], cfg.wait_gap_ratio,
                          sigmas, spread, counted=not self.timed)
                if not now.beyond_chance:
                    continue
                counts = recent[g][2]
                working = samples - waits
                if working and planned / working >= _PLANNED_SHARE:
                    uneven[g] = Uneven(g, counts[_RANK], now.size, "planned")
                    continue
                if self._from_start(g, gpus, now, spread):
                    uneven[g] = Uneven(g, counts[_RANK], now.size, "from_start")
                    continue
                if g not in self.named and not now.beyond(cfg.wait_sigmas):
                    continue
                if g not in self.named and self._slowdown(g, gpus, now) < 1 + cfg.wait_gap_ratio:
                    continue  # its peers wait hardly more than at their first look: the job is not slower for it
                if all(o in newest for o in gpus):  # a gap that grew within the window: sized by its newest part
                    part = {o: _delta(newest[o][1], newest[o][2]) for o in gpus}
                    latest = gap(part[g][1], part[g][0], [(part[o][1], part[o][0]) for o in gpus if o != g], 0.0, 0.0,
                                 spread, counted=not self.timed)
                    if latest.size - now.size >= SIZED_SIGMAS * latest.error:
                        now, samples = latest, part[g][0]
                slowdown = self._slowdown(g, gpus, now)
                facts: dict[str, float | str] = {"rank": counts[_RANK], "slowdown": slowdown}
                if self.timed:
                    facts.update(nccl_ratio=round(now.share, 3), peers_nccl_ratio=round(now.peers, 3),
                                 nccl_seconds=round(samples / 1000))
                else:
                    facts.update(wait_ratio=round(now.share, 3), peers_wait_ratio=round(now.peers, 3),
                                 wait_samples=samples)
                found[g] = Evidence(g, Signature.STRAGGLER, since=max(recent[g][0], t - window),
                                    legs=("nccl_least" if self.timed else "waits_least",), facts=facts)
        return found, uneven, shares

    def _slowdown(self, gpu: int, gpus: list[int], now: Gap) -> float:
        """How much slower the job runs for the rank, the smaller of two estimates. By the gap: without it each
        step would lose the share its peers wait for it, 1 / (1 - gap). By the peers' own time: what they do
        besides waiting is what it was at their first look, so the step is (1 - their share then) / (1 - their
        share now) as long as it was; this one holds where ranks also wait for one another's jitter (many
        ranks), which the gap counts as waiting for the straggler."""
        by_gap = 1 / (1 - min(now.size, 0.95))
        firsts = [c[_FIRST_WAITS] / c[_FIRST_SAMPLES] for o in gpus if o != gpu
                  for c in (self.history[o][-1][1],) if c[_FIRST_SAMPLES] >= self._min_samples]
        if not firsts:
            return by_gap
        by_peers = (1 - statistics.median(firsts)) / (1 - min(now.peers, 0.95))
        return min(by_gap, by_peers) if by_peers > 1 else by_gap  # peers that wait no more than before: by the gap

    def _from_start(self, gpu: int, gpus: list[int], now: Gap, spread: Spread | None) -> bool:
        """Whether the rank already waited less than its peers at its first look, by at least half today's gap and
        two standard errors (a looser test than today's: a standing difference is not to be named a straggler).
        While the first look lasts (every sample so far is in it), there is no before to differ from: it did."""
        first = self.history[gpu][-1][1]
        peers = [(c[_FIRST_WAITS], c[_FIRST_SAMPLES]) for o in gpus if o != gpu
                 for c in (self.history[o][-1][1],) if c[_FIRST_SAMPLES] > 0]
        if first[_FIRST_SAMPLES] < self._min_samples or first[_FIRST_SAMPLES] >= first[_SAMPLES] or not peers:
            return True  # no look before this one: it cannot be told from the way the job is
        return gap(first[_FIRST_WAITS], first[_FIRST_SAMPLES], peers, now.size / 2, _BEFORE_SIGMAS,
                   spread if self.timed else None, counted=not self.timed).beyond_chance  # counted: coin flips


def _delta(start: tuple[int, ...], end: tuple[int, ...]) -> tuple[int, int, int]:
    """(samples, waits, planned) between two counts of one rank."""
    return end[_SAMPLES] - start[_SAMPLES], end[_WAITS] - start[_WAITS], end[_PLANNED] - start[_PLANNED]
