"""Tables of cases for zero_util, underuse, throttle, gpu_lost, the window they read, and the node verdicts
that combine per-GPU evidence (busy_spin has its own file)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.detect.judge import judged, newest, stretch_of
from watchdog.config import Config
from watchdog.detect import gpu_lost, throttle, underuse, zero_util
from watchdog.detect.evidence import Evidence
from watchdog.detect.node import GpuView, job_findings
from watchdog.detect.stretch import Context
from watchdog.vocabulary.model import CLOCK_EVENT_HW_THERMAL, GpuHealth, GpuSample, Severity, Signature

D = Config().detectors
GIB = 2**30


BASE = {"power_limit_watts": 700.0}


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
    evidence = judged(zero_util.detect, readings, D.zero_util, base=BASE)
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
    evidence = judged(underuse.detect, readings, D.underuse, base=BASE)
    assert (evidence is not None) is fires


@pytest.mark.parametrize(("reasons", "legs"), [
    (CLOCK_EVENT_HW_THERMAL, ("hw_thermal_slowdown",)),
    (0, None),
    (0x1, None),  # GPU idle: a clock event reason that is not a throttle
])
def test_throttle(reasons: int, legs: tuple[str, ...] | None) -> None:
    readings = [{"utilization_ratio": 1.0, "power_watts": 300.0, "clock_event_reasons": reasons,
                 "sm_clock_hertz": 0.9e9, "sm_clock_max_hertz": 1.98e9}] * 5
    evidence = judged(throttle.detect, readings, D.throttle, base=BASE)
    if legs is None:
        assert evidence is None
    else:
        assert evidence is not None and evidence.legs == legs
        assert evidence.facts["clock_ratio"] == pytest.approx(0.9 / 1.98)


@pytest.mark.parametrize(("healths", "since", "leg"), [
    ([GpuHealth.OK] * 5, None, None),
    ([GpuHealth.OK] * 3 + [GpuHealth.LOST] * 2, 3.0, "lost"),
    ([GpuHealth.OK] * 2 + [GpuHealth.HUNG] * 3, None, None),  # calls slow for 3 s: a slow reading
    ([GpuHealth.OK] * 2 + [GpuHealth.HUNG] * 31, 2.0, "hung"),  # hung for hung_for_seconds: counted
    ([GpuHealth.LOST, GpuHealth.OK] + [GpuHealth.HUNG] * 31, 2.0, "hung"),  # it came back in between
    ([GpuHealth.HUNG] * 20 + [GpuHealth.LOST] * 2, 0.0, "lost"),  # a call that hung, then the GPU lost
])
def test_gpu_lost(healths: list[GpuHealth], since: float | None, leg: str | None) -> None:
    readings = [{"health": health, "errors": (("nvml", "x"),) if health is not GpuHealth.OK else ()}
                for health in healths]
    evidence = judged(gpu_lost.detect, readings, D.gpu_lost)
    if leg is None:
        assert evidence is None
    else:
        assert evidence is not None and evidence.since == since and evidence.legs == (leg,)


def learnt(readings: list[dict], name: str) -> float:
    """A learnt level (detect/levels.py) of the one GPU after these readings, one a second."""
    stretch = stretch_of([(float(n), GpuSample(index=0, **{**BASE, **r})) for n, r in enumerate(readings)])
    return float(stretch.level(name)[-1, 0])


def test_the_levels_learn_idle_and_busy_power() -> None:
    readings = ([{"utilization_ratio": 0.0, "power_watts": 70.0}] * 20
                + [{"utilization_ratio": 0.97, "power_watts": 600.0}] * 50)
    assert learnt(readings, "idle") == pytest.approx(70.0)
    assert learnt(readings, "busy") == pytest.approx(600.0)
    # the lowest mean of 5 samples in a row at 0%; a sample without a reading does not break a block
    blocks = [{"utilization_ratio": 0.0, "power_watts": w} for w in (200, 200, 200, 200, 200, 10, 10, 10, 10)]
    assert learnt(blocks, "idle") == pytest.approx(200.0)  # four samples at 10 W are not yet a block
    assert learnt(blocks + blocks[5:6], "idle") == pytest.approx(10.0)
    assert learnt(blocks[:4] + [{"utilization_ratio": None}] + blocks[4:5], "idle") == pytest.approx(200.0)
    assert np.isnan(learnt(blocks[:4] + [{"utilization_ratio": 0.3, "power_watts": 90.0}] + blocks[:1], "idle"))


def test_the_busy_level_rises_over_about_a_minute_of_work_and_falls_over_ten() -> None:
    """The higher of two averages of the work's power: over about 50 s (it rises with heavier work within a
    minute) and about 600 s (it follows lighter work, or a spin that passes for work, only over minutes)."""
    lighter = [{"utilization_ratio": 0.97, "power_watts": 600.0}] * 30 + [
        {"utilization_ratio": 0.97, "power_watts": 400.0}] * 50
    busy = learnt(lighter, "busy")
    assert 400.0 < busy < 600.0 and busy == pytest.approx(400 + 200 * math.exp(-50 / 600), rel=1e-9)
    heavier = [{"utilization_ratio": 0.97, "power_watts": 400.0}] * 30 + [
        {"utilization_ratio": 0.97, "power_watts": 600.0}] * 50
    assert learnt(heavier, "busy") == pytest.approx(600 - 200 * math.exp(-50 / 50), rel=1e-9)


def test_the_levels_do_not_learn_busy_power_from_a_spin() -> None:
    readings = [{"utilization_ratio": 1.0, "power_watts": 100.0}] * 60  # 100 W < 2.5 x 84 W assumed idle
    assert np.isnan(learnt(readings, "busy")) and np.isnan(learnt(readings, "idle"))


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
    busy = GpuSample(index=0, utilization_ratio=0.5, power_watts=300.0, memory_used_bytes=40 * GIB)
    views = {i: GpuView(lambda: busy, GpuHealth.OK, True, 2.0, None, None, None, 30.0) for i in range(8)}
    findings = job_findings(views, {i: ev(i, Signature.BUSY_SPIN) for i in spin},
                            {i: ev(i, Signature.ZERO_UTIL) for i in zero})
    if expected is None:
        assert findings == []
        return
    (finding,) = findings
    assert finding.signature is expected and finding.culprit_gpus == culprits
    assert finding.severity is (Severity.WARNING if expected is Signature.WAITING else Severity.CRITICAL)


def test_the_power_quoted_for_a_spin_names_the_gpus_it_is_the_mean_of() -> None:
    """Four GPUs spin; GPU 3 reads no power ([N/A] throughout): the 150 W quoted is GPUs 0-2's, and says so. With
    every GPU's power read, the figure is all of theirs and names none."""
    from watchdog.detect.summary import summarize

    views = {i: GpuView(lambda: GpuSample(index=0), GpuHealth.OK, True, 2.0, None, None, None, 30.0) for i in range(4)}
    spin = {i: ev(i, Signature.BUSY_SPIN) for i in range(4)}
    spin[3] = Evidence(3, Signature.BUSY_SPIN, since=0.0, legs=("memory_idle",), facts={})
    (finding,) = job_findings(views, spin, {})
    _, text = summarize(finding, 30.0, Severity.CRITICAL)
    assert "only 150 W on GPUs 0-2" in text
    (every,) = job_findings(views, {i: ev(i, Signature.BUSY_SPIN) for i in range(4)}, {})
    _, text = summarize(every, 30.0, Severity.CRITICAL)
    assert "only 150 W" in text and "150 W on" not in text


def test_a_failing_detector_costs_only_itself() -> None:
    from watchdog.detect import DETECTORS, DetectorSpec
    from watchdog.detect.engine import DetectorEngine
    from watchdog.vocabulary.model import EventKind, NodeSnapshot

    def broken(cells: object, cfg: object, ctx: object) -> None:
        raise ZeroDivisionError("a bug")

    errors: list[tuple[str, str]] = []
    engine = DetectorEngine(Config(), on_error=lambda c, e: errors.append((c, str(e))),
                            detectors={**DETECTORS, "throttle": DetectorSpec(broken, "gpu", Severity.WARNING)})
    hot = GpuSample(index=0, health=GpuHealth.LOST, errors=(("nvml", "GPU is lost"),))
    events = []
    for t in range(15):  # lost for gpu_lost.for_seconds (10 s)
        events += engine.observe(NodeSnapshot(float(t), (hot,)))
    assert [e.signature for e in events if e.event is not EventKind.SUSPECTED] == [Signature.GPU_LOST]
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

    samples = [(float(n), GpuSample(index=0, **{**BASE, **r})) for n, r in enumerate(readings)]
    cells = newest(stretch_of(samples))
    assert bool(recovered(cells, D.busy_spin, Context(20.0, GIB))[0]) is back
