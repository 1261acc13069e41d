"""Episodes with hysteresis: ok -> suspect -> stalled -> recovered -> resolved, and the one severity each
carries.

A condition must hold for `for_seconds` (counted from its onset, halfway between its first sample and the
one before it) before it fires, unless its
stacks were seen blocked at two looks seconds apart (stacks/confirm.py: a confirmed hang fires critical
once the stall has lasted stacks.confirm_min_seconds, unless it is a pause of a length the job recovered
from). A spin seen on its newest samples only, while the window still holds the work before it (an
`early` finding), is suspected at once but judged only with such stacks. A wait on GPUs
at work (not idle) must also have been seen on the ticks for 15 s of that (a window that dates it back
names culprits that may only be slower to show the spin). Once past
`for_seconds` the severity is judged every tick from all the evidence (detect/severity.py): the
telemetry, the ranks' host progress, the stacks' verdict noted for this episode, how long the stall has
lasted and the pauses the job has recovered from. It only ever rises within an episode (fired, then
escalated). A stall episode's first appearance is reported as `suspected`, so the stacks can be captured
before it fires.

A stall episode (busy_spin, zero_util, waiting) is one stall of one job on its GPUs:
- Its signature may change while it lasts (a zero_util hang whose GPUs start to spin is still the same
  stall): a stall finding on GPUs of an open stall episode continues that episode.
- Once fired, it ends on evidence of recovery only (detect/recovery.py: every one of its GPUs back at
  work, or released, for `clear_seconds`). A lapse of the condition without that evidence (an
  utilization blip, a dropped sample, an `[N/A]`) neither ends it nor restarts its clock; a lapse with no
  evidence either way ends it after `job.relapse_seconds` (at least 2 minutes).
- A critical one (a page) is then held for `job.relapse_seconds`: a stall on the same GPUs meanwhile is
  the same episode continuing (no new page; the new stall is described and judged on its own clock), and
  the resolve is sent once the hold has passed without one. A warning resolves on recovery.
- A restart boundary (every process on its GPUs replaced by new ones: the job was restarted) ends it,
  and the pauses learnt from the old processes are forgotten.
An episode that never fired (suspect only), and the per-GPU signatures, resolve once their condition has
been absent for `clear_seconds`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from watchdog.config import Config, EpisodeTiming
from watchdog.detect.pauses import PauseMemory
from watchdog.detect.severity import PAUSES, STACK_SIGNATURES, judge
from watchdog.detect.summary import summarize
from watchdog.vocabulary.model import EpisodeEvent, EventKind, Finding, Severity, Signature, Verdict

_SEEN_SECONDS = 15.0  # a wait on GPUs at work fires only once seen this long, whatever its window dates it back
# to: a GPU whose window still holds what it did before the hang may only be slower to show the spin
_LAPSE_MIN_SECONDS = 120.0  # a lapse without evidence either way ends nothing sooner, whatever relapse_seconds
_BUSY_SHARE = 0.25  # an odd GPU at work on this share of a wait's ticks is busy (a writer), not blocked
Recovered = Callable[[tuple[int, ...]], bool]  # whether every one of these GPUs shows recovery now


@dataclass(slots=True)
class Episode:
    finding: Finding  # the latest finding of this episode
    onset: float  # its first sample: with the signature it began with, its identity
    identity: str  # what its events carry as `key`: the same from suspected to resolved
    stall_since: float = 0.0  # start of the current stall, the clock its severity is judged on
    signature_since: float = 0.0  # its current signature held since: for_seconds counts from here
    seen_at: float = 0.0  # the tick its current signature was first seen
    busy_ticks: int = 0  # judged ticks of the current stall on which a culprit GPU was at work (waiting)
    judged_ticks: int = 0
    absent_since: float | None = None  # the condition lapsed at
    recovering_since: float | None = None  # every GPU of it has shown recovery since
    recovered_at: float | None = None  # recovery confirmed: held for a relapse until resolved
    fired_severity: Severity | None = None  # None while only suspect
    reason: str = ""  # why the severity is what it is
    stacks: Verdict | None = None  # the latest stacks' verdict for this episode
    judged: Finding | None = None  # the latest finding that held for its for_seconds: what events describe

    @property
    def stall(self) -> bool:
        return self.finding.signature in STACK_SIGNATURES


@dataclass(slots=True)
class _Early:
    """A stall seen on early findings only (before the detectors' windows show it): suspected, so its stacks
    are looked at; it becomes an episode when they confirm a hang, or when the windows show it."""

    identity: str
    onset: float
    stacks: Verdict | None = None


def _confirmed(stacks: Verdict | None) -> bool:
    """A hang seen at two looks with nothing moving between (stacks/confirm.py): no need to wait."""
    return stacks is not None and stacks.kind == "hang" and stacks.confirmed


class EpisodeTracker:
    def __init__(self, timing: Mapping[Signature, EpisodeTiming], config: Config | None = None):
        self._timing = timing
        self.config = config or Config()
        self.episodes: dict[str, Episode] = {}
        self._early: dict[str, _Early] = {}
        self._resolved_at: dict[str, float] = {}
        self.pauses = PauseMemory()

    def retime(self, timing: Mapping[Signature, EpisodeTiming], config: Config | None = None) -> None:
        self._timing = timing
        if config is not None:
            self.config = config

    @property
    def needs_evidence(self) -> bool:
        """Whether a fired stall episode is open and not yet recovered: each tick's recovery evidence (and
        so a tick-by-tick evaluation) decides when it ends."""
        return any(ep.stall and ep.fired_severity is not None and ep.recovered_at is None
                   for ep in self.episodes.values())

    def restarted(self, gpus: Iterable[int], now: float) -> list[EpisodeEvent]:
        """A restart boundary: the processes on these GPUs were all replaced (a restarted job). The stall
        episodes on them end (a fired one is resolved: the hung incarnation is gone; a new stall is a new
        episode, judged on its own) and the pauses learnt from the old incarnation are forgotten."""
        gpus = set(gpus)
        events: list[EpisodeEvent] = []
        for key in [k for k, ep in self.episodes.items() if ep.stall and gpus.intersection(ep.finding.gpus)]:
            ep = self.episodes[key]
            ep.absent_since = ep.absent_since or now
            events += self._end(key, ep, now)  # a new stall's onset is then no earlier than now
        self.pauses = PauseMemory()
        return events

    @property
    def open(self) -> bool:
        """Whether an episode, or a stall only suspected on early findings, is open: an update with no
        finding may end it."""
        return bool(self.episodes or self._early)

    def identities(self) -> set[str]:
        """The identities (EpisodeEvent.key) of the open episodes and of the stalls only suspected early."""
        return {ep.identity for ep in self.episodes.values()} | {seen.identity for seen in self._early.values()}

    def note_stacks(self, named: str, verdict: Verdict) -> bool:
        """The stacks' verdict for the open episode an event named (EpisodeEvent.key); weighed in from the
        next update on. False when that episode has ended meanwhile."""
        for held in (self.episodes, self._early):
            for episode in held.values():
                if episode.identity == named:
                    episode.stacks = verdict
                    return True
        return False

    def _event(self, kind: EventKind, ep: Episode, now: float, severity: Severity) -> EpisodeEvent:
        f = ep.judged or ep.finding  # a signature seen for a moment at the end does not rename the episode
        end = now if kind is not EventKind.RESOLVED else (ep.recovered_at or ep.absent_since or now)
        stall = end - ep.stall_since  # a relapse is described by its own stall, not the episode's first
        head, text = summarize(f, stall, severity, ep.reason, ep.stacks, stall)
        return EpisodeEvent(event=kind, signature=f.signature, severity=severity, gpus=f.gpus,
                            culprit_gpus=f.culprit_gpus, onset_seconds=ep.onset, at_seconds=now, summary=text,
                            legs=f.legs, key=ep.identity, headline=head)

    def _continued(self, finding: Finding, present: set[str], now: float) -> Episode | None:
        """An open stall episode on some of the same GPUs, under another signature: the same stall."""
        if finding.signature not in STACK_SIGNATURES:
            return None
        gpus = set(finding.gpus)
        for key, ep in self.episodes.items():
            if key not in present and ep.stall and gpus.intersection(ep.finding.gpus):
                del self.episodes[key]
                self.episodes[finding.episode_key] = ep
                ep.signature_since, ep.seen_at = max(min(finding.since, now), ep.stall_since), now
                return ep
        return None

    def update(self, now: float, findings: Iterable[Finding], recovered: Recovered | None = None
               ) -> list[EpisodeEvent]:
        """The events of this tick. `recovered` answers for a fired stall episode whose condition lapsed;
        without it (a replay's steady stretch, where needs_evidence was False) none is asked for."""
        events: list[EpisodeEvent] = []
        if self.pauses.watched_since is None:
            self.pauses.watched_since = now
        everything = list(findings)
        early = {f.episode_key: f for f in everything if f.early}
        for key, finding in early.items():  # a hang the stacks confirmed: an episode now, on early findings too
            suspected = self._early.get(key)
            if (suspected is not None and key not in self.episodes and _confirmed(suspected.stacks)
                    and not self._stall_on(finding)):
                del self._early[key]
                self.episodes[key] = Episode(finding, suspected.onset, suspected.identity, suspected.onset,
                                             suspected.onset, now, stacks=suspected.stacks)
        # An early finding counts only for an episode its stacks confirmed: everything else is decided on the
        # windows' findings alone, as without it.
        findings = [f for f in everything if not f.early or (
            f.episode_key in self.episodes and _confirmed(self.episodes[f.episode_key].stacks))]
        present = {finding.episode_key for finding in findings}
        for finding in findings:
            key = finding.episode_key
            ep = self.episodes.get(key) or self._continued(finding, present, now)
            if ep is None:
                onset = max(min(finding.since, now), self._resolved_at.get(key, finding.since))
                suspected = self._early.pop(key, None)  # suspected early: its identity and stacks carry on
                identity = suspected.identity if suspected is not None else f"{key}@{onset:.0f}"
                ep = self.episodes[key] = Episode(finding, onset, identity, onset, onset, now)
                if suspected is not None:
                    ep.stacks = suspected.stacks
                elif finding.signature in STACK_SIGNATURES:
                    events.append(self._event(EventKind.SUSPECTED, ep, now, finding.severity))
            ep.finding = finding
            if ep.recovered_at is not None:  # a relapse: the same episode, judged on the new stall's clock
                ep.stall_since = ep.signature_since = max(min(finding.since, now), ep.recovered_at)
                ep.busy_ticks = ep.judged_ticks = 0
                ep.judged = finding
                ep.stacks = None  # the new stall's stacks are looked at afresh
                assert ep.fired_severity is not None  # only fired critical episodes are held
                events.append(self._event(EventKind.RELAPSED, ep, now, ep.fired_severity))
            ep.absent_since = ep.recovering_since = ep.recovered_at = None
            elapsed = now - ep.stall_since
            timing = self._timing[finding.signature]
            seen = now - ep.seen_at
            if (now - ep.signature_since < timing.for_seconds and not self._confirmed_early(ep, finding, elapsed)) or (
                    finding.culprits_busy and seen < min(timing.for_seconds, _SEEN_SECONDS)):
                continue
            # Counted past for_seconds only: at the onset the odd GPU's window still holds the work before it.
            ep.judged_ticks += 1
            ep.busy_ticks += finding.culprits_busy
            ep.judged = finding
            judgement = judge(finding, ep.stall_since, elapsed, timing, self.config, ep.stacks,
                              self.pauses, ep.busy_ticks >= _BUSY_SHARE * ep.judged_ticks > 0)
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
            if self._ended(ep, now, recovered):
                events += self._end(key, ep, now)
        return events + self._suspect_early(early, now)

    def _confirmed_early(self, ep: Episode, finding: Finding, elapsed: float) -> bool:
        """Whether a hang the stacks confirmed is judged before the signature's for_seconds: once the stall
        has lasted stacks.confirm_min_seconds (a data loader or a subprocess can hold a rank for seconds),
        and unless it is a pause of a length this job has recovered from."""
        return _confirmed(ep.stacks) and elapsed >= self.config.stacks.confirm_min_seconds and not (
            finding.signature in PAUSES and self.pauses.expected(
                ep.stall_since, elapsed, self.config.job.recovered_pause_margin_ratio))

    def _stall_on(self, finding: Finding) -> bool:
        """An open stall episode on some of these GPUs: an early finding there is that stall, not another."""
        gpus = set(finding.gpus)
        return any(ep.stall and gpus.intersection(ep.finding.gpus) for ep in self.episodes.values())

    def _suspect_early(self, early: Mapping[str, Finding], now: float) -> list[EpisodeEvent]:
        """Stalls seen on early findings only, with no episode: suspected (their stacks are looked at) until
        the finding goes, an episode takes them over, or their stacks confirm a hang (next update)."""
        for key in [k for k in self._early if k not in early or k in self.episodes]:
            del self._early[key]
        events = []
        for key, finding in early.items():
            if (key in self.episodes or key in self._early or finding.signature not in STACK_SIGNATURES
                    or self._stall_on(finding)):
                continue
            onset = max(min(finding.since, now), self._resolved_at.get(key, finding.since))
            identity = f"{key}@{onset:.0f}"
            self._early[key] = _Early(identity, onset)
            events.append(self._event(EventKind.SUSPECTED, Episode(finding, onset, identity, onset, onset, now),
                                      now, finding.severity))
        return events

    def _ended(self, ep: Episode, now: float, recovered: Recovered | None) -> bool:
        """Whether an episode whose condition is absent now ends."""
        absent_since = ep.absent_since
        assert absent_since is not None
        clear = self._timing[ep.finding.signature].clear_seconds
        if not ep.stall or ep.fired_severity is None:
            return now - absent_since >= clear
        relapse = self.config.job.relapse_seconds
        if ep.recovered_at is None:
            if recovered is not None and recovered(ep.finding.gpus):
                if ep.recovering_since is None:
                    ep.recovering_since = now
                if now - ep.recovering_since >= clear:
                    ep.recovered_at = now
                    ep.stacks = None  # what the stacks said was of the stall that ended
                    self._record_pause(ep, absent_since)
            else:
                ep.recovering_since = None
                return now - absent_since >= max(relapse, _LAPSE_MIN_SECONDS)  # no evidence either way: over
        if ep.recovered_at is None:
            return False
        return ep.fired_severity is not Severity.CRITICAL or now - ep.recovered_at >= relapse

    def _record_pause(self, ep: Episode, ended: float) -> None:
        if ep.finding.signature in PAUSES:
            self.pauses.record(ep.stall_since, ended - ep.stall_since)

    def _end(self, key: str, ep: Episode, now: float) -> list[EpisodeEvent]:
        del self.episodes[key]
        self._resolved_at[key] = now
        if ep.recovered_at is None and ep.absent_since is not None:
            self._record_pause(ep, ep.absent_since)
        if ep.fired_severity is None:
            return []
        return [self._event(EventKind.RESOLVED, ep, now, ep.fired_severity)]
