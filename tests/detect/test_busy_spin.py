"""busy_spin's legs and vetoes, one reading pattern per row."""

from __future__ import annotations

import pytest

from watchdog.config import Config
from watchdog.detect import busy_spin
from watchdog.detect.window import GpuWindow
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
