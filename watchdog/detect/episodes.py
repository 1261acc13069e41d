"""Episodes with hysteresis: ok -> suspect -> stalled -> resolved.

A condition must hold for `for_seconds` (counted from its first sample) before it fires, and be absent
for `clear_seconds` before it resolves, so one flapping sample neither fires nor resolves an alert.
A `waiting` episode fires as a warning and escalates once one unbroken wait outlives
`critical_after_seconds`: a tick without the condition (the collective completed, real work ran) is
progress, and restarts that clock even when it is too short to resolve the episode.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from watchdog.config import EpisodeTiming, WaitingConfig
from watchdog.detect.summary import summarize
from watchdog.model import EpisodeEvent, EventKind, Finding, Severity, Signature


@dataclass(slots=True)
class Episode:
    finding: Finding  # the latest finding of this episode
    onset: float
    absent_since: float | None = None
    wait_since: float = 0.0  # start of the current unbroken stretch of the condition
    fired_severity: Severity | None = None  # None while only suspect


class EpisodeTracker:
    def __init__(self, timing: Mapping[Signature, EpisodeTiming]):
        self._timing = timing
        self.episodes: dict[str, Episode] = {}
        self._resolved_at: dict[str, float] = {}

    def retime(self, timing: Mapping[Signature, EpisodeTiming]) -> None:
        self._timing = timing

    def _escalate_after(self, signature: Signature) -> float | None:
        timing = self._timing[signature]
        return timing.critical_after_seconds if isinstance(timing, WaitingConfig) else None

    def _event(self, kind: EventKind, ep: Episode, now: float, severity: Severity) -> EpisodeEvent:
        f = ep.finding
        wait = now - ep.wait_since
        return EpisodeEvent(
            event=kind,
            signature=f.signature,
            severity=severity,
            gpus=f.gpus,
            culprit_gpus=f.culprit_gpus,
            onset_seconds=ep.onset,
            at_seconds=now,
            summary=summarize(f, now - ep.onset, self._escalate_after(f.signature), wait),
            legs=f.legs,
        )

    def update(self, now: float, findings: Iterable[Finding]) -> list[EpisodeEvent]:
        events: list[EpisodeEvent] = []
        present: set[str] = set()
        for finding in findings:
            key = finding.episode_key
            present.add(key)
            ep = self.episodes.get(key)
            if ep is None:
                onset = max(min(finding.since, now), self._resolved_at.get(key, finding.since))
                ep = self.episodes[key] = Episode(finding, onset=onset, wait_since=onset)
            ep.finding = finding
            if ep.absent_since is not None:
                ep.wait_since = now
                ep.absent_since = None
            timing = self._timing[finding.signature]
            elapsed = now - ep.onset
            if elapsed < timing.for_seconds:
                continue
            severity = finding.severity
            escalate_after = self._escalate_after(finding.signature)
            if escalate_after is not None and now - ep.wait_since >= escalate_after:
                severity = Severity.CRITICAL
            if ep.fired_severity is None:
                ep.fired_severity = severity
                events.append(self._event(EventKind.FIRED, ep, now, severity))
            elif severity is Severity.CRITICAL and ep.fired_severity is Severity.WARNING:
                ep.fired_severity = severity
                events.append(self._event(EventKind.ESCALATED, ep, now, severity))

        for key in [k for k in self.episodes if k not in present]:
            ep = self.episodes[key]
            if ep.absent_since is None:
                ep.absent_since = now
            if now - ep.absent_since >= self._timing[ep.finding.signature].clear_seconds:
                del self.episodes[key]
                self._resolved_at[key] = now
                if ep.fired_severity is not None:
                    events.append(self._event(EventKind.RESOLVED, ep, now, ep.fired_severity))
        return events
