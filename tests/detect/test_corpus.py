"""Fixed traces of the accuracy corpus (tests/traces/corpus.py) as tests: the cases issue 10 named, on logs with
only the columns people keep (timestamp, index, utilization.gpu, power.draw, memory.used) and at slow
sampling. bench/accuracy.py measures the whole corpus; these hold the line on a few."""

from __future__ import annotations

import pytest

from tests.traces.corpus import make, snapshots
from tests.traces.judge import START, judge, replay
from watchdog.vocabulary.model import EventKind, Severity, Signature


def outcome(cls: str, seed: int):  # type: ignore[no-untyped-def]
    trace = make(cls, seed)
    events = replay(snapshots(trace, START))
    return trace, events, judge(trace, events)


@pytest.mark.parametrize(("cls", "seed", "what"), [
    ("hang_spin", 3, "A100, minimal columns, 1 s"),
    ("hang_spin_low_range", 0, "RTX A6000 spinning at 60-65% of its busy power, +-4 W noise, minimal columns, "
                               "5 s, never seen idle"),
    ("hang_spin_startup", 6, "RTX A6000 at start-up, power 5-20 W apart between GPUs, minimal columns, 5 s"),
])
def test_every_gpu_spinning_is_critical_within_a_minute(cls: str, seed: int, what: str) -> None:
    trace, events, result = outcome(cls, seed)
    assert result.found and result.critical_latency is not None and result.critical_latency <= 60, (what, result)
    assert not [e for e in events if e.signature is Signature.WAITING and e.at_seconds >= START + trace.hang_at], \
        "a spinning GPU was called the culprit"
    assert result.false_criticals == 0


def test_an_odd_gpu_is_named_within_a_minute_on_a_minimal_log() -> None:
    trace, _, result = outcome("hang_odd", 5)
    assert trace.columns == "minimal" and result.found and result.alert_latency is not None
    assert result.alert_latency <= 60 and result.false_criticals == 0


def test_a_zero_util_hang_warns_within_a_minute_and_pages_within_ten_on_telemetry_alone() -> None:
    _, _, result = outcome("hang_zero", 9)
    assert result.found and result.alert_latency is not None and result.alert_latency <= 60
    assert result.critical_latency is not None and result.critical_latency <= 600 + 5  # 5 s sampling


@pytest.mark.parametrize(("cls", "seed"), [("checkpoint_all_zero", 9), ("checkpoint_sharded", 8), ("tp_batch1", 4)])
def test_healthy_runs_never_page_and_repeat_pauses_stay_quiet(cls: str, seed: int) -> None:
    trace, events, result = outcome(cls, seed)
    assert result.false_criticals == 0, [e.summary for e in events if e.severity is Severity.CRITICAL]
    fired = [e for e in events if e.event is EventKind.FIRED]
    assert result.repeat_warnings <= 1, [e.headline for e in fired]
    if cls == "tp_batch1":
        assert events == []
