"""Tables of cases for zero_util, underuse, throttle, gpu_lost, the window they read, and the node verdicts
that combine per-GPU evidence (busy_spin has its own file)."""

from __future__ import annotations

import pytest

from watchdog.config import Config
from watchdog.detect import gpu_lost, throttle, underuse, zero_util
from watchdog.detect.evidence import Evidence
from watchdog.detect.node import job_findings
from watchdog.detect.window import GpuWindow
from watchdog.model import CLOCK_EVENT_HW_THERMAL, GpuHealth, GpuSample, Severity, Signature

D = Config().detectors
GIB = 2**30


def window(readings: list[dict], long_seconds: float = 600, memory_min: int = GIB, step: float = 1.0) -> GpuWindow:
    w = GpuWindow(0, 30, long_seconds, D.busy_spin.idle_power_max_multiple, D.busy_spin.default_idle_power_ratio)
    w.memory_min_bytes = memory_min
    for n, fields in enumerate(readings):
        w.add(n * step, GpuSample(index=0, **{"power_limit_watts": 700.0, **fields}))
    return w


IDLE_HELD = {"utilization_ratio": 0.0, "power_watts": 120.0, "memory_used_bytes": 40 * GIB}


@pytest.mark.parametrize(("readings", "fires"), [
    ([IDLE_HELD] * 20, True),  # 0% util, memory held and flat
    ([{**IDLE_HELD, "utilization_ratio": 0.01}] * 20, True),  # within the 2% ceiling
    ([{**IDLE_HELD, "memory_used_bytes": (10 + n) * GIB} for n in range(20)], False),  # still allocating
    ([{**IDLE_HELD, "memory_used_bytes": 512 * 2**20}] * 20, False),  # a bare context: no job
    ([IDLE_HELD] * 2, False),  # too few samples to judge
    ([{**IDLE_HELD, "utilization_ratio": 0.5}] * 5 + [IDLE_HELD] * 3, False),  # mostly working in the window
    ([{**IDLE_HELD, "utilization_ratio": 0.9}] * 20, False),
    # An idle GPU with a context blips to 1-4% now and then: still idle, the newest sample a blip or not.
    ([IDLE_HELD] * 6 + [{**IDLE_HELD, "utilization_ratio": 0.04}] + [IDLE_HELD] * 6, True),
    ([IDLE_HELD] * 12 + [{**IDLE_HELD, "utilization_ratio": 0.03}], True),
    ([IDLE_HELD] * 12 + [{**IDLE_HELD, "utilization_ratio": 0.08}], False),  # more than a blip: something runs
    ([IDLE_HELD, {**IDLE_HELD, "utilization_ratio": 0.04}] * 3 + [{**IDLE_HELD, "utilization_ratio": 0.04}] * 4,
     False),  # mostly at 4%: a writer's copies, not an idle GPU
    # An [N/A] reading is judged on the window's others.
    ([IDLE_HELD] * 12 + [{**IDLE_HELD, "utilization_ratio": None}], True),
    ([IDLE_HELD] * 12 + [{**IDLE_HELD, "memory_used_bytes": None}], True),
])
def test_zero_util(readings: list[dict], fires: bool) -> None:
    evidence = zero_util.evaluate(window(readings), D.zero_util)
    assert (evidence is not None) is fires
    if evidence is not None:
        assert evidence.signature is Signature.ZERO_UTIL and evidence.facts["memory_used_bytes"] == 40 * GIB


@pytest.mark.parametrize(("util", "seconds", "fires"), [
    (0.35, 600, True),  # the MoE fine-tune at 35% for the whole window
    (0.35, 300, False),  # not long enough to judge
    (0.80, 600, False),  # busy enough
    (0.02, 600, False),  # below the floor: zero_util's case, not a running job
    (0.50, 600, True),  # the ceiling is inclusive
])
def test_underuse(util: float, seconds: int, fires: bool) -> None:
    readings = [{"utilization_ratio": util, "power_watts": 300.0, "memory_used_bytes": 40 * GIB}] * (seconds + 1)
    evidence = underuse.evaluate(window(readings), D.underuse)
    assert (evidence is not None) is fires


@pytest.mark.parametrize(("reasons", "legs"), [
    (CLOCK_EVENT_HW_THERMAL, ("hw_thermal_slowdown",)),
    (0, None),
    (0x1, None),  # GPU idle: a clock event reason that is not a throttle
])
def test_throttle(reasons: int, legs: tuple[str, ...] | None) -> None:
    readings = [{"utilization_ratio": 1.0, "power_watts": 300.0, "clock_event_reasons": reasons,
                 "sm_clock_hertz": 0.9e9, "sm_clock_max_hertz": 1.98e9}] * 5
    evidence = throttle.evaluate(window(readings), D.throttle)
    if legs is None:
        assert evidence is None
    else:
        assert evidence is not None and evidence.legs == legs
        assert evidence.facts["clock_ratio"] == pytest.approx(0.9 / 1.98)


@pytest.mark.parametrize(("healths", "since", "leg"), [
    ([GpuHealth.OK] * 5, None, None),
    ([GpuHealth.OK] * 3 + [GpuHealth.LOST] * 2, 3.0, "lost"),
    ([GpuHealth.OK] * 2 + [GpuHealth.HUNG] * 3, 2.0, "hung"),
    ([GpuHealth.LOST, GpuHealth.OK, GpuHealth.HUNG], 2.0, "hung"),  # it came back in between
])
def test_gpu_lost(healths: list[GpuHealth], since: float | None, leg: str | None) -> None:
    w = GpuWindow(0, 30, 600, 2.5, 0.12)
    for n, health in enumerate(healths):
        w.add(float(n), GpuSample(index=0, health=health, errors=(("nvml", "x"),) if health is not GpuHealth.OK
                                  else ()))
    evidence = gpu_lost.evaluate(w, D.gpu_lost)
    if leg is None:
        assert evidence is None
    else:
        assert evidence is not None and evidence.since == since and evidence.legs == (leg,)


def test_window_learns_idle_and_busy_power_and_keeps_its_spans() -> None:
    readings = ([{"utilization_ratio": 0.0, "power_watts": 70.0}] * 20
                + [{"utilization_ratio": 0.97, "power_watts": 600.0}] * 50)
    w = window(readings, long_seconds=40)
    assert w.idle_watts == pytest.approx(70.0)
    assert w.busy_watts == pytest.approx(600.0)
    assert w.long_span_seconds == 40.0  # trimmed to the long window
    assert w.long_mean_utilization == pytest.approx(0.97)
    assert [t for t, _ in w.recent(5)] == [64.0, 65.0, 66.0, 67.0, 68.0, 69.0]
    assert w.samples[0][0] >= 69.0 - 30  # the short window is trimmed too


def test_window_does_not_learn_busy_power_from_a_spin() -> None:
    w = window([{"utilization_ratio": 1.0, "power_watts": 100.0}] * 60)  # 100 W < 2.5 x 84 W assumed idle
    assert w.busy_watts is None and w.idle_watts is None


def ev(gpu: int, signature: Signature, since: float = 0.0) -> Evidence:
    return Evidence(gpu, signature, since=since, legs=("power_near_idle",), facts={"power_watts": 150.0})


@pytest.mark.parametrize(("spin", "zero", "other", "expected", "culprits"), [
    (range(8), [], [], Signature.BUSY_SPIN, ()),  # all spin
    ([], range(8), [], Signature.ZERO_UTIL, ()),  # all idle with memory held
    ([0, 1, 2, 3, 5, 6, 7], [4], [], Signature.WAITING, (4,)),  # seven wait on the idle one
    ([0, 1, 2, 3, 5, 6, 7], [], [4], Signature.WAITING, (4,)),  # seven wait on the busy one
    ([0, 1], [2, 3, 4, 5, 6, 7], [], Signature.ZERO_UTIL, ()),  # mostly idle: a zero-util stall
    ([0, 1], [], [2, 3, 4, 5, 6, 7], None, ()),  # mostly working: no verdict
    ([], [], range(8), None, ()),  # all working
])
def test_node_verdicts(spin: list[int], zero: list[int], other: list[int], expected: Signature | None,
                       culprits: tuple[int, ...]) -> None:
    views = {i: window([{"utilization_ratio": 0.5, "power_watts": 300.0, "memory_used_bytes": 40 * GIB}] * 3)
             for i in range(8)}
    findings = job_findings(views, {i: ev(i, Signature.BUSY_SPIN) for i in spin},
                            {i: ev(i, Signature.ZERO_UTIL) for i in zero})
    if expected is None:
        assert findings == []
        return
    (finding,) = findings
    assert finding.signature is expected and finding.culprit_gpus == culprits
    assert finding.severity is (Severity.WARNING if expected is Signature.WAITING else Severity.CRITICAL)


def test_a_failing_detector_costs_only_itself() -> None:
    from watchdog.detect import DETECTORS
    from watchdog.detect.engine import DetectorEngine
    from watchdog.model import NodeSnapshot

    def broken(view: object, cfg: object) -> None:
        raise ZeroDivisionError("a bug")

    errors: list[tuple[str, str]] = []
    engine = DetectorEngine(Config(), on_error=lambda c, e: errors.append((c, str(e))),
                            detectors={**DETECTORS, "throttle": broken})
    hot = GpuSample(index=0, health=GpuHealth.LOST, errors=(("nvml", "GPU is lost"),))
    events = []
    for t in range(5):
        events += engine.observe(NodeSnapshot(float(t), (hot,)))
    assert [e.signature for e in events] == [Signature.GPU_LOST]  # the others still judge
    assert errors and errors[0] == ("detector_throttle", "a bug")
    assert engine.detector_up["detector_throttle"] is False and engine.detector_up["detector_gpu_lost"] is True


WORK = {"utilization_ratio": 0.93, "power_watts": 560.0, "memory_used_bytes": 40 * GIB,
        "memory_utilization_ratio": 0.4}
SPIN = {"utilization_ratio": 1.0, "power_watts": 150.0, "memory_used_bytes": 40 * GIB, "memory_utilization_ratio": 0.0}


@pytest.mark.parametrize(("readings", "back"), [
    ([WORK] * 30, True),  # real work leaves gaps in utilization
    ([{**WORK, "utilization_ratio": 1.0}] * 30, True),  # pinned at 100%, with the power of work
    ([WORK] * 30 + [SPIN] * 12, False),  # pinned at 100% at near-idle power, no memory traffic: a spin
    ([WORK] * 30 + [IDLE_HELD] * 12, False),  # idle with memory held
    ([WORK] * 30 + [IDLE_HELD] * 8 + [{**IDLE_HELD, "memory_used_bytes": 0}], True),  # released: the job left
    ([IDLE_HELD] * 30 + [WORK, IDLE_HELD] * 6, False),  # one busy sample in two: not back at work
    ([IDLE_HELD] * 30 + [WORK] * 2, False),  # two samples of work: not yet the median of the last seconds
])
def test_recovery_evidence(readings: list[dict], back: bool) -> None:
    from watchdog.detect.recovery import recovered

    assert recovered(window(readings), D.busy_spin) is back
