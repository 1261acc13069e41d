"""observe_many (a replay's bulk path) against observe (the daemon's, one snapshot at a time): the same
events in the same order and the same windows afterwards, on corpus traces of every class, GPU model,
column set and interval, on the scenarios, on a real log, with a clock that jitters back, and under
configurations that move the thresholds. And what the bulk path skipped really had nothing to find."""

from __future__ import annotations

import itertools
import random
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.conftest import REPO, realdata
from watchdog.config import Config, parse_config
from watchdog.detect.engine import DetectorEngine
from watchdog.model import EpisodeEvent, GpuSample, NodeSnapshot, SnapshotBlock, each_snapshot
from watchdog.sample import sim
from watchdog.sample.replay import open_trace

sys.path.insert(0, str(REPO / "bench"))

from common import write_messy_day  # noqa: E402
from corpus import HANGS, HEALTHY, _behaviour_at, make, snapshots  # noqa: E402
from perturb import PERTURBATIONS, apply  # noqa: E402

_STATE = ("idle_watts", "busy_watts", "_busy_at", "now", "latest", "host_first_at", "host_seen_at", "moved_at",
          "long_sum", "_idle_block")


def one_by_one(config: Config, stream: Sequence[NodeSnapshot]
               ) -> tuple[DetectorEngine, list[EpisodeEvent], set[float]]:
    """observe() over the stream; also the ticks (on the engine's timeline) whose evaluation found
    something."""
    engine = DetectorEngine(config)
    events: list[EpisodeEvent] = []
    found: set[float] = set()
    for snapshot in stream:
        events += engine.observe(snapshot)
        if engine.last_findings and engine._last_evaluation == snapshot.time_seconds + engine._offset:
            found.add(engine._last_evaluation)
    return engine, events, found


def as_blocks(stream: Sequence[NodeSnapshot], size: int) -> list[NodeSnapshot | SnapshotBlock]:
    """The stream as a reader hands it on: consecutive snapshots of the same GPUs as column blocks of
    up to `size`, a field no row has as None; a snapshot on its own stays one."""
    items: list[NodeSnapshot | SnapshotBlock] = []
    for layout, same in itertools.groupby(stream, key=lambda s: tuple(g.index for g in s.gpus)):
        group = list(same)
        for start in range(0, len(group), size):
            part = group[start:start + size]
            if len(part) == 1:
                items.extend(part)
                continue
            columns = [list(column) for column in zip(*(g for s in part for g in s.gpus))]
            items.append(SnapshotBlock([s.time_seconds for s in part], layout, tuple(
                None if slot and column.count(default) == len(column) else column
                for slot, (column, default) in enumerate(zip(columns, _DEFAULTS)))))
    return items


_DEFAULTS = [GpuSample._field_defaults.get(name) for name in GpuSample._fields]


def in_bulk(config: Config, items: Sequence[NodeSnapshot | SnapshotBlock], batch: int = 1000
            ) -> tuple[DetectorEngine, list[EpisodeEvent], list[float]]:
    """observe_many over batches of snapshots, or block by block; also the times of every snapshot it
    ingested in bulk."""
    engine = DetectorEngine(config)
    bulk_times: list[float] = []
    ingest = engine._ingest

    def watched(before_last, last, runs):  # type: ignore[no-untyped-def]
        bulk_times.extend(runs[0][1].times)
        return ingest(before_last, last, runs)

    engine._ingest = watched  # type: ignore[method-assign]
    events: list[EpisodeEvent] = []
    if any(isinstance(item, SnapshotBlock) for item in items):
        for item in items:
            events += engine.observe_many(item if isinstance(item, SnapshotBlock) else [item])
    else:
        for start in range(0, len(items), batch):
            events += engine.observe_many(items[start:start + batch])  # type: ignore[arg-type]
    return engine, events, bulk_times


def assert_same(config: Config, stream: Sequence[NodeSnapshot]) -> int:
    """The paths agree: one snapshot at a time, in bulk over lists of snapshots, and in bulk over
    column blocks; returns how many snapshots went in bulk."""
    a, expected, found = one_by_one(config, stream)
    for items in (stream, as_blocks(stream, 300)):
        bulk = _assert_bulk_same(config, items, a, expected, found)
    return bulk


def _assert_bulk_same(config: Config, items: Sequence[NodeSnapshot | SnapshotBlock], a: DetectorEngine,
                      expected: list[EpisodeEvent], found: set[float]) -> int:
    b, got, bulk_times = in_bulk(config, items)
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
    assert not found & set(bulk_times), sorted(found & set(bulk_times))[:5]
    return len(bulk_times)


@pytest.mark.parametrize(("cls", "seed"), [(cls, 3 * n) for n, cls in enumerate(HEALTHY + HANGS)])
def test_corpus_traces_agree(cls: str, seed: int) -> None:
    assert_same(Config(), list(snapshots(make(cls, seed))))


def test_most_of_a_healthy_trace_goes_in_bulk() -> None:
    """On a regular log (the same GPUs in every sample, no [N/A]): most of its training, a minute after each
    change of what the GPUs do, goes in bulk (its pauses and start-up are looked at tick by tick). A messy
    log is the corpus's default and agrees too (test_corpus_traces_agree), with less of it in bulk."""
    trace = make("healthy_train", 4)
    stream = list(snapshots(trace, messy=False))
    changes = [start for start, _, _ in trace.segments]
    training = sum(1 for step in range(len(stream))
                   if _behaviour_at(trace, 0, step * trace.interval)[0] == "train"
                   and min(step * trace.interval - c for c in changes if c <= step * trace.interval) > 60)
    assert training > 0.7 * len(stream)
    assert assert_same(Config(), stream) > 0.9 * training


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


def test_a_messy_log_agrees(tmp_path: Path) -> None:
    """A log as nvidia-smi writes it (bench/replay_throughput.py's day, two hours of it): each GPU's row
    its own millisecond timestamp, utilization wandering 40-99%, checkpoints every few minutes, a spin at
    the end. Read back by the CSV reader, whose own blocks agree too."""
    path = tmp_path / "messy.csv"
    with path.open("w") as f:
        write_messy_day(f, seconds=7200, seed=11, spin_seconds=600)
    with open_trace(str(path)) as trace:
        items = list(trace.stretches)
    stream = list(each_snapshot(items))
    assert len({g.utilization_ratio for s in stream for g in s.gpus}) > 50
    assert assert_same(Config(), stream) > len(stream) // 2
    a, expected, found = one_by_one(Config(), stream)
    assert any(e.signature.value == "busy_spin" and e.severity.value == "critical" for e in expected)
    _assert_bulk_same(Config(), items, a, expected, found)


@pytest.mark.parametrize("name", sorted(PERTURBATIONS))
def test_perturbed_traces_agree(name: str) -> None:
    """Each of bench/perturb.py's messes at its strongest, on a checkpointing job and on a hang."""
    for cls, seed in (("checkpoint_rank0", 6), ("hang_odd", 7)):
        assert_same(Config(), list(apply(snapshots(make(cls, seed), messy=False), [name], seed, 2)))
