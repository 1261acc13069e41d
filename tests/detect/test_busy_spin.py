"""busy_spin's legs and vetoes, one reading pattern per row."""

from __future__ import annotations

import random

import pytest

from watchdog.config import Config
from watchdog.detect import busy_spin
from watchdog.detect.window import GpuRun, GpuWindow
from watchdog.model import CLOCK_EVENT_HW_THERMAL, GpuSample

CFG = Config().detectors.busy_spin
H100 = {"power_limit_watts": 700.0, "sm_clock_max_hertz": 1.98e9, "memory_used_bytes": 40 * 2**30}


def window(history: list[dict], now: list[dict]) -> GpuWindow:
    w = GpuWindow(0, 30, 600, CFG.idle_power_max_multiple, CFG.default_idle_power_ratio)
    t = 0.0
    for fields in history + now:
        w.add(t, GpuSample(index=0, **{**H100, **fields}))
        t += 1.0
    return w


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
    evidence = busy_spin.evaluate(window(history, now), CFG)
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
    assert busy_spin.evaluate(window(history, now), CFG) is None, why


def test_power_flat_alone_is_not_evidence() -> None:
    """A steady compute-bound kernel is flat too: flatness needs a leg that says 'no work'."""
    steady = [{"utilization_ratio": 1.0, "power_watts": 300.0}] * 20
    assert busy_spin.evaluate(window([IDLE] * 10, steady), CFG) is None


def test_onset_ignores_the_samples_before_the_spin() -> None:
    evidence = busy_spin.evaluate(window([], [IDLE] * 8 + [SPIN] * 18), CFG)
    assert evidence is not None and evidence.since == 8.0


def _reading(rng: random.Random) -> dict:
    spin = rng.random() < 0.7
    return {
        "utilization_ratio": None if rng.random() < 0.05 else (1.0 if spin else rng.choice([0.0, 0.4, 0.97])),
        "power_watts": None if rng.random() < 0.05 else round(rng.uniform(140, 160) if spin else rng.uniform(60, 600)),
        "memory_utilization_ratio": rng.choice([None, 0.0, 0.0, 0.02, 0.3]),
        "sm_activity_ratio": rng.choice([None, None, 0.01, 0.02, 0.5]),
        "clock_event_reasons": rng.choice([None, 0, 0, 0x1, CLOCK_EVENT_HW_THERMAL]),
    }


@pytest.mark.parametrize("seed", range(12))
def test_the_sliding_window_readings_are_those_of_the_window(seed: int) -> None:
    """busy_spin keeps its window's readings sorted as the window slides (_Readings): at every tick,
    through gaps, throttling, a sampling interval that changes, clock steps back and stretches taken
    in bulk, they equal the sorted readings of the window, and every verdict equals the one reached
    from readings gathered afresh."""
    rng = random.Random(seed)
    w = GpuWindow(0, 30, 600, CFG.idle_power_max_multiple, CFG.default_idle_power_ratio)
    t, compared = 0.0, 0
    for _ in range(600):
        if rng.random() < 0.02:  # a stretch ingested in bulk
            times = [t + 1.0 + n for n in range(rng.randint(2, 60))]
            w.extend(GpuRun(times, [GpuSample(index=0, **{**H100, **_reading(rng)}) for _ in times]))
            t = times[-1]
        t += rng.choice([1.0, 1.0, 1.0, 0.5, 5.0]) if rng.random() > 0.01 else -3.0
        w.add(t, GpuSample(index=0, **{**H100, **_reading(rng)}))
        slid = (busy_spin.evaluate(w, CFG), busy_spin.pinned(w, CFG))
        count = w.recent_count(busy_spin._span(w, CFG.window_seconds))
        readings = w.memo.get("busy_spin")
        if readings is not None and readings.end == w.added and count >= 3:
            window = [s for _, s in w.recent(busy_spin._span(w, CFG.window_seconds))]
            for name, field in (("utils", "utilization_ratio"), ("memory", "memory_utilization_ratio"),
                                ("power", "power_watts")):
                assert getattr(readings, name) == sorted(v for s in window if (v := getattr(s, field)) is not None)
            assert list(readings.activity) == [s.sm_activity_ratio for s in window if s.sm_activity_ratio is not None]
            compared += 1
        w.memo.clear()
        assert (busy_spin.evaluate(w, CFG), busy_spin.pinned(w, CFG)) == slid
    assert compared > 300


RANK = {"pids": (4242,)}  # a process on the GPU: its stacks can be looked at
LIVE_BUSY = {**BUSY, "memory_utilization_ratio": 0.45, "sm_activity_ratio": 0.8, **RANK}


@pytest.mark.parametrize(("spun", "early"), [(5, None), (7, None), (8, True), (12, True), (20, False)])
def test_a_spin_on_its_newest_samples_is_early_evidence(spun: int, early: bool | None) -> None:
    """Live, the work before a spin keeps the window's memory traffic and SM activity up (vetoes) until the
    spin fills most of it; its newest samples alone, all pinned, are early evidence, dated from the spin's
    first sample."""
    w = window([LIVE_BUSY] * 60, [{**LIVE_SPIN, **RANK}] * spun)
    evidence = busy_spin.evaluate(w, CFG)
    if early is None:
        assert evidence is None
        return
    assert evidence is not None and evidence.early is early
    assert evidence.since == 60.0


def test_no_early_evidence_while_the_newest_samples_still_work_or_without_processes() -> None:
    assert busy_spin.evaluate(window([LIVE_BUSY] * 60, [{**LIVE_SPIN, **RANK}] * 11 + [LIVE_BUSY]), CFG) is None
    assert busy_spin.evaluate(window([LIVE_BUSY] * 60, [LIVE_SPIN] * 12), CFG) is None  # a log: no stacks to see
