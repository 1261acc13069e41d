"""Runs the detector table over a stream of node snapshots and tracks episodes.

observe(...) takes the newest ticks: the daemon's one snapshot, or a replay's stretch of them (a list, or a
reader's column block). The detectors judge the GPUs at most once per evaluate_interval_seconds of the
stream's own clock, so a 100 ms trace and a 1 s live loop reach the same verdicts, and a stretch is judged
as its ticks would have been one by one. Each detector runs inside its own guard: a bug in one costs that
detector for that stretch (reported through `on_error` and `detector_up`), never the others' verdicts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial

import numpy as np

from watchdog.config import Config
from watchdog.detect import DETECTORS, DetectorSpec, leave_claimed
from watchdog.detect.episodes import Episode, EpisodeTracker
from watchdog.detect.evidence import Evidence
from watchdog.detect.frames import Frames, Ticks
from watchdog.detect.gpu_health import COUNTERS_OF, NO_COUNTERS, HealthLedger
from watchdog.detect.levels import Levels, LevelsConfig
from watchdog.detect.node import GpuView, job_findings, underuse_finding
from watchdog.detect.rank_waits import Uneven, WaitLedger
from watchdog.detect.recovery import recovered
from watchdog.detect.severity import STACK_SIGNATURES
from watchdog.detect.stream_clock import StreamClock
from watchdog.detect.stretch import Cells, Context, Stretch
from watchdog.detect.views import JobViews
from watchdog.vocabulary.model import (
    HEALTH_COUNTERS,
    EpisodeEvent,
    Finding,
    GpuSample,
    NodeSnapshot,
    Severity,
    Signature,
    SnapshotBlock,
    Verdict,
)

_ROW_GRACE_STEPS, _ROW_GRACE_SECONDS = 3, 3.0  # a GPU missing from a sample stays in the picture this long
_RECOVERY_BATCH = 256  # evaluated ticks whose recovery evidence is worked out at once, when first asked
_HEALTH_SLOTS = [GpuSample._fields.index(name) for name in ("xids", *HEALTH_COUNTERS)]
_WAITS_SLOTS = (GpuSample._fields.index("rank_waits"), GpuSample._fields.index("nccl_waits"))
HealthReading = tuple[int, int, tuple[int, ...], tuple, float | None]  # (new row, GPU, xids, counters, util)
WaitReading = tuple[int, int, tuple[int, ...], bool]  # (new row, GPU, rank_waits or nccl_waits, the latter)


def _ignore(component: str, error: Exception) -> None:
    pass


class DetectorEngine:
    def __init__(self, config: Config, on_error: Callable[[str, Exception], None] = _ignore,
                 detectors: Mapping[str, DetectorSpec] = DETECTORS):
        self.detectors = detectors
        self.on_error = on_error
        self.detector_up: dict[str, bool] = {}
        self.tracker = EpisodeTracker({sig: getattr(config.detectors, sig.value) for sig in Signature}, config)
        self.last_findings: list[Finding] = []
        self._last_evaluation: float | None = None
        self._pids: dict[int, tuple[int, ...]] = {}  # each GPU's processes, as last seen with any
        self._configure(config)
        self.frames = Frames(self._keep_seconds, Levels(self._levels_config()), self._tally_seconds)
        self.health = HealthLedger(config.detectors.gpu_health)
        self.waits = WaitLedger(config.detectors.straggler)
        self.nccl_waits = WaitLedger(config.detectors.straggler, timed=True)

    def _configure(self, config: Config) -> None:
        self.config = config
        d = config.detectors
        short = max(d.busy_spin.window_seconds, d.zero_util.window_seconds)
        self.context = Context(short, config.job.memory_min_bytes)
        self._keep_seconds = short + 60.0  # the rows the windows look at; underuse's long one at its totals only
        self._tally_seconds = max(short, d.underuse.window_seconds) + 60.0
        self._sections = [(name, spec, getattr(d, name)) for name, spec in self.detectors.items()]
        self._enabled = [name for name, _, section in self._sections if section.enabled]

    def _levels_config(self) -> LevelsConfig:
        bs, job = self.config.detectors.busy_spin, self.config.job
        return LevelsConfig(bs.idle_power_max_multiple, bs.default_idle_power_ratio, bs.fell_max_ratio,
                            bs.utilization_min_ratio, self.context.short_seconds, job.progress_cpu_min_ratio,
                            job.progress_io_min_bytes_per_second)

    def reconfigure(self, config: Config) -> None:
        """Apply a reloaded configuration without forgetting the rows, baselines or open episodes."""
        self._configure(config)
        self.frames.keep_seconds, self.frames.tally_seconds = self._keep_seconds, self._tally_seconds
        self.frames.levels.config = self._levels_config()
        self.health.cfg = config.detectors.gpu_health
        self.waits.cfg = self.nccl_waits.cfg = config.detectors.straggler
        self.detector_up = {}
        self.tracker.retime({sig: getattr(config.detectors, sig.value) for sig in Signature}, config)

    def open_episodes(self) -> list[Episode]:
        """The episodes open now, suspected or past suspicion (their fired_severity says which)."""
        return list(self.tracker.episodes.values())

    def episode_keys(self) -> set[str]:
        """The keys of every episode the engine holds, those only seen early included (what incidents keep)."""
        return self.tracker.identities()

    def pause_expected(self, onset: float) -> bool:
        """Whether a pause beginning at `onset` is one the job's rhythm expects (a checkpoint due then)."""
        return self.tracker.pauses.expected(onset, 0.0, self.config.job.recovered_pause_margin_ratio)

    def note_stacks(self, key: str, verdict: Verdict) -> bool:
        """The stacks' verdict on an episode, handed back by the incident side: its severity is decided with it."""
        return self.tracker.note_stacks(key, verdict)

    @property
    def uneven(self) -> dict[int, Uneven]:
        """Standing differences in the work, by GPU, as the stacks or NCCL's timings (the stacks' word first) saw."""
        return {**self.nccl_waits.uneven, **self.waits.uneven}

    @property
    def clock(self) -> StreamClock:
        """The stream's own time, with the wall clock's steps back and jumps forward it took out."""
        return self.frames.clock

    def observe(self, ticks: NodeSnapshot | Sequence[NodeSnapshot] | SnapshotBlock) -> list[EpisodeEvent]:
        """The events of these ticks, in order: one snapshot (the daemon), or a stretch of them (a replay)."""
        if isinstance(ticks, NodeSnapshot):
            ticks = [ticks]
        if not len(ticks):
            return []
        arrays = Ticks.of_block(ticks) if isinstance(ticks, SnapshotBlock) else Ticks.of_snapshots(ticks)
        stretch, base = self.frames.add(arrays)
        health = deque(_health_readings(ticks))
        waits = deque(_wait_readings(ticks))
        restarts = self._restarts(stretch, base)
        due = self._due(stretch.times[base:].tolist())
        if not due:
            self._feed(stretch, base, health, waits, len(stretch))
            return [event for _, later in restarts for event in later()]
        return self._judge(stretch, [base + row for row in due], restarts, base, health, waits)

    def _feed(self, stretch: Stretch, base: int, health: deque[HealthReading], waits: deque[WaitReading],
              upto: int) -> None:
        """Hand the health and wait ledgers the readings of the new rows before `upto`, in order (consumed)."""
        while health and base + health[0][0] < upto:
            row, gpu, xids, counters, util = health.popleft()
            self.health.observe(float(stretch.times[base + row]), gpu, xids, counters, util)
        while waits and base + waits[0][0] < upto:
            row, gpu, counts, timed = waits.popleft()
            (self.nccl_waits if timed else self.waits).observe(float(stretch.times[base + row]), gpu, counts)

    def _due(self, times: list[float]) -> list[int]:
        """The new ticks due for judgement: each at least evaluate_interval_seconds after the one before."""
        interval, last, due = self.config.sample.evaluate_interval_seconds, self._last_evaluation, []
        for row, t in enumerate(times):
            if last is None or t - last >= interval:
                last = t
                due.append(row)
        self._last_evaluation = last
        return due

    def _restarts(self, stretch: Stretch, base: int) -> list[tuple[int, _Later]]:
        """Ticks at which all the processes of some GPUs were replaced since the last tick that showed any
        (a restarted job): their stall episodes end there (EpisodeTracker.restarted). Worked out when they
        are reached, as the episodes stand then: (row, events) for the caller to interleave."""
        pids = stretch.pids
        if pids is None:
            return []
        out = []
        gpus, seen = stretch.gpus, self._pids
        for row, values in enumerate(pids[base:].tolist()):
            replaced = []
            for col, now in enumerate(values):
                if not now:
                    continue
                gpu = gpus[col]
                before = seen.get(gpu)
                if before == now:  # the usual tick: the same processes
                    continue
                seen[gpu] = now
                if before is not None and not set(before).intersection(now):
                    replaced.append(gpu)
            if replaced:
                out.append((base + row, replaced))
        return [(row, _Later(self.tracker, gpus, float(stretch.times[row]))) for row, gpus in out]

    def _cells(self, stretch: Stretch, rows: list[int]) -> tuple[Cells, np.ndarray]:
        """Each due tick's GPUs in the picture (those it has, and those missing from it that were seen
        within the grace), as cells, and the due tick each cell belongs to."""
        at = np.asarray(rows)
        newest = stretch.newest(at)  # due ticks x GPUs
        grace = np.maximum(_ROW_GRACE_STEPS * stretch.steps[at], _ROW_GRACE_SECONDS)
        times = stretch.times
        seen = (newest >= 0) & (times[np.maximum(newest, 0)] >= (times[at] - grace)[:, None])
        tick, cols = np.nonzero(seen)
        return Cells(stretch, at[tick], cols, newest[tick, cols]), tick

    def _judge(self, stretch: Stretch, rows: list[int], restarts: list[tuple[int, _Later]], base: int,
               health: deque[HealthReading], waits: deque[WaitReading]) -> list[EpisodeEvent]:
        cells, tick = self._cells(stretch, rows)
        found: dict[str, dict[int, Evidence]] = {}
        failed: set[str] = set()
        for name, spec, section in self._sections:
            if not section.enabled:
                continue
            try:
                found[name] = spec.rule(cells, section, self.context)
            except Exception as exc:  # the detector's guard: one bug costs one detector for one stretch
                failed.add(name)
                found[name] = {}
                self.on_error(f"detector_{name}", exc)
        leave_claimed(found, failed, cells, self.detectors, self.config.detectors)
        if failed or len(self.detector_up) != len(self._enabled) or not all(self.detector_up.values()):
            self.detector_up = {f"detector_{name}": name not in failed for name in self._enabled}
        per_tick: list[list[tuple[str, DetectorSpec, Evidence]]] = [[] for _ in rows]
        order = {name: n for n, name in enumerate(self.detectors)}
        for name, evidence in found.items():
            spec = self.detectors[name]
            for cell, item in evidence.items():
                per_tick[int(tick[cell])].append((name, spec, item))
        judged = {cell for name in found if self.detectors[name].scope == "job"
                  for cell, evidence in found[name].items() if not evidence.early}
        wanted = [any(spec.scope == "job" for _, spec, _ in items) for items in per_tick]
        views = JobViews(cells, tick, wanted, judged, self.context, self.config.detectors.busy_spin,
                         self.config.job.progress_still_seconds) if any(wanted) else None
        recovery = _Recovery(self, cells, tick)
        events: list[EpisodeEvent] = []
        pending = list(restarts)
        tracker = self.tracker
        findings: list[Finding] = []
        health_on = self.config.detectors.gpu_health.enabled
        waits_on = self.config.detectors.straggler.enabled
        def placed(item: tuple[str, DetectorSpec, Evidence]) -> tuple[int, int]:
            return item[2].gpu, order[item[0]]

        for n, (row, t) in enumerate(zip(rows, stretch.times[rows].tolist())):
            while pending and pending[0][0] <= row:
                events += pending.pop(0)[1]()
            if health or waits:
                self._feed(stretch, base, health, waits, row + 1)
            items = per_tick[n]
            findings = self._findings(sorted(items, key=placed), views, n) if items else []
            if waits_on and (self.waits.reported or self.nccl_waits.reported):
                _join_waits(findings, [*self.waits.judge(t), *self.nccl_waits.judge(t)])
            if self.health.reported:
                for finding in findings:  # what the GPUs of a stall reported before it
                    if finding.signature in STACK_SIGNATURES and (note := self.health.before(finding.gpus, t)):
                        finding.facts["gpu_health"] = note
                if health_on:
                    findings += self.health.findings(t)
            if findings or tracker.open or tracker.pauses.watched_since is None:
                events += tracker.update(t, findings, partial(recovery.all, n))
        while pending:
            events += pending.pop(0)[1]()
        self._feed(stretch, base, health, waits, len(stretch))
        self.last_findings = findings
        return events

    def _findings(self, items: list[tuple[str, DetectorSpec, Evidence]], views: JobViews | None, n: int
                  ) -> list[Finding]:
        if not items:
            return []
        per_gpu: list[Finding] = []
        spin: dict[int, Evidence] = {}
        zero: dict[int, Evidence] = {}
        underused: list[Evidence] = []
        for name, spec, evidence in items:
            index, sig = evidence.gpu, evidence.signature
            if sig is Signature.BUSY_SPIN:
                spin[index] = evidence
            elif sig is Signature.ZERO_UTIL:
                zero[index] = evidence
            elif spec.scope == "node":
                underused.append(evidence)
            elif spec.severity is not None:
                per_gpu.append(Finding(sig, spec.severity, (index,), since=evidence.since, legs=evidence.legs,
                                       facts=evidence.facts, key=f"{name}:{index}"))
        findings = per_gpu
        underused = [e for e in underused if e.gpu not in spin and e.gpu not in zero]
        if underused:
            findings.append(underuse_finding(underused))
        if (spin or zero) and views is not None:
            seen, pinned = views.at(n)
            early = any(e.early for e in spin.values())
            findings.extend(self._job(seen, pinned, {i: e for i, e in spin.items() if not e.early} if early else spin,
                                      zero))
            if early:  # early evidence adds a suspicion, never hides or changes what the windows find
                known = {f.episode_key for f in findings}
                findings.extend(f for f in self._job(seen, pinned, spin, zero)
                                if f.early and f.episode_key not in known)
        return findings

    def _job(self, views: dict[int, GpuView], pinned: set[int], spin: dict[int, Evidence],
             zero: dict[int, Evidence]) -> list[Finding]:
        along = [i for i in views if i not in spin and i not in zero and i in pinned]
        waiting_on = self.config.detectors.waiting.enabled
        return [f for f in job_findings(views, spin, zero, along)
                if waiting_on or f.signature is not Signature.WAITING]


def _health_readings(ticks: Sequence[NodeSnapshot] | SnapshotBlock) -> list[HealthReading]:
    """The samples of these ticks that carry health (Xid events or counters), by row: none for a log that has
    no such columns."""
    out: list[HealthReading] = []
    if isinstance(ticks, SnapshotBlock):
        if all(ticks.columns[slot] is None for slot in _HEALTH_SLOTS):
            return out
        ticks = ticks.snapshots()
    for row, snapshot in enumerate(ticks):
        out += [(row, s.index, s.xids, counters, s.utilization_ratio) for s in snapshot.gpus
                if (counters := COUNTERS_OF(s)) != NO_COUNTERS or s.xids]
    return out


def _wait_readings(ticks: Sequence[NodeSnapshot] | SnapshotBlock) -> list[WaitReading]:
    """The samples of these ticks that carry stack sample (or NCCL Inspector) counts, by row: none for a trace
    without them."""
    if isinstance(ticks, SnapshotBlock):
        if all(ticks.columns[slot] is None for slot in _WAITS_SLOTS):
            return []
        ticks = ticks.snapshots()
    return [(row, s.index, counts, timed) for row, snapshot in enumerate(ticks) for s in snapshot.gpus
            for counts, timed in ((s.rank_waits, False), (s.nccl_waits, True)) if counts]


def _join_waits(findings: list[Finding], evidence: list[Evidence]) -> None:
    """The ranks the stacks (or NCCL's timings) name as stragglers, joined to the straggler finding of the same GPU
    (one episode, every leg; the slowdown measured from the waits, NCCL's where both) or added as their own."""
    known = {f.gpus[0]: n for n, f in enumerate(findings) if f.signature is Signature.STRAGGLER}
    for e in evidence:
        if e.gpu in known:
            same = findings[known[e.gpu]]
            findings[known[e.gpu]] = replace(same, legs=(*same.legs, *e.legs), facts={**same.facts, **e.facts})
            continue
        known[e.gpu] = len(findings)
        findings.append(Finding(Signature.STRAGGLER, Severity.WARNING, (e.gpu,), since=e.since, legs=e.legs,
                                facts=e.facts, key=f"straggler:{e.gpu}"))


class _Later:
    """A restart boundary's events, worked out when its tick is reached."""

    def __init__(self, tracker: EpisodeTracker, gpus: list[int], now: float):
        self.tracker, self.gpus, self.now = tracker, gpus, now

    def __call__(self) -> list[EpisodeEvent]:
        return self.tracker.restarted(self.gpus, self.now)


class _Recovery:
    """Whether the GPUs of a stall show it has ended, on a due tick: worked out for _RECOVERY_BATCH due
    ticks at once when first asked (an open episode asks on every tick)."""

    def __init__(self, engine: DetectorEngine, cells: Cells, tick: np.ndarray):
        self.engine, self.cells, self.tick = engine, cells, tick
        self.known: dict[int, dict[int, bool]] = {}

    def all(self, n: int, gpus: tuple[int, ...]) -> bool:
        if n not in self.known:
            chosen = np.flatnonzero((self.tick >= n) & (self.tick < n + _RECOVERY_BATCH))
            found = recovered(self.cells.subset(chosen), self.engine.config.detectors.busy_spin, self.engine.context)
            for cell, answer in zip(chosen.tolist(), found.tolist()):
                self.known.setdefault(int(self.tick[cell]), {})[self.cells.stretch.gpus[self.cells.cols[cell]]] = answer
            for k in range(n, n + _RECOVERY_BATCH):
                self.known.setdefault(k, {})
        answers = self.known[n]
        return all(answers[i] for i in gpus if i in answers)
