"""busy_spin's legs and vetoes, one reading pattern per row."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import numpy as np
import pytest

from tests.detect.judge import fresh_frames, judged, newest, stretch_of
from watchdog.config import Config
from watchdog.detect import busy_spin
from watchdog.detect.evidence import Evidence
from watchdog.detect.frames import Ticks
from watchdog.detect.stretch import Cells, Context
from watchdog.vocabulary.model import CLOCK_EVENT_HW_THERMAL, GpuSample, NodeSnapshot

if TYPE_CHECKING:
    from tests.traces.corpus import Trace

CFG = Config().detectors.busy_spin
H100 = {"power_limit_watts": 700.0, "sm_clock_max_hertz": 1.98e9, "memory_used_bytes": 40 * 2**30}


def spin(history: list[dict], now: list[dict]) -> Evidence | None:
    """busy_spin's evidence on the newest of these readings, one a second."""
    return judged(busy_spin.detect, history + now, CFG, base=H100)


# Readings as an nvidia-smi log has them (no memory-controller or SM activity columns) ...
SPIN = {"utilization_ratio": 1.0, "power_watts": 150.0, "sm_clock_hertz": 1.98e9}
BUSY = {"utilization_ratio": 0.98, "power_watts": 560.0}
IDLE = {"utilization_ratio": 0.0, "power_watts": 72.0}
# ... and as live NVML has them.
LIVE_SPIN = {**SPIN, "memory_utilization_ratio": 0.0, "sm_activity_ratio": 0.01}
LIVE_IDLE = {**IDLE, "memory_utilization_ratio": 0.0, "sm_activity_ratio": 0.0}


@pytest.mark.parametrize(("history", "now", "legs"), [
    # spinning after real work: every power leg
    ([BUSY] * 60, [SPIN] * 20, {"power_near_idle", "power_below_busy", "power_flat"}),
    # no history at all (hangs before its first step): idle assumed from the power limit
    ([], [SPIN] * 20, {"power_near_idle", "power_flat"}),
    # live NVML adds memory and SM activity legs
    ([LIVE_IDLE] * 10, [LIVE_SPIN] * 20, {"power_near_idle", "power_flat", "memory_idle", "sm_activity_low"}),
    # brief bursts of real work inside the spin do not hide it (median, not mean); the bursts teach a
    # busy level, so power_below_busy joins in
    ([IDLE] * 10, ([SPIN] * 9 + [{**SPIN, "power_watts": 400.0}]) * 2,
     {"power_near_idle", "power_below_busy", "power_flat"}),
])
def test_spin_fires_with_its_legs(history: list[dict], now: list[dict], legs: set[str]) -> None:
    evidence = spin(history, now)
    assert evidence is not None and set(evidence.legs) == legs


@pytest.mark.parametrize(("history", "now", "why"), [
    ([BUSY] * 60, [BUSY] * 20, "real work"),
    ([IDLE] * 10, [{**SPIN, "utilization_ratio": 0.97}] * 20, "never pinned at 100%"),
    ([LIVE_IDLE] * 10, [{**LIVE_SPIN, "memory_utilization_ratio": 0.3}] * 20, "memory controller busy"),
    ([LIVE_IDLE] * 10, [{**LIVE_SPIN, "sm_activity_ratio": 0.6}] * 20, "SMs busy"),
    ([IDLE] * 10, [{**SPIN, "clock_event_reasons": CLOCK_EVENT_HW_THERMAL}] * 20, "thermal slowdown"),
    ([IDLE] * 10, [{**SPIN, "sm_clock_hertz": 0.6e9}] * 20, "clocks pulled down"),
    ([IDLE] * 10, [{**SPIN, "power_watts": 400.0}] * 20, "power well above idle"),
    # near idle, but swinging (140-170 W): one leg only
    ([IDLE] * 10, [{"utilization_ratio": 1.0, "power_watts": p} for p in (140.0, 170.0) * 10], "power not flat"),
    ([], [SPIN] * 2, "too few samples"),
])
def test_no_spin(history: list[dict], now: list[dict], why: str) -> None:
    assert spin(history, now) is None, why


def test_power_flat_alone_is_not_evidence() -> None:
    """A steady compute-bound kernel is flat too: flatness needs a leg that says 'no work'."""
    steady = [{"utilization_ratio": 1.0, "power_watts": 300.0}] * 20
    assert spin([IDLE] * 10, steady) is None


def test_onset_ignores_the_samples_before_the_spin() -> None:
    """Dated halfway between the last sample without the spin and the first with it (it began between them)."""
    evidence = spin([], [IDLE] * 8 + [SPIN] * 18)
    assert evidence is not None and evidence.since == 7.5


def _reading(rng: random.Random, spinning: bool) -> dict:
    """A spin's readings (with the odd [N/A] and blip), or anything at all."""
    if spinning:
        return {"utilization_ratio": None if rng.random() < 0.05 else 1.0,
                "power_watts": None if rng.random() < 0.05 else round(rng.uniform(140, 160)),
                "memory_utilization_ratio": rng.choice([None, 0.0, 0.0, 0.0, 0.02]),
                "sm_activity_ratio": rng.choice([None, 0.01, 0.02]),
                "clock_event_reasons": rng.choice([None, 0, 0, 0x1])}
    return {"utilization_ratio": rng.choice([None, 0.0, 0.4, 0.97, 1.0]),
            "power_watts": None if rng.random() < 0.05 else round(rng.uniform(60, 600)),
            "memory_utilization_ratio": rng.choice([None, 0.0, 0.02, 0.3]),
            "sm_activity_ratio": rng.choice([None, None, 0.01, 0.5]),
            "clock_event_reasons": rng.choice([None, 0, 0x1, CLOCK_EVENT_HW_THERMAL])}


@pytest.mark.parametrize("seed", range(6))
def test_a_stretch_at_once_gives_each_tick_the_evidence_it_gets_on_its_own(seed: int) -> None:
    """The rule over every tick of a stretch at once (a replay) and over each newest tick as it comes (the
    daemon), through gaps, [N/A]s, throttling, a sampling interval that changes and clock steps back."""
    rng = random.Random(seed)
    t, samples = 0.0, []
    for n in range(300):
        t += rng.choice([1.0, 1.0, 1.0, 0.5, 5.0]) if rng.random() > 0.01 else -3.0
        reading = _reading(rng, (n // 40) % 2 == 1)
        samples.append((t, GpuSample(index=0, **{**H100, **reading}, pids=(7,) if rng.random() < 0.9 else ())))
    whole = stretch_of(samples)
    every = np.arange(len(whole))
    at_once = busy_spin.detect(Cells(whole, every, np.zeros(len(whole), int), every), CFG, CTX)
    frames, found = fresh_frames(), 0
    for n, (t, sample) in enumerate(samples):
        stretch, _ = frames.add(Ticks.of_snapshots([NodeSnapshot(t, (sample,))]))
        alone, together = busy_spin.detect(newest(stretch), CFG, CTX).get(0), at_once.get(n)
        assert (alone is None) == (together is None), n
        if alone is not None and together is not None:  # the busy level's average, summed in another order
            assert (alone.legs, alone.since, alone.weak, alone.early) == (
                together.legs, together.since, together.weak, together.early), n
            assert alone.facts == pytest.approx(together.facts, rel=1e-12), n
            found += 1
    assert found > 20


CTX = Context(20.0, 2**30)
RANK = {"pids": (4242,)}  # a process on the GPU: its stacks can be looked at
LIVE_BUSY = {**BUSY, "memory_utilization_ratio": 0.45, "sm_activity_ratio": 0.8, **RANK}


@pytest.mark.parametrize(("spun", "early"), [(5, None), (7, None), (8, True), (12, True), (20, False)])
def test_a_spin_on_its_newest_samples_is_early_evidence(spun: int, early: bool | None) -> None:
    """Live, the work before a spin keeps the window's memory traffic and SM activity up (vetoes) until the
    spin fills most of it; its newest samples alone, all pinned, are early evidence, dated halfway between the
    spin's first sample and the one before."""
    evidence = spin([LIVE_BUSY] * 60, [{**LIVE_SPIN, **RANK}] * spun)
    if early is None:
        assert evidence is None
        return
    assert evidence is not None and evidence.early is early
    assert evidence.since == 59.5


def test_no_early_evidence_while_the_newest_samples_still_work_or_without_processes() -> None:
    assert spin([LIVE_BUSY] * 60, [{**LIVE_SPIN, **RANK}] * 11 + [LIVE_BUSY]) is None
    assert spin([LIVE_BUSY] * 60, [LIVE_SPIN] * 12) is None  # a log: no stacks to see


@pytest.mark.parametrize("interval", [1.0, 5.0])
def test_a_spin_that_draws_more_than_its_idle_multiple_does_not_teach_the_busy_level(interval: float) -> None:
    """An RTX A6000-class card spins at about 165 W of the 260 W its work draws, past 2.5x the power it held at
    start-up: at 100% util the spin passes for work at first. The busy level keeps what the work drew (its slow
    average), so power_fell holds and the spin is critical within a minute; when the level followed the spin
    down within a minute, power_fell lapsed and this spin (a log with only util, power and memory used) was
    never critical."""
    from tests.traces.corpus import Trace, snapshots
    from watchdog.detect.engine import DetectorEngine
    from watchdog.vocabulary.model import EventKind, Severity

    trace = Trace("a6000", "hang_spin", "a6000", "minimal", interval, 2700, 1004, 8)
    trace.segments = [(0.0, None, "startup"), (100.0, None, "train"), (1800.0, None, "spin")]
    events = DetectorEngine(Config()).observe(list(snapshots(trace, start=0.0)))
    critical = [e.at_seconds for e in events if e.severity is Severity.CRITICAL
                and e.event in (EventKind.FIRED, EventKind.ESCALATED)]
    assert critical and 1800 <= critical[0] <= 1860, critical


def _first_critical(trace: Trace) -> float | None:
    from tests.traces.corpus import snapshots
    from watchdog.detect.engine import DetectorEngine
    from watchdog.vocabulary.model import EventKind, Severity

    events = DetectorEngine(Config()).observe(list(snapshots(trace, start=0.0)))
    return next((e.at_seconds for e in events if e.severity is Severity.CRITICAL
                 and e.event in (EventKind.FIRED, EventKind.ESCALATED)), None)


@pytest.mark.parametrize(("cls", "seed"), [("hang_spin", 0), ("hang_spin", 1), ("hang_spin_low_range", 0)])
def test_a_spin_sampled_every_10_s_is_critical_within_45_s(cls: str, seed: int) -> None:
    """nvidia-smi -l 10: the spin is first seen up to 10 s after it began, and a 40-s window of five samples
    still holds the one taken at work just before it. That one sample vetoed the spin (memory traffic seen)
    until the window had passed it, and the spin's time was counted from its first sample: these were critical
    49, 46 and 47 s after the spin began. Now one sample at a window's edge does not veto, and the spin is
    dated halfway back to the sample before it."""
    from tests.traces.corpus import on_card

    trace = on_card(cls, seed, "h100", 10.0, "standard", {})
    critical = _first_critical(trace)
    assert trace.hang_at is not None and critical is not None
    assert trace.hang_at <= critical <= trace.hang_at + 45, critical - trace.hang_at


@pytest.mark.parametrize(("interval", "within"), [(20.0, 75.0), (30.0, 105.0), (60.0, 200.0)])
def test_a_spin_sampled_every_20_s_or_more_is_found(interval: float, within: float) -> None:
    """Sampled every 25 s or more, busy_spin's 40-s window held one or two samples, fewer than a window needs:
    no spin was ever found (at 20 s, found or not by the jitter: 99 s). The window now always holds three
    samples, half an interval to spare; at 15 s and faster it is the same window as before."""
    from tests.traces.corpus import Trace

    trace = Trace("h100", "hang_spin", "h100", "standard", interval, 3600, 1004, 8)
    began = 1800.5
    trace.segments = [(0.0, None, "startup"), (100.0, None, "train"), (began, None, "spin")]
    critical = _first_critical(trace)
    assert critical is not None and began <= critical <= began + within, critical


def test_the_busy_level_rises_within_a_minute_and_falls_over_many() -> None:
    """The busy level follows work that draws more within a minute, and work that draws less over about ten
    (a spin's minutes do not teach it; a job whose steps became lighter does, in time)."""
    from watchdog.detect.engine import DetectorEngine

    def level(powers: list[float]) -> list[float]:
        engine = DetectorEngine(Config())
        stream = [NodeSnapshot(float(t), (GpuSample(0, utilization_ratio=0.98, power_watts=p, power_limit_watts=700.0,
                                                    memory_used_bytes=40 * 2**30),)) for t, p in enumerate(powers)]
        engine.observe(stream)
        assert engine.frames.stretch is not None
        return float(engine.frames.stretch.level("busy")[-1, 0])

    assert level([300.0] * 600 + [600.0] * 60) >= 300.0 + 0.65 * 300.0
    assert level([300.0] * 600 + [600.0] * 600) == pytest.approx(600.0, rel=0.01)
    assert level([600.0] * 600 + [300.0] * 60) >= 0.9 * 600.0  # a minute of lighter work (or a spin): it holds
    assert level([600.0] * 600 + [300.0] * 2400) == pytest.approx(300.0, rel=0.05)  # 40 minutes: the new work's


@pytest.mark.parametrize(("interval", "seed"), [(1.0, 1009), (5.0, 1005), (10.0, 1006)])
def test_work_below_the_idle_multiple_is_learnt_and_a_spin_after_it_still_found(interval: float, seed: int) -> None:
    """A T4 logged with util, power and memory used (no power limit) holds 27 W with a context and trains at
    52-64 W: less than 2.5x that idle, so its work was never learnt as work, and training read as a spin
    (power_near_idle, and flat within the sensor's noise): half an hour of healthy training paged critical. The
    work is now learnt from samples near the level learnt so far that show gaps in utilization (a spin reads
    100% every sample); a spin after it (41 W) is critical within a minute all the same, and nothing before."""
    from tests.traces.corpus import Trace

    trace = Trace("t4", "hang_spin", "t4", "minimal", interval, 3600, seed, 8)
    trace.segments = [(0.0, None, "startup"), (120.0, None, "train"), (2400.0, None, "spin")]
    critical = _first_critical(trace)
    assert critical is not None and 2400 <= critical <= 2460, critical


@pytest.mark.parametrize(("interval", "seed"), [(2.0, 1010), (5.0, 1013), (10.0, 1010)])
def test_healthy_training_below_the_idle_multiple_is_not_a_spin(interval: float, seed: int) -> None:
    """The same T4 training 10% lighter (52-60 W, 2.0-2.2x its idle) for an hour: no critical (it paged within
    minutes while its work was never learnt)."""
    from tests.traces.corpus import Trace

    trace = Trace("t4", "healthy_train", "t4", "minimal", interval, 3600, seed, 8, power={"busy": 57.6})
    trace.segments = [(0.0, None, "startup"), (120.0, None, "train")]
    assert _first_critical(trace) is None


def test_a_job_that_spins_from_its_start_does_not_teach_its_spin_as_work() -> None:
    """The gaps in utilization that let low power teach a first busy level never come from a spin: a T4 job that
    spins from its first step (every sample at 100%) is critical within a minute, as before."""
    from tests.traces.corpus import Trace

    trace = Trace("t4", "hang_spin_startup", "t4", "minimal", 5.0, 1800, 1007, 8)
    trace.segments = [(0.0, None, "startup"), (150.0, None, "spin")]
    critical = _first_critical(trace)
    assert critical is not None and 150 <= critical <= 210, critical
