"""Episodes with hysteresis: ok -> suspect -> stalled -> resolved, and the one severity each carries.

A condition must hold for `for_seconds` (counted from its first sample) before it fires, and be absent
for `clear_seconds` before it resolves, so one flapping sample neither fires nor resolves an alert.
Once past `for_seconds` the severity is judged every tick from all the evidence (detect/severity.py):
the telemetry, the ranks' host progress, the stacks' verdict noted for this episode, how long it has
lasted and the pauses the job has recovered from. It only ever rises within an episode (fired, then
escalated). A `waiting` episode's unbroken wait restarts on any tick without the condition (progress),
even one too short to resolve the episode. A stall episode's first appearance is reported as `suspected`,
so the stacks can be captured before it fires.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from watchdog.config import Config, EpisodeTiming
from watchdog.detect.pauses import PauseMemory
from watchdog.detect.severity import PAUSES, STACK_SIGNATURES, judge
from watchdog.detect.summary import summarize
from watchdog.model import EpisodeEvent, EventKind, Finding, Severity, Signature, Verdict


@dataclass(slots=True)
class Episode:
    finding: Finding  # the latest finding of this episode
    onset: float
    absent_since: float | None = None
    wait_since: float = 0.0  # start of the current unbroken stretch of the condition
    fired_severity: Severity | None = None  # None while only suspect
    reason: str = ""  # why the severity is what it is
    stacks: Verdict | None = None  # the latest stacks' verdict for this episode


def event_key(key: str, episode: Episode) -> str:
    return f"{key}@{episode.onset:.0f}"


class EpisodeTracker:
    def __init__(self, timing: Mapping[Signature, EpisodeTiming], config: Config | None = None):
        self._timing = timing
        self.config = config or Config()
        self.episodes: dict[str, Episode] = {}
        self._resolved_at: dict[str, float] = {}
        self.pauses = PauseMemory()

    def retime(self, timing: Mapping[Signature, EpisodeTiming], config: Config | None = None) -> None:
        self._timing = timing
        if config is not None:
            self.config = config

    def note_stacks(self, named: str, verdict: Verdict) -> bool:
        """The stacks' verdict for the open episode an event named (EpisodeEvent.key); weighed in from the
        next update on. False when that episode has ended meanwhile."""
        for key, episode in self.episodes.items():
            if event_key(key, episode) == named:
                episode.stacks = verdict
                return True
        return False

    def _event(self, kind: EventKind, ep: Episode, now: float, severity: Severity) -> EpisodeEvent:
        f = ep.finding
        head, text = summarize(f, now - ep.onset, severity, ep.reason, ep.stacks, now - ep.wait_since)
        return EpisodeEvent(event=kind, signature=f.signature, severity=severity, gpus=f.gpus,
                            culprit_gpus=f.culprit_gpus, onset_seconds=ep.onset, at_seconds=now, summary=text,
                            legs=f.legs, key=event_key(f.episode_key, ep), headline=head)

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
                if finding.signature in STACK_SIGNATURES:
                    events.append(self._event(EventKind.SUSPECTED, ep, now, finding.severity))
            ep.finding = finding
            if ep.absent_since is not None:
                ep.wait_since = now
                ep.absent_since = None
            elapsed = now - ep.onset
            timing = self._timing[finding.signature]
            if elapsed < timing.for_seconds:
                continue
            judgement = judge(finding, ep.onset, elapsed, now - ep.wait_since, timing, self.config, ep.stacks,
                              self.pauses)
            if judgement is None:
                continue
            if ep.fired_severity is None:
                ep.fired_severity, ep.reason = judgement.severity, judgement.reason
                events.append(self._event(EventKind.FIRED, ep, now, judgement.severity))
            elif judgement.severity is Severity.CRITICAL and ep.fired_severity is Severity.WARNING:
                ep.fired_severity, ep.reason = judgement.severity, judgement.reason
                events.append(self._event(EventKind.ESCALATED, ep, now, judgement.severity))

        for key in [k for k in self.episodes if k not in present]:
            ep = self.episodes[key]
            if ep.absent_since is None:
                ep.absent_since = now
            if now - ep.absent_since >= self._timing[ep.finding.signature].clear_seconds:
                del self.episodes[key]
                self._resolved_at[key] = now
                if ep.finding.signature in PAUSES:
                    self.pauses.record(ep.onset, ep.absent_since - ep.onset)
                if ep.fired_severity is not None:
                    events.append(self._event(EventKind.RESOLVED, ep, now, ep.fired_severity))
        return events
