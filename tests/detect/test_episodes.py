"""The episode machine: ok -> suspect -> stalled -> resolved, with hysteresis."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from watchdog.config import Config, EpisodeTiming, JobConfig, WaitingConfig
from watchdog.detect.episodes import EpisodeTracker
from watchdog.vocabulary.model import EventKind, Finding, Severity, Signature, Verdict

TIMING = {sig: getattr(Config().detectors, sig.value) for sig in Signature}


def spin(since: float) -> Finding:
    return Finding(Signature.BUSY_SPIN, Severity.CRITICAL, (0, 1), since=since)


NO_HOLD = Config(job=JobConfig(relapse_seconds=0))


def run(condition: list[bool], timing: dict | None = None, finding=spin, config: Config = NO_HOLD,  # noqa: ANN001
        recovered: list[bool] | None = None) -> list[tuple[int, EventKind]]:
    """One tick per second; the condition holds where True. Where it does not, the GPUs show recovery
    (work resumed) unless `recovered` says otherwise for that tick. Returns (tick, event kind)."""
    tracker = EpisodeTracker(timing or TIMING, config)
    out = []
    start = None
    for tick, holds in enumerate(condition):
        if holds and start is None:
            start = tick
        if not holds:
            start = None if tracker.episodes == {} else start
        findings = [finding(float(start if start is not None else tick))] if holds else []
        back = recovered[tick] if recovered is not None else True
        events = tracker.update(float(tick), findings, lambda gpus, back=back: back)
        out += [(tick, e.event) for e in events if e.event is not EventKind.SUSPECTED]
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


def test_a_waiting_verdict_dated_back_by_its_window_fires_only_once_seen_for_a_while() -> None:
    tracker = EpisodeTracker(TIMING)
    at_work = dataclasses.replace(waiting(since=70.0), culprits_busy=True)
    tracker.update(100.0, [at_work])
    # 30 s held by its window at 100 s, but seen on the ticks for 15 s only at 115 s.
    assert tracker.update(110.0, [at_work]) == []
    (event,) = tracker.update(115.0, [at_work])
    assert event.event is EventKind.FIRED and event.onset_seconds == 70.0
    # A wait on an idle GPU is no spinner slow to show it: it fires on its window's word.
    tracker = EpisodeTracker(TIMING)
    assert [e.event for e in tracker.update(100.0, [waiting(since=70.0)])] == [EventKind.SUSPECTED, EventKind.FIRED]


def test_a_short_gap_neither_resolves_nor_restarts() -> None:
    events = run([True] * 40 + [False] * 5 + [True] * 40 + [False] * 20)
    assert events == [(30, EventKind.FIRED), (95, EventKind.RESOLVED)]


def waiting(since: float) -> Finding:
    return Finding(Signature.WAITING, Severity.WARNING, (0, 1), since=since, culprit_gpus=(1,))


def zero(since: float) -> Finding:
    return Finding(Signature.ZERO_UTIL, Severity.CRITICAL, (0, 1), since=since)


def test_a_brief_lapse_neither_ends_a_stall_nor_restarts_its_clock() -> None:
    timing = dict(TIMING)
    timing[Signature.WAITING] = WaitingConfig(for_seconds=10, clear_seconds=10, critical_after_seconds=60)
    # One tick without the condition (a blip, a dropped sample) every 20 s: the clock runs on.
    broken = run(([True] * 20 + [False]) * 5, timing, waiting)
    assert broken == [(10, EventKind.FIRED), (60, EventKind.ESCALATED)]
    # A hundred ticks without it, the GPUs showing no recovery: still the same stall, whose clock ran on, so
    # it escalates as soon as the condition is seen again (a restarted clock would wait until tick 190).
    lapsed = [True] * 30 + [False] * 100 + [True] * 50
    assert run(lapsed, timing, waiting, recovered=[False] * 180) == [(10, EventKind.FIRED), (130, EventKind.ESCALATED)]


def test_a_lapse_with_recovery_evidence_ends_the_episode() -> None:
    events = run([True] * 60 + [False] * 30, finding=zero, recovered=[False] * 70 + [True] * 20)
    # Ten ticks absent without evidence, then clear_seconds of recovery from tick 70.
    assert (80, EventKind.RESOLVED) in events


def test_a_critical_stall_that_relapses_within_the_hold_is_one_episode() -> None:
    config = Config()  # relapse_seconds 600
    tracker = EpisodeTracker(TIMING, config)
    events = []
    for tick in range(1500):
        holds = tick < 120 or 300 <= tick < 420  # a hang, five minutes of work, the same hang again
        findings = [spin(0.0 if tick < 120 else 300.0)] if holds else []
        events += tracker.update(float(tick), findings, lambda gpus: True)
    alerted = [e for e in events if e.event in (EventKind.FIRED, EventKind.ESCALATED)]
    resolved = [e for e in events if e.event is EventKind.RESOLVED]
    relapsed = [e for e in events if e.event is EventKind.RELAPSED]
    assert len(alerted) == 1 and len(resolved) == 1, [(e.event, e.at_seconds) for e in events]
    assert resolved[0].key == alerted[0].key == relapsed[0].key and len(relapsed) == 1
    assert relapsed[0].at_seconds == 300.0 and "doing no work;" in relapsed[0].summary  # the new stall's own
    # clock: begun now, so no duration is said ("for 0 s" would say nothing true)
    # Resolved once the hold has passed after the second stall's recovery (420 + 10 s of work + 600).
    assert resolved[0].at_seconds == 1030.0


def test_a_stall_that_changes_signature_is_the_same_episode() -> None:
    tracker = EpisodeTracker(TIMING, NO_HOLD)
    keys = set()
    for tick in range(200):
        finding = zero(0.0) if tick < 100 else waiting(100.0)
        keys |= {e.key for e in tracker.update(float(tick), [finding], lambda gpus: False)}
    assert len(keys) == 1 and list(tracker.episodes) == ["waiting"]


def test_a_warning_resolves_on_recovery_without_the_hold() -> None:
    events = run([True] * 60 + [False] * 30, finding=waiting, config=Config())
    assert events == [(30, EventKind.FIRED), (70, EventKind.RESOLVED)]


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


def test_a_restart_boundary_ends_the_old_incarnations_stall_and_forgets_its_pauses() -> None:
    """Every process on the stalled GPUs replaced (a restarted job): the hung incarnation's episode is
    resolved there, and a stall of the new one is a new episode on its own clock."""
    import random

    from watchdog.detect.engine import DetectorEngine
    from watchdog.sample import sim

    scenario = sim.SCENARIOS["spin_hang"]
    engine = DetectorEngine(Config())
    rng = random.Random(1)
    old = {g: [100 + g] for g in range(8)}
    events = []
    for t in range(250, 400):
        events += engine.observe(sim.snapshot_at(scenario, t, rng, 1.9e9 + t, old))
    fired = [e for e in events if e.event is EventKind.FIRED]
    assert fired and fired[0].severity is Severity.CRITICAL
    engine.tracker.pauses.record(1.9e9, 60.0)
    assert engine.tracker.pauses.longest == 60.0
    # The ranks are gone for a few samples, then new ones hold the GPUs.
    gap = [e for t in range(400, 405) for e in engine.observe(sim.snapshot_at(scenario, t, rng, 1.9e9 + t, {}))]
    assert not [e for e in gap if e.event is EventKind.RESOLVED]  # no process is no restart yet
    new = {g: [200 + g] for g in range(8)}
    after = engine.observe(sim.snapshot_at(scenario, 405, rng, 1.9e9 + 405, new))
    assert [e.event for e in after][:1] == [EventKind.RESOLVED] and after[0].key == fired[0].key
    assert engine.tracker.pauses.longest is None
    later = [e for t in range(406, 480) for e in engine.observe(sim.snapshot_at(scenario, t, rng, 1.9e9 + t, new))]
    refired = [e for e in later if e.event is EventKind.FIRED]
    assert refired and refired[0].key != fired[0].key and refired[0].onset_seconds >= 1.9e9 + 405


def test_an_early_spin_is_suspected_at_once_and_never_alerted_on_telemetry_alone() -> None:
    """A spin seen on its newest samples only (busy_spin's early evidence) is suspected for its stacks to be
    looked at; without stacks that confirm it, the tracker decides on the windows' findings alone, as if
    the early ones were not there: the same episode, the same clock."""
    tracker = EpisodeTracker(TIMING)
    early = dataclasses.replace(spin(since=100.0), early=True)
    (suspected,) = tracker.update(108.0, [early])
    assert suspected.event is EventKind.SUSPECTED and suspected.key == "busy_spin@100"
    assert [e for t in range(109, 140) for e in tracker.update(float(t), [early])] == []  # past for_seconds
    assert tracker.episodes == {}
    (fired,) = tracker.update(140.0, [spin(since=100.0)])  # taken over, not suspected again; dated from 100
    assert fired.event is EventKind.FIRED and fired.key == suspected.key and fired.onset_seconds == 100.0


def test_early_findings_do_not_keep_an_episode_open() -> None:
    """A fired episode whose windows no longer show it ends as it would with no finding at all."""
    ends = []
    for later in ([], [dataclasses.replace(spin(since=140.0), early=True)]):
        tracker = EpisodeTracker(TIMING, NO_HOLD)
        fired = [e for t in range(100, 140) for e in tracker.update(float(t), [spin(since=100.0)])]
        assert [e.event for e in fired] == [EventKind.SUSPECTED, EventKind.FIRED]
        ends.append([(e.at_seconds, e.event) for t in range(140, 170)
                     for e in tracker.update(float(t), later, lambda gpus: True) if e.key == fired[0].key])
    assert ends[0] == ends[1] and [event for _, event in ends[0]] == [EventKind.RESOLVED]


def test_a_hang_confirmed_by_two_looks_fires_critical_before_for_seconds() -> None:
    tracker = EpisodeTracker(TIMING)
    early = dataclasses.replace(spin(since=100.0), early=True)
    (suspected,) = tracker.update(108.0, [early])
    seen_once = Verdict("hang", Severity.CRITICAL, "every rank in all_reduce", "8 ranks wait in all_reduce")
    assert tracker.note_stacks(suspected.key, seen_once)
    assert tracker.update(110.0, [early]) == []  # one look is not enough before for_seconds
    assert tracker.note_stacks(suspected.key, dataclasses.replace(seen_once, confirmed=True))
    assert tracker.update(113.0, [early]) == []  # confirmed, but the stall is 13 s old: a slow loader could be
    (fired,) = tracker.update(115.0, [early])  # stacks.confirm_min_seconds
    assert fired.event is EventKind.FIRED and fired.severity is Severity.CRITICAL and fired.key == suspected.key
    assert "twice, with nothing moving between" in fired.summary


def test_a_confirmed_wait_on_a_blocked_rank_fires_critical_at_once() -> None:
    tracker = EpisodeTracker(TIMING)
    (suspected,) = tracker.update(109.0, [waiting(since=100.0)])
    tracker.note_stacks(suspected.key, Verdict("hang", Severity.CRITICAL, "rank 4 in Queue.get", "rank 4 is stuck",
                                               confirmed=True))
    assert tracker.update(114.0, [waiting(since=100.0)]) == []
    (fired,) = tracker.update(115.0, [waiting(since=100.0)])
    assert fired.event is EventKind.FIRED and fired.severity is Severity.CRITICAL


CONFIRMED = Verdict("hang", Severity.CRITICAL, "every rank in all_reduce", "8 ranks wait in all_reduce", confirmed=True)


def test_a_confirmation_ends_with_the_stall_it_was_of() -> None:
    """After recovery, an early finding within the relapse hold is not a relapse on the old confirmation."""
    tracker = EpisodeTracker(TIMING)
    (suspected,) = tracker.update(108.0, [dataclasses.replace(spin(since=100.0), early=True)])
    tracker.note_stacks(suspected.key, CONFIRMED)
    events = [e for t in range(109, 130) for e in tracker.update(float(t), [spin(since=100.0)])]
    assert [e.event for e in events] == [EventKind.FIRED]
    events = [e for t in range(130, 150) for e in tracker.update(float(t), [], lambda gpus: True)]
    assert events == []  # recovered, held for a relapse
    early = dataclasses.replace(spin(since=150.0), early=True)
    assert [e for t in range(150, 170) for e in tracker.update(float(t), [early], lambda gpus: False)] == []


def test_an_early_finding_on_the_gpus_of_an_open_stall_is_that_stall() -> None:
    tracker = EpisodeTracker(TIMING)
    assert [e.event for t in range(100, 135) for e in tracker.update(float(t), [waiting(since=100.0)])] == [
        EventKind.SUSPECTED, EventKind.FIRED]
    early = dataclasses.replace(spin(since=135.0), early=True)
    assert [e for t in range(135, 150) for e in tracker.update(float(t), [waiting(since=100.0), early])] == []


def test_an_early_suspicion_taken_over_keeps_its_identity_and_stacks() -> None:
    """The windows date the stall later than the early look did: still one identity, and the confirmation
    noted under it counts."""
    tracker = EpisodeTracker(TIMING)
    (suspected,) = tracker.update(108.0, [dataclasses.replace(spin(since=100.0), early=True)])
    assert tracker.update(110.0, [spin(since=103.0)]) == []
    assert tracker.note_stacks(suspected.key, CONFIRMED)
    (fired,) = tracker.update(118.0, [spin(since=103.0)])
    assert fired.key == suspected.key and fired.severity is Severity.CRITICAL
