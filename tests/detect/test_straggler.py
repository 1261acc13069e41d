"""straggler: a GPU whose clocks the hardware holds below its working peers' is named, with the job's
estimated slowdown; a GPU slower for no hardware reason (uneven work, a power cap), an idle one, or too few
GPUs to compare are not."""

from __future__ import annotations

import dataclasses

import pytest

from tests.detect.test_stretches import assert_same
from watchdog.config import Config, parse_config
from watchdog.detect.engine import DetectorEngine
from watchdog.sample import sim
from watchdog.vocabulary.model import (
    CLOCK_EVENT_HW_SLOWDOWN,
    EpisodeEvent,
    EventKind,
    NodeSnapshot,
    Severity,
    Signature,
)

ONSET = 300


def stream_of(clock: float, reasons: int = CLOCK_EVENT_HW_SLOWDOWN, gpus: int = 8, slow: int = 5,
              util: float | None = None, seconds: int = 900) -> list[NodeSnapshot]:
    """8xH100 training; from ONSET GPU `slow` runs at `clock` of its maximum with these clock event reasons."""
    out = []
    scenario = dataclasses.replace(sim.SCENARIOS["healthy"], gpus=gpus, duration_seconds=seconds)
    for snapshot in sim.run(scenario):
        if len(out) >= ONSET:
            snapshot = NodeSnapshot(snapshot.time_seconds, tuple(
                g._replace(sm_clock_hertz=g.sm_clock_max_hertz * clock, clock_event_reasons=reasons,
                           **({"utilization_ratio": util} if util is not None else {}))
                if g.index == slow and g.sm_clock_max_hertz and g.utilization_ratio else g for g in snapshot.gpus))
        out.append(snapshot)
    return out


def stragglers(stream: list[NodeSnapshot], config: Config | None = None) -> list[EpisodeEvent]:
    engine = DetectorEngine(config or Config())
    return [e for s in stream for e in engine.observe(s) if e.signature is Signature.STRAGGLER]


def test_a_gpu_held_down_by_the_hardware_is_named_with_the_slowdown_it_costs() -> None:
    stream = stream_of(0.85)
    fired = stragglers(stream)[0]
    assert fired.event is EventKind.FIRED and fired.severity is Severity.WARNING and fired.gpus == (5,)
    assert fired.at_seconds - stream[ONSET].time_seconds <= 300  # within 5 minutes
    assert "about 1.18x slower" in fired.headline and "1,683 MHz (held down: hw_slowdown)" in fired.summary
    assert "1,980 MHz" in fired.summary


def test_the_sim_scenario_names_its_straggler() -> None:
    events = stragglers(list(sim.run(sim.SCENARIOS["straggler"])))
    assert [(e.event, e.gpus) for e in events] == [(EventKind.FIRED, (5,))]


@pytest.mark.parametrize(("why", "stream"), [
    ("no hardware reason: a power cap or uneven work", lambda: stream_of(0.8, reasons=0x4)),
    ("held down only 5%", lambda: stream_of(0.95)),
    ("two GPUs: no peers to compare", lambda: stream_of(0.7, gpus=2, slow=1)),
    ("the slow GPU is idle, not working", lambda: stream_of(0.5, util=0.0)),
    ("a clock of 0 is no reading", lambda: stream_of(0.0)),
])
def test_not_a_straggler(why: str, stream) -> None:  # type: ignore[no-untyped-def]
    assert stragglers(stream()) == [], why


def test_peers_reading_far_above_their_maximum_are_no_reference() -> None:
    stream = stream_of(1.0, reasons=CLOCK_EVENT_HW_SLOWDOWN)
    stream = [NodeSnapshot(s.time_seconds, tuple(g._replace(sm_clock_hertz=9e14) if g.index != 5 and g.utilization_ratio
                                                 else g for g in s.gpus)) for s in stream]
    assert stragglers(stream) == []


def test_it_ends_when_the_clock_comes_back() -> None:
    stream = stream_of(0.8, seconds=1300)
    stream = stream[:800] + [NodeSnapshot(s.time_seconds, tuple(g._replace(
        sm_clock_hertz=g.sm_clock_max_hertz, clock_event_reasons=0) if g.index == 5 and g.utilization_ratio else g
        for g in s.gpus)) for s in stream[800:]]
    fired, resolved = stragglers(stream)
    assert resolved.event is EventKind.RESOLVED and 800 <= resolved.at_seconds - stream[0].time_seconds <= 1000


def test_its_settings_move_it() -> None:
    config = parse_config({"detectors": {"straggler": {"clock_deficit_ratio": 0.25}}})
    assert stragglers(stream_of(0.85), config) == []
    assert stragglers(stream_of(0.7), config)
    assert stragglers(stream_of(0.85), parse_config({"detectors": {"straggler": {"enabled": False}}})) == []


def test_a_tick_at_a_time_and_stretches_agree() -> None:
    assert_same(Config(), stream_of(0.85, seconds=700))


def signatures_fired(stream: list[NodeSnapshot], config: Config | None = None) -> list[tuple[str, tuple[int, ...]]]:
    engine = DetectorEngine(config or Config())
    return [(e.signature.value, e.gpus) for s in stream for e in engine.observe(s) if e.event is EventKind.FIRED]


def test_one_sick_gpu_among_working_peers_is_one_alert_the_straggler() -> None:
    """Held down by the hardware below its working peers: the straggler warning (with the slowdown it costs the
    job), not a THROTTLED warning first and a STRAGGLER one after it for the same cause."""
    assert signatures_fired(stream_of(0.85)) == [("straggler", (5,))]
    # The odd GPU is left to the straggler rule from its first slow tick, before the window has judged it too.
    assert signatures_fired(stream_of(0.85, seconds=ONSET + 50)) == []


def test_a_throttle_the_straggler_rule_does_not_judge_is_still_a_throttle_warning() -> None:
    # Straggler off: the throttle rule names it as before.
    off = parse_config({"detectors": {"straggler": {"enabled": False}}})
    assert signatures_fired(stream_of(0.85), off) == [("throttle", (5,))]
    # Held down but idle (no working peers' pace to be below), or with too few GPUs to compare.
    assert signatures_fired(stream_of(0.5, util=0.0)) == [("throttle", (5,))]
    assert signatures_fired(stream_of(0.7, gpus=2, slow=1)) == [("throttle", (1,))]
    # Every GPU held down together (a hot room): each its own throttle warning, no straggler among equals.
    stream = [NodeSnapshot(s.time_seconds, tuple(g._replace(
        sm_clock_hertz=g.sm_clock_max_hertz * 0.7, clock_event_reasons=CLOCK_EVENT_HW_SLOWDOWN)
        if n >= ONSET and g.sm_clock_max_hertz and g.utilization_ratio else g for g in s.gpus))
        for n, s in enumerate(stream_of(1.0, reasons=0))]
    assert sorted(signatures_fired(stream)) == [("throttle", (g,)) for g in range(8)]
