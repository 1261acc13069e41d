"""The episode machine: ok -> suspect -> stalled -> resolved, with hysteresis."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from watchdog.config import Config, EpisodeTiming, WaitingConfig
from watchdog.detect.episodes import EpisodeTracker
from watchdog.model import EventKind, Finding, Severity, Signature

TIMING = {sig: getattr(Config().detectors, sig.value) for sig in Signature}


def spin(since: float) -> Finding:
    return Finding(Signature.BUSY_SPIN, Severity.CRITICAL, (0, 1), since=since)


def run(condition: list[bool], timing: dict | None = None, finding=spin) -> list[tuple[int, EventKind]]:  # noqa: ANN001
    """One tick per second; the condition holds where True. Returns (tick, event kind)."""
    tracker = EpisodeTracker(timing or TIMING)
    out = []
    start = None
    for tick, holds in enumerate(condition):
        if holds and start is None:
            start = tick
        if not holds:
            start = None if tracker.episodes == {} else start
        findings = [finding(float(start if start is not None else tick))] if holds else []
        out += [(tick, e.event) for e in tracker.update(float(tick), findings) if e.event is not EventKind.SUSPECTED]
    return out


def test_fires_after_for_seconds_and_resolves_after_clear_seconds() -> None:
    events = run([False] * 5 + [True] * 60 + [False] * 30)
    assert events == [(35, EventKind.FIRED), (75, EventKind.RESOLVED)]


def test_onset_is_the_first_sample_of_the_evidence() -> None:
    tracker = EpisodeTracker(TIMING)
    (suspected,) = tracker.update(100.0, [spin(since=80.0)])
    assert suspected.event is EventKind.SUSPECTED and suspected.key == "busy_spin@80"
    (event,) = tracker.update(110.0, [spin(since=80.0)])
    assert event.key == suspected.key
    assert event.onset_seconds == 80.0 and event.at_seconds == 110.0


def test_a_short_gap_neither_resolves_nor_restarts() -> None:
    events = run([True] * 40 + [False] * 5 + [True] * 40 + [False] * 20)
    assert events == [(30, EventKind.FIRED), (95, EventKind.RESOLVED)]


def test_waiting_escalates_only_on_an_unbroken_wait() -> None:
    timing = dict(TIMING)
    timing[Signature.WAITING] = WaitingConfig(for_seconds=10, clear_seconds=10, critical_after_seconds=60)

    def waiting(since: float) -> Finding:
        return Finding(Signature.WAITING, Severity.WARNING, (0, 1), since=since, culprit_gpus=(1,))

    # A one-tick break (progress) restarts the escalation clock but does not resolve the episode.
    broken = run(([True] * 50 + [False]) * 3, timing, waiting)
    assert broken == [(10, EventKind.FIRED)]
    unbroken = run([True] * 100, timing, waiting)
    assert unbroken == [(10, EventKind.FIRED), (60, EventKind.ESCALATED)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.booleans(), max_size=300), st.integers(1, 40), st.integers(1, 20))
def test_hysteresis_properties(condition: list[bool], for_s: int, clear_s: int) -> None:
    timing = {sig: EpisodeTiming(for_seconds=for_s, clear_seconds=clear_s) for sig in Signature}
    events = run(condition, timing)
    kinds = [k for _, k in events]
    # Fired and resolved alternate, starting with fired.
    assert all(k is (EventKind.FIRED if i % 2 == 0 else EventKind.RESOLVED) for i, k in enumerate(kinds))
    for tick, kind in events:
        if kind is EventKind.FIRED:
            # Never fires on a run shorter than for_seconds, and only while the condition holds.
            assert condition[tick]
            assert tick >= for_s
        else:
            # Never resolves before the condition has been absent for clear_seconds.
            assert not any(condition[tick - clear_s + 1: tick + 1])
    # A condition whose runs, bridged over gaps up to clear_seconds, never span for_seconds never fires.
    if _longest_bridged_span(condition, clear_s) < for_s:
        assert events == [], (events, condition)


def _longest_bridged_span(condition: list[bool], clear_s: int) -> int:
    """Ticks from the first to the last True of the longest stretch whose False gaps are <= clear_s + 1
    (run() resets its start a tick after the tracker forgets the episode, so one more tick bridges)."""
    best, first, last = 0, None, None
    for tick, holds in enumerate(condition):
        if not holds:
            continue
        if first is None or last is None or tick - last - 1 > clear_s + 1:
            first = tick
        last = tick
        best = max(best, last - first)
    return best


def test_a_condition_that_keeps_breaking_never_fires() -> None:
    # 20 s on, 15 s off (longer than clear_seconds), for an hour: never the 30 s busy_spin needs.
    assert run(([True] * 20 + [False] * 15) * 100) == []
    # The same with 5 s gaps (shorter than clear): the runs bridge into one episode, which fires.
    assert run(([True] * 20 + [False] * 5) * 10)[:1] == [(30, EventKind.FIRED)]
