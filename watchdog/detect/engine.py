"""Runs the detector table over a stream of node snapshots and tracks episodes.

observe(snapshot) ingests every sample; the detectors run at most once per evaluate_interval_seconds
of the stream's own clock, so a 100 ms trace and a 1 s live loop reach the same verdicts. Each detector
runs inside its own guard: a bug in one costs that detector for that tick (reported through `on_error`
and `detector_up`), never the others' verdicts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from watchdog.config import Config
from watchdog.detect import DETECTORS, Detector, busy_spin
from watchdog.detect.episodes import EpisodeTracker
from watchdog.detect.evidence import Evidence
from watchdog.detect.node import job_findings, underuse_finding
from watchdog.detect.window import GpuWindow
from watchdog.model import EpisodeEvent, Finding, NodeSnapshot, Severity, Signature

_PER_GPU_SEVERITY = {
    Signature.GPU_LOST: Severity.CRITICAL,
    Signature.THROTTLE: Severity.WARNING,
}


def _ignore(component: str, error: Exception) -> None:
    pass


_STEP_TOLERANCE_SECONDS = 0.5  # nvidia-smi prints a sample's GPUs milliseconds apart, not always in order


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
        self._last_evaluation: float | None = None
        self._sections = [(name, fn, getattr(d, name)) for name, fn in self.detectors.items()]
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
        last = self._last_evaluation
        if last is not None and t - last < self.config.sample.evaluate_interval_seconds:
            return []
        self._last_evaluation = t
        self.last_findings = self.evaluate(t)
        return self.tracker.update(t, self.last_findings)

    def evaluate(self, now: float) -> list[Finding]:
        views = {i: self._windows[i] for i in self._present}
        findings: list[Finding] = []
        spin: dict[int, Evidence] = {}
        zero: dict[int, Evidence] = {}
        underused: list[Evidence] = []
        failed: set[str] = set()
        for index, view in views.items():
            for name, detect, section in self._sections:
                if not section.enabled or name in failed:
                    continue
                try:
                    evidence = detect(view, section)
                except Exception as exc:  # the detector's guard: one bug costs one detector for one tick
                    failed.add(name)
                    self.on_error(f"detector_{name}", exc)
                    continue
                if evidence is None:
                    continue
                sig = evidence.signature
                if sig is Signature.BUSY_SPIN:
                    spin[index] = evidence
                elif sig is Signature.ZERO_UTIL:
                    zero[index] = evidence
                elif sig is Signature.UNDERUSE:
                    if index not in spin and index not in zero:
                        underused.append(evidence)
                else:
                    findings.append(Finding(
                        sig, _PER_GPU_SEVERITY[sig], (index,), since=evidence.since, legs=evidence.legs,
                        facts=evidence.facts, key=f"{name}:{index}",
                    ))
        self.detector_up = {f"detector_{name}": name not in failed
                            for name, _, section in self._sections if section.enabled}
        if underused:
            findings.append(underuse_finding(underused))
        if spin or zero:
            waiting_on = self.config.detectors.waiting.enabled
            bs = self.config.detectors.busy_spin
            pinned = [i for i, v in views.items() if i not in spin and i not in zero and busy_spin.pinned(v, bs)]
            findings.extend(f for f in job_findings(views, spin, zero, pinned)
                            if waiting_on or f.signature is not Signature.WAITING)
        return findings
