"""Every scripted scenario, end to end through the detector engine: what fires, when, and on whom."""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import run_engine
from watchdog.config import Config
from watchdog.sample import sim
from watchdog.vocabulary.model import EpisodeEvent, EventKind, Severity, Signature

START = 1_767_225_600.0


def events_of(name: str, **changes: object) -> list[EpisodeEvent]:
    scenario = dataclasses.replace(sim.SCENARIOS[name], **changes)
    return run_engine(sim.run(scenario, start_seconds=START))


def fired(events: list[EpisodeEvent]) -> list[EpisodeEvent]:
    return [e for e in events if e.event is not EventKind.RESOLVED]


@pytest.mark.parametrize("name", ["healthy", "tp_small_batch"])
def test_healthy_runs_raise_nothing(name: str) -> None:
    assert events_of(name) == []


@pytest.mark.parametrize(("name", "signature", "hang_at", "gpus"), [
    ("spin_hang", Signature.BUSY_SPIN, 300, list(range(8))),
    ("startup_spin", Signature.BUSY_SPIN, 40, list(range(8))),
    ("t4_spin", Signature.BUSY_SPIN, 100, list(range(4))),
])
def test_all_gpu_hangs_are_critical_within_a_minute(name: str, signature: Signature, hang_at: int,
                                                    gpus: list[int]) -> None:
    (event,) = events_of(name)
    assert (event.event, event.signature, event.severity) == (EventKind.FIRED, signature, Severity.CRITICAL)
    assert list(event.gpus) == gpus and event.culprit_gpus == ()
    assert abs(event.onset_seconds - (START + hang_at)) <= 2
    assert event.at_seconds - (START + hang_at) <= 60


def test_zero_util_hang_on_telemetry_alone_warns_within_a_minute_and_pages_within_ten() -> None:
    """No process is visible in a trace, so a pause with memory held could be a checkpoint: a warning at
    once, critical once it outlasts detectors.zero_util.critical_after_seconds."""
    events = events_of("zero_util_hang")
    assert [(e.event, e.signature, e.severity) for e in events] == [
        (EventKind.FIRED, Signature.ZERO_UTIL, Severity.WARNING),
        (EventKind.ESCALATED, Signature.ZERO_UTIL, Severity.CRITICAL)]
    warning, critical = events
    assert warning.at_seconds - (START + 300) <= 60 and critical.at_seconds - (START + 300) <= 600
    assert warning.headline.startswith("PAUSE (warning): GPUs 0-7 idle") and "critical after 9 min" in warning.summary
    assert critical.headline.startswith("HANG (critical): GPUs 0-7 idle")
    assert "plausible" not in critical.summary


def test_checkpoint_wait_warns_names_gpu_0_and_resolves() -> None:
    events = events_of("checkpoint")
    assert [(e.event, e.signature, e.severity) for e in events] == [
        (EventKind.FIRED, Signature.WAITING, Severity.WARNING),
        (EventKind.RESOLVED, Signature.WAITING, Severity.WARNING),
    ]
    assert events[0].culprit_gpus == (0,)
    assert "waiting on GPU 0" in events[0].summary
    assert abs(events[1].at_seconds - (START + 450)) <= 15


def test_odd_rank_is_named_early_and_escalates_after_the_plausible_wait() -> None:
    events = events_of("odd_rank")
    assert [(e.event, e.severity) for e in events] == [(EventKind.FIRED, Severity.WARNING),
                                                       (EventKind.ESCALATED, Severity.CRITICAL)]
    warn, crit = events
    assert warn.culprit_gpus == (4,) and warn.at_seconds - (START + 300) <= 60
    assert abs(crit.at_seconds - (START + 300 + 540)) <= 3  # waiting.critical_after_seconds
    assert crit.headline.startswith("HANG (critical): GPUs 0-3, 5-7 wait on GPU 4")
    assert "longer than a checkpoint or evaluation should take" in crit.summary and "plausible" not in crit.summary
    assert warn.headline.startswith("WAITING (warning): GPUs 0-3, 5-7 wait on GPU 4")


def test_shorter_critical_after_escalates_sooner() -> None:
    scenario = sim.SCENARIOS["odd_rank"]
    from watchdog.config import parse_config

    config = parse_config({"detectors": {"waiting": {"critical_after_seconds": 120}}})
    events = run_engine(sim.run(scenario, start_seconds=START), config)
    escalated = [e for e in events if e.event is EventKind.ESCALATED]
    assert escalated and abs(escalated[0].at_seconds - (START + 420)) <= 3


def test_underuse_is_one_warning_for_the_job() -> None:
    (event,) = events_of("underuse")
    assert (event.signature, event.severity, event.gpus) == (Signature.UNDERUSE, Severity.WARNING, tuple(range(8)))
    assert "35% mean util" in event.summary


def test_throttle_warns_once_as_the_jobs_straggler_and_is_never_a_spin() -> None:
    """GPU 2 held at 60% of its clock while the others train: the job's straggler (1.67x), one warning for one
    cause (a THROTTLED warning beside it would be a second alert for the same GPU)."""
    events = events_of("throttle")
    assert [(e.event.value, e.signature.value, e.gpus) for e in events] == [
        ("fired", "straggler", (2,)), ("resolved", "straggler", (2,))]
    assert "hw_thermal_slowdown" in events[0].summary
    (straggler,) = [e for e in events if e.signature is Signature.STRAGGLER and e.event is EventKind.FIRED]
    assert "about 1.67x slower" in straggler.headline


def test_lost_gpu_is_critical_once_it_stays_lost_and_the_others_spin_on_without_it() -> None:
    events = fired(events_of("gpu_lost"))
    lost = [e for e in events if e.signature is Signature.GPU_LOST]
    spin = [e for e in events if e.signature is Signature.BUSY_SPIN]
    assert lost[0].gpus == (5,) and lost[0].severity is Severity.CRITICAL
    assert lost[0].at_seconds == START + 300 + Config().detectors.gpu_lost.for_seconds
    assert spin[0].gpus == (0, 1, 2, 3, 4, 6, 7) and spin[0].severity is Severity.CRITICAL  # not a wait on GPU 5


def test_a_lost_gpu_that_comes_back_resolves() -> None:
    scenario = dataclasses.replace(
        sim.SCENARIOS["gpu_lost"], timeline=sim.SCENARIOS["healthy"].timeline + ((300, (5,), "lost"),
                                                                                 (320, (5,), "train")))
    events = run_engine(sim.run(scenario, start_seconds=START))
    assert [(e.event, e.signature) for e in events] == [(EventKind.FIRED, Signature.GPU_LOST),
                                                        (EventKind.RESOLVED, Signature.GPU_LOST)]


def test_disabled_detector_stays_silent() -> None:
    from watchdog.config import parse_config

    config = parse_config({"detectors": {"busy_spin": {"enabled": False}}})
    assert run_engine(sim.run(sim.SCENARIOS["spin_hang"], start_seconds=START), config) == []


def test_a_hang_that_ends_resolves_once_the_relapse_hold_has_passed() -> None:
    """Training again at 500 s: the critical episode is held job.relapse_seconds for a relapse, then
    resolved once; its text gives the hang's length up to the recovery."""
    scenario = dataclasses.replace(sim.SCENARIOS["spin_hang"], duration_seconds=1500,
                                   timeline=sim.SCENARIOS["spin_hang"].timeline + ((500, None, "train"),))
    events = run_engine(sim.run(scenario, start_seconds=START))
    assert [e.event for e in events] == [EventKind.FIRED, EventKind.RESOLVED]
    assert abs(events[1].at_seconds - (START + 500 + 600)) <= 15
    assert "for 3 min" in events[1].headline  # spinning from 300 s to 500 s
