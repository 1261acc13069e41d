"""observe_many (a replay's bulk path) against observe (the daemon's, one snapshot at a time): the same
events in the same order and the same windows afterwards, on corpus traces of every class, GPU model,
column set and interval, on the scenarios, on a real log, with a clock that jitters back, and under
configurations that move the thresholds. And what the bulk path skipped really had nothing to find."""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence

import pytest

from tests.conftest import REPO, realdata
from watchdog.config import Config, parse_config
from watchdog.detect.engine import DetectorEngine
from watchdog.model import EpisodeEvent, NodeSnapshot
from watchdog.sample import sim
from watchdog.sample.replay import open_trace

sys.path.insert(0, str(REPO / "bench"))

from corpus import HANGS, HEALTHY, make, snapshots  # noqa: E402

_STATE = ("idle_watts", "busy_watts", "_busy_at", "now", "latest", "host_first_at", "host_seen_at", "moved_at",
          "long_sum", "_idle_block")


def one_by_one(config: Config, stream: Sequence[NodeSnapshot]) -> tuple[DetectorEngine, list[EpisodeEvent]]:
    engine = DetectorEngine(config)
    return engine, [event for snapshot in stream for event in engine.observe(snapshot)]


def in_bulk(config: Config, stream: Sequence[NodeSnapshot], batch: int = 1000
            ) -> tuple[DetectorEngine, list[EpisodeEvent], list[float]]:
    """observe_many over batches; also the times of every snapshot it ingested in bulk."""
    engine = DetectorEngine(config)
    bulk_times: list[float] = []
    ingest = engine._ingest

    def watched(before_last, last, runs):  # type: ignore[no-untyped-def]
        bulk_times.extend(runs[0][1].times)
        return ingest(before_last, last, runs)

    engine._ingest = watched  # type: ignore[method-assign]
    events = [event for start in range(0, len(stream), batch)
              for event in engine.observe_many(stream[start:start + batch])]
    return engine, events, bulk_times


def assert_same(config: Config, stream: Sequence[NodeSnapshot]) -> int:
    """The two paths agree; returns how many snapshots went in bulk."""
    a, expected = one_by_one(config, stream)
    b, got, bulk_times = in_bulk(config, stream)
    assert got == expected
    assert a._windows.keys() == b._windows.keys()
    for index, window in a._windows.items():
        other = b._windows[index]
        for name in _STATE:
            assert getattr(other, name) == getattr(window, name), (index, name)
        assert list(other.samples) == list(window.samples)
        assert list(other.long_history()) == list(window.long_history())
    assert (b._last_evaluation, b._step, b._last_stamp) == (a._last_evaluation, a._step, a._last_stamp)
    # What went in bulk had nothing to find: the one-by-one engine found nothing at those ticks either.
    shadow = DetectorEngine(config)
    skipped = set(bulk_times)
    for snapshot in stream:
        shadow.observe(snapshot)
        if snapshot.time_seconds + shadow._offset in skipped and shadow._last_evaluation == snapshot.time_seconds:
            assert shadow.last_findings == [], snapshot.time_seconds
    return len(bulk_times)


@pytest.mark.parametrize(("cls", "seed"), [(cls, 3 * n) for n, cls in enumerate(HEALTHY + HANGS)])
def test_corpus_traces_agree(cls: str, seed: int) -> None:
    assert_same(Config(), list(snapshots(make(cls, seed))))


def test_most_of_a_healthy_trace_goes_in_bulk() -> None:
    stream = list(snapshots(make("healthy_train", 1)))
    assert assert_same(Config(), stream) > 0.8 * len(stream)


@pytest.mark.parametrize("name", list(sim.SCENARIOS))
def test_scenarios_agree(name: str) -> None:
    assert_same(Config(), list(sim.run(sim.SCENARIOS[name])))


@pytest.mark.parametrize("settings", [
    {"sample": {"evaluate_interval_seconds": 5}},
    {"detectors": {"underuse": {"window_seconds": 60, "utilization_max_ratio": 0.97}}},
    {"detectors": {"zero_util": {"enabled": False}, "waiting": {"enabled": False}}},
    {"detectors": {"busy_spin": {"utilization_min_ratio": 0.5}}},
])
def test_other_configurations_agree(settings: dict) -> None:
    config = parse_config(settings)
    for cls, seed in (("checkpoint_rank0", 2), ("hang_odd", 4), ("healthy_train", 5)):
        assert_same(config, list(snapshots(make(cls, seed))))


def test_a_clock_that_jitters_back_agrees() -> None:
    rng = random.Random(3)
    stream = [NodeSnapshot(s.time_seconds - (rng.random() * 0.4 if rng.random() < 0.05 else 0.0), s.gpus)
              for s in snapshots(make("checkpoint_sharded", 3))]
    assert_same(Config(), stream)


def test_gpus_that_come_and_go_agree() -> None:
    stream = list(snapshots(make("hang_spin", 5)))
    stream = [NodeSnapshot(s.time_seconds, s.gpus[:-1]) if 600 <= n < 900 else s for n, s in enumerate(stream)]
    assert_same(Config(), stream)


def test_a_real_log_agrees() -> None:
    path = realdata("telemetry", "grantwilkins-training_profile", "h100-traces", "ckpt1.csv")
    with open_trace(str(path)) as trace:
        assert_same(Config(), list(trace.snapshots))
