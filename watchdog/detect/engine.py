"""Runs the detector table over a stream of node snapshots and tracks episodes.

observe(snapshot) ingests every sample; the detectors run at most once per evaluate_interval_seconds
of the stream's own clock, so a 100 ms trace and a 1 s live loop reach the same verdicts. Each detector
runs inside its own guard: a bug in one costs that detector for that tick (reported through `on_error`
and `detector_up`), never the others' verdicts.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from watchdog.config import Config
from watchdog.detect import DETECTORS, STEADY, Detector, Steady, busy_spin
from watchdog.detect.episodes import EpisodeTracker
from watchdog.detect.evidence import Evidence
from watchdog.detect.node import job_findings, underuse_finding
from watchdog.detect.recovery import recovered
from watchdog.detect.window import GpuRun, GpuWindow
from watchdog.model import (
    EpisodeEvent,
    Finding,
    NodeSnapshot,
    Severity,
    Signature,
    SnapshotBlock,
    snapshot_range,
    snapshot_times,
)

_BULK_TICKS = 128  # a stretch checked for steadiness at once
_STEP_TICKS = 16  # observed one by one when a stretch is not steady, before checking again

_PER_GPU_SEVERITY = {
    Signature.GPU_LOST: Severity.CRITICAL,
    Signature.THROTTLE: Severity.WARNING,
}


def _ignore(component: str, error: Exception) -> None:
    pass


_INDEX = operator.itemgetter(0)
_STEP_TOLERANCE_SECONDS = 0.5  # nvidia-smi prints a sample's GPUs milliseconds apart, not always in order
_ROW_GRACE_STEPS, _ROW_GRACE_SECONDS = 3, 3.0  # a GPU missing from a sample stays in the picture this long


class DetectorEngine:
    def __init__(self, config: Config, on_error: Callable[[str, Exception], None] = _ignore,
                 detectors: Mapping[str, Detector] = DETECTORS):
        self.config = config
        self.detectors = detectors
        self.on_error = on_error
        self.detector_up: dict[str, bool] = {}
        self.clock_steps = 0  # backward steps of the stream's clock, survived
        self.last_step_seconds = 0.0
        self._last_stamp: float | None = None
        self._offset = 0.0
        self._step = 1.0
        d = config.detectors
        self._short_seconds = max(d.busy_spin.window_seconds, d.zero_util.window_seconds)
        self._long_seconds = d.underuse.window_seconds
        self._windows: dict[int, GpuWindow] = {}
        self._present: tuple[int, ...] = ()
        self._pids: dict[int, tuple[int, ...]] = {}  # each GPU's processes, as last seen with any
        self._last_evaluation: float | None = None
        self._was_steady = False  # observe_many's last stretch was ingested in bulk
        self._sections = [(name, fn, getattr(d, name)) for name, fn in self.detectors.items()]
        self._enabled = [name for name, _, section in self._sections if section.enabled]
        self._steady = self._steady_table()
        self.tracker = EpisodeTracker({sig: getattr(d, sig.value) for sig in Signature}, config)
        self.last_findings: list[Finding] = []

    def reconfigure(self, config: Config) -> None:
        """Apply a reloaded configuration without forgetting the windows, baselines or open episodes."""
        self.config = config
        d = config.detectors
        self._short_seconds = max(d.busy_spin.window_seconds, d.zero_util.window_seconds)
        self._long_seconds = d.underuse.window_seconds
        for window in self._windows.values():
            window.short_seconds, window.long_seconds = self._short_seconds, self._long_seconds
            self._apply_job(window)
        self._sections = [(name, fn, getattr(d, name)) for name, fn in self.detectors.items()]
        self._enabled = [name for name, _, section in self._sections if section.enabled]
        self._steady = self._steady_table()
        self.detector_up = {}
        self.tracker.retime({sig: getattr(d, sig.value) for sig in Signature}, config)

    def _apply_job(self, window: GpuWindow) -> None:
        job = self.config.job
        window.memory_min_bytes = job.memory_min_bytes
        window.progress_cpu_min_ratio = job.progress_cpu_min_ratio
        window.progress_io_min_bytes_per_second = job.progress_io_min_bytes_per_second
        window.progress_still_seconds = job.progress_still_seconds

    def _timeline(self, stamp: float) -> float:
        """The stream's time, kept in order. When the clock steps back (DST on a local-time nvidia-smi log,
        an NTP step live), later samples are shifted to continue where the clock was, so the windows and
        the schedule keep working; the step is counted (clock_steps) for the caller to say once."""
        last = self._last_stamp
        self._last_stamp = stamp
        if last is not None and stamp < last - _STEP_TOLERANCE_SECONDS:
            self.clock_steps += 1
            self.last_step_seconds = last - stamp
            self._offset += last - stamp + self._step
        elif last is not None and stamp > last:
            self._step = min(stamp - last, 60.0)
        return stamp + self._offset

    def observe(self, snapshot: NodeSnapshot) -> list[EpisodeEvent]:
        t = self._timeline(snapshot.time_seconds)
        windows = self._windows
        for sample in snapshot.gpus:
            window = windows.get(sample.index)
            if window is None:
                bs = self.config.detectors.busy_spin
                window = windows[sample.index] = GpuWindow(
                    sample.index, self._short_seconds, self._long_seconds,
                    bs.idle_power_max_multiple, bs.default_idle_power_ratio, bs.fell_max_ratio,
                )
                self._apply_job(window)
            window.add(t, sample)
        self._present = tuple(s.index for s in snapshot.gpus)
        boundary = self._restart_boundary(snapshot, t)
        last = self._last_evaluation
        if last is not None and t - last < self.config.sample.evaluate_interval_seconds:
            return boundary
        self._last_evaluation = t
        self.last_findings = self.evaluate(t)
        return boundary + self.tracker.update(t, self.last_findings, self._recovered)

    def _restart_boundary(self, snapshot: NodeSnapshot, t: float) -> list[EpisodeEvent]:
        """GPUs whose processes were all replaced since the last sample that had any (a restarted job):
        their stall episodes end there (EpisodeTracker.restarted)."""
        replaced = []
        seen = self._pids
        for sample in snapshot.gpus:
            pids = sample.pids
            if not pids or seen.get(sample.index) == pids:  # the usual tick: the same processes
                continue
            before = seen.get(sample.index)
            seen[sample.index] = pids
            if before is not None and not set(before).intersection(pids):
                replaced.append(sample.index)
        return self.tracker.restarted(replaced, t) if replaced else []

    def _recovered(self, gpus: tuple[int, ...]) -> bool:
        """Whether every one of these GPUs shows that its stall has ended (detect/recovery.py). A GPU no
        longer in the samples has left the job."""
        bs, windows, seen = self.config.detectors.busy_spin, self._windows, self._seen_since()
        return all(recovered(windows[i], bs) for i in gpus if i in windows and windows[i].now >= seen)

    def _seen_since(self) -> float:
        """A GPU whose row a sample lacks (nvidia-smi dropped it, a reading failed) is still part of the
        picture if it was seen this recently: its last samples stand in."""
        return (self._last_stamp or 0.0) + self._offset - max(_ROW_GRACE_STEPS * self._step, _ROW_GRACE_SECONDS)

    def _steady_table(self) -> list[tuple[Steady, Any]] | None:
        """The enabled detectors' steadiness checks; None when one has none (a custom detector)."""
        table = []
        for name, detect, section in self._sections:
            steady = STEADY.get(name)
            if steady is None or detect is not DETECTORS.get(name):
                return None
            if section.enabled:
                table.append((steady, section))
        return table

    def observe_many(self, snapshots: Sequence[NodeSnapshot] | SnapshotBlock) -> list[EpisodeEvent]:
        """The events observe() would return over these snapshots one after the other, in order.
        Stretches on which no detector can find anything (most of a healthy day) are ingested in
        bulk: for replaying long traces. A reader's SnapshotBlock is taken as it is, column by column;
        samples are built only for the ticks that are evaluated and for what the windows keep."""
        events: list[EpisodeEvent] = []
        start, count = 0, len(snapshots)
        halve = self._was_steady  # after a steady stretch: the change that ends it is looked for by halves
        while start < count:
            stop = min(count, start + _BULK_TICKS)
            runs = self._steady_runs(snapshots, start, stop)
            while runs is None and halve and stop - start > _STEP_TICKS:
                stop = start + (stop - start) // 2
                runs = self._steady_runs(snapshots, start, stop)
            halve = runs is not None
            if runs is not None:
                before_last, last = snapshot_times(snapshots, stop - 2, stop)
                events += self._ingest(before_last, last, runs)
            else:
                stop = min(count, start + _STEP_TICKS)
                for snapshot in snapshot_range(snapshots, start, stop):
                    events.extend(self.observe(snapshot))
            start = stop
        self._was_steady = halve
        return events

    def _steady_runs(self, stream: Sequence[NodeSnapshot] | SnapshotBlock, start: int, stop: int
                     ) -> list[tuple[GpuWindow, GpuRun]] | None:
        """Each known GPU's run over snapshots start..stop-1, when they can be ingested in bulk: no
        detector down, the same GPUs as the last snapshot, the clock moving forward, and every enabled
        detector steady on every GPU. Else None."""
        layout, last = self._present, self._last_stamp
        if self._steady is None or not layout or last is None or stop - start < 2 or self.tracker.needs_evidence:
            return None
        if not all(self.detector_up.values()):
            return None
        if isinstance(stream, SnapshotBlock) and stream.layout != layout:
            return None
        stamps = snapshot_times(stream, start, stop)
        if stamps[0] <= last or any(map(operator.ge, stamps[:-1], stamps[1:])):
            return None
        times = list(map(operator.add, stamps, itertools.repeat(self._offset)))
        if isinstance(stream, SnapshotBlock):
            candidates = [(index, GpuRun.of_block(times, stream, position, start))
                          for position, index in enumerate(layout)]
        else:
            per_snapshot = [snapshot.gpus for snapshot in stream[start:stop]]
            if set(map(len, per_snapshot)) != {len(layout)}:
                return None
            candidates = [(index, GpuRun(times, samples)) for index, samples in zip(layout, zip(*per_snapshot))]
            if any(run.column("index").count(index) != len(run) for index, run in candidates):
                return None
        runs = []
        for index, run in candidates:
            window = self._windows[index]
            for steady, section in self._steady:
                if not steady(run, window, section):
                    return None
            runs.append((window, run))
        return runs

    def _ingest(self, before_last: float, last_stamp: float, runs: list[tuple[GpuWindow, GpuRun]]
                ) -> list[EpisodeEvent]:
        """Bulk ingestion of a steady stretch: the windows, the stream clock, the evaluation schedule
        and the open episodes end as observe() would leave them. Its evaluations would all have found
        nothing, so each is an update of the episodes with no finding (which may resolve them)."""
        times = runs[0][1].times
        for window, run in runs:
            window.extend(run)
        self._step = min(last_stamp - before_last, 60.0)
        self._last_stamp = last_stamp
        interval, evaluated = self.config.sample.evaluate_interval_seconds, self._last_evaluation
        events: list[EpisodeEvent] = []
        tracker = self.tracker
        for t in times:
            if evaluated is None or t - evaluated >= interval:
                evaluated = t
                if tracker.open:
                    events += tracker.update(t, [])
        if evaluated != self._last_evaluation:
            self._last_evaluation = evaluated
            self.last_findings = []
            self.detector_up = {f"detector_{name}": True for name in self._enabled}
        return events

    def evaluate(self, now: float) -> list[Finding]:
        windows, seen = self._windows, self._seen_since()
        views = {i: windows[i] for i in self._present}
        views.update((i, w) for i, w in windows.items() if i not in views and w.now >= seen)
        present = list(views.values())
        per_gpu: list[tuple[int, int, Finding]] = []  # (GPU, detector order, finding)
        spin: dict[int, Evidence] = {}
        zero: dict[int, Evidence] = {}
        underused: list[Evidence] = []
        failed: set[str] = set()
        # Detector by detector over the GPUs: a quiet GPU costs each detector one call that returns at
        # its first check. A detector that raises loses this tick only (the guard), keeping what it
        # found on the GPUs before.
        for order, (name, detect, section) in enumerate(self._sections):
            if not section.enabled:
                continue
            found: list[Evidence] = []
            try:
                for view in present:
                    evidence = detect(view, section)
                    if evidence is not None:
                        found.append(evidence)
            except Exception as exc:  # the detector's guard: one bug costs one detector for one tick
                failed.add(name)
                self.on_error(f"detector_{name}", exc)
            for evidence in found:
                index, sig = evidence.gpu, evidence.signature
                if sig is Signature.BUSY_SPIN:
                    spin[index] = evidence
                elif sig is Signature.ZERO_UTIL:
                    zero[index] = evidence
                elif sig is Signature.UNDERUSE:
                    if index not in spin and index not in zero:
                        underused.append(evidence)
                else:
                    per_gpu.append((index, order, Finding(
                        sig, _PER_GPU_SEVERITY[sig], (index,), since=evidence.since, legs=evidence.legs,
                        facts=evidence.facts, key=f"{name}:{index}",
                    )))
        if failed or len(self.detector_up) != len(self._enabled) or not all(self.detector_up.values()):
            self.detector_up = {f"detector_{name}": name not in failed for name in self._enabled}
        findings = [finding for _, _, finding in sorted(per_gpu, key=lambda item: item[:2])]
        if underused:
            findings.append(underuse_finding(underused))
        if spin or zero:
            early = any(e.early for e in spin.values())
            findings.extend(self._job(views, {i: e for i, e in spin.items() if not e.early} if early else spin, zero))
            if early:  # early evidence adds a suspicion, never hides or changes what the windows find
                known = {f.episode_key for f in findings}
                findings.extend(f for f in self._job(views, spin, zero) if f.early and f.episode_key not in known)
        return findings

    def _job(self, views: dict[int, GpuWindow], spin: dict[int, Evidence], zero: dict[int, Evidence]
             ) -> list[Finding]:
        bs = self.config.detectors.busy_spin
        pinned = [i for i, v in views.items() if i not in spin and i not in zero and busy_spin.pinned(v, bs)]
        waiting_on = self.config.detectors.waiting.enabled
        return [f for f in job_findings(views, spin, zero, pinned)
                if waiting_on or f.signature is not Signature.WAITING]
