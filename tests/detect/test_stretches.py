"""A stretch of ticks (a replay's: lists of snapshots, a reader's column blocks) against one tick at a time
(the daemon's): the same rules over the same rows, so the same events in the same order and the same state
afterwards (learnt levels, stream clock, schedule), on corpus traces of every class, GPU model, column set
and interval, on the scenarios, on a real log, with a clock that jitters back, with GPUs that come and go,
and under configurations that move the thresholds."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import realdata
from tests.traces.corpus import HANGS, HEALTHY, make, snapshots
from tests.traces.messy_day import DayShape, write_messy_day, write_random_day
from tests.traces.perturb import PERTURBATIONS, apply
from watchdog.config import Config, parse_config
from watchdog.detect.engine import DetectorEngine
from watchdog.sample import sim
from watchdog.sample.replay import open_trace
from watchdog.vocabulary.model import EpisodeEvent, GpuSample, NodeSnapshot, SnapshotBlock, each_snapshot


def one_by_one(config: Config, stream: Sequence[NodeSnapshot]) -> tuple[DetectorEngine, list[EpisodeEvent]]:
    engine = DetectorEngine(config)
    events: list[EpisodeEvent] = []
    for snapshot in stream:
        events += engine.observe(snapshot)
    return engine, events


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


def in_stretches(config: Config, items: Sequence[NodeSnapshot | SnapshotBlock], batch: int
                 ) -> tuple[DetectorEngine, list[EpisodeEvent]]:
    """observe over batches of snapshots, or block by block."""
    engine = DetectorEngine(config)
    events: list[EpisodeEvent] = []
    if any(isinstance(item, SnapshotBlock) for item in items):
        for item in items:
            events += engine.observe(item)
    else:
        for start in range(0, len(items), batch):
            events += engine.observe(list(items[start:start + batch]))  # type: ignore[arg-type]
    return engine, events


def assert_same(config: Config, stream: Sequence[NodeSnapshot]) -> None:
    """The ways agree: one snapshot at a time, over lists of snapshots, and over column blocks."""
    a, expected = one_by_one(config, stream)
    for items, batch in ((stream, 1000), (stream, 7), (as_blocks(stream, 300), 0)):
        b, got = in_stretches(config, items, batch)
        assert got == expected
        assert_same_state(a, b)


def assert_same_state(a: DetectorEngine, b: DetectorEngine) -> None:
    for engine in (a, b):
        engine.frames.catch_up()
    la, lb = a.frames.levels, b.frames.levels
    for name in ("idle", "busy", "settled", "busy_at", "block_count", "host", "newest", "_running"):
        np.testing.assert_allclose(getattr(la, name), getattr(lb, name), rtol=1e-9, equal_nan=True, err_msg=name)
    assert a.frames.gpus == b.frames.gpus
    assert (a._last_evaluation, a.frames.clock.interval, a.frames.clock.now) == (
        b._last_evaluation, b.frames.clock.interval, b.frames.clock.now)


@pytest.mark.parametrize(("cls", "seed"), [(cls, 3 * n) for n, cls in enumerate(HEALTHY + HANGS)])
def test_corpus_traces_agree(cls: str, seed: int) -> None:
    assert_same(Config(), list(snapshots(make(cls, seed))))


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


def test_a_gpu_first_seen_later_counts_its_own_samples() -> None:
    """A GPU first seen mid-stream widens the stretch: the rows before it hold none of its samples (not a cast of
    NaN into the running counts), so its windows count its own samples, and the ways agree."""
    stream = list(snapshots(make("hang_spin", 5), messy=False))  # 1 s, every GPU in every row
    stream = [NodeSnapshot(s.time_seconds, s.gpus[:-1]) if n < 200 else s for n, s in enumerate(stream)]
    assert_same(Config(), stream)
    engine = DetectorEngine(Config())
    for snapshot in stream[:260]:
        engine.observe(snapshot)
    stretch = engine.frames.stretch
    assert stretch is not None and stretch.first_row + len(stretch) == 260 and stretch.first_row < 199
    col = stretch.gpus.index(stream[-1].gpus[-1].index)
    first = stretch.first_row  # the stretch keeps the rows its windows look at, not the whole 260
    rows = np.array([199, 200, 259]) - first
    assert stretch.counts(rows, np.full(3, col)).tolist() == [0, 1, 60]
    assert stretch.newest(rows)[:, col].tolist() == [-1, 200 - first, 259 - first]
    tally = engine.frames.tally  # utilization's totals kept longer: nothing counted for the GPU before row 200
    assert tally.first_row == 0 and tally.counts[199, col] == 0 and tally.counts[259, col] == 60


def test_windows_read_the_same_rows_whether_every_gpu_is_in_every_row_or_not() -> None:
    """A stretch where every GPU is in every row reads a cell's k-th sample as row k; once a GPU has missed a
    tick, rows are looked up GPU by GPU until that tick leaves the stretch. Both ways give the same rows."""
    from watchdog.detect.stretch import Cells

    stream = list(snapshots(make("hang_spin", 5), messy=False))  # 1 s, every GPU in every row
    stream = [NodeSnapshot(s.time_seconds, s.gpus[1:]) if n == 100 else s for n, s in enumerate(stream)]
    engine = DetectorEngine(Config())
    complete = []
    for n, snapshot in enumerate(stream[:1400]):
        engine.observe(snapshot)
        stretch = engine.frames.stretch
        assert stretch is not None
        complete.append(stretch.gap_row < stretch.first_row)
        if n in (99, 150, 1399):
            last = np.full(len(stretch.gpus), len(stretch) - 1)
            cells = Cells(stretch, last, np.arange(len(stretch.gpus)), last)
            windows = [cells.window(np.array([20.0, 40.0, 600.0, np.inf])[np.arange(len(last)) % 4], 20.0)]
            spans = [cells.span(20.0, 8)]
            gap = stretch.gap_row
            stretch.gap_row = max(gap, stretch.first_row)  # as if a GPU had missed the first row
            windows.append(cells.window(np.array([20.0, 40.0, 600.0, np.inf])[np.arange(len(last)) % 4], 20.0))
            spans.append(cells.span(20.0, 8))
            np.testing.assert_array_equal(windows[0].rows, windows[1].rows)
            np.testing.assert_array_equal(windows[0].count, windows[1].count)
            np.testing.assert_array_equal(spans[0], spans[1])
            stretch.gap_row, stretch._order = gap, None
    # The gap leaves with its row, once the rows the windows look at (80 s by default) have passed it.
    assert all(complete[:100]) and not any(complete[100:175]) and all(complete[185:])


def test_a_real_log_agrees() -> None:
    path = realdata("telemetry", "grantwilkins-training_profile", "h100-traces", "ckpt1.csv")
    with open_trace(str(path)) as trace:
        assert_same(Config(), list(trace.snapshots))


def test_a_messy_log_agrees(tmp_path: Path) -> None:
    """A log as nvidia-smi writes it (tests/traces/messy_day.py's day, two hours of it): each GPU's row
    its own millisecond timestamp, utilization wandering 40-99%, checkpoints every few minutes, a spin at
    the end. Read back by the CSV reader, whose own blocks agree too."""
    path = tmp_path / "messy.csv"
    with path.open("w") as f:
        write_messy_day(f, seconds=7200, seed=11, spin_seconds=600)
    with open_trace(str(path)) as trace:
        items = list(trace.stretches)
    stream = list(each_snapshot(items))
    assert len({g.utilization_ratio for s in stream for g in s.gpus}) > 50
    assert_same(Config(), stream)
    a, expected = one_by_one(Config(), stream)
    assert any(e.signature.value == "busy_spin" and e.severity.value == "critical" for e in expected)
    b, got = in_stretches(Config(), items, 0)
    assert got == expected
    assert_same_state(a, b)


@pytest.mark.parametrize("name", sorted(PERTURBATIONS))
def test_perturbed_traces_agree(name: str) -> None:
    """Each of tests/traces/perturb.py's messes at its strongest, on a checkpointing job and on a hang."""
    for cls, seed in (("checkpoint_rank0", 6), ("hang_odd", 7)):
        assert_same(Config(), list(apply(snapshots(make(cls, seed), messy=False), [name], seed, 2)))


@pytest.mark.parametrize("gpus", [1, 4])
def test_work_learnt_without_a_reference_agrees(tmp_path: Path, gpus: int) -> None:
    """A log with no power limit whose GPUs are never seen idle: each busy sample is work or not by the busy level
    as of the sample before it (detect/levels.py). Training noisy enough that many samples fall either side of
    that line, then a spin: the levels worked out a chunk at a time agree with one sample at a time."""
    shape = DayShape(gpus=gpus, interval=1, stamps="row", identity="index", units=True,
                     fields=("timestamp", "index", "utilization.gpu", "power.draw", "memory.used"), absent=frozenset(),
                     missing=0.0, dropped=0.0, outage=False, order="enumeration", checkpoints="barrier")
    path = tmp_path / "day.csv"
    with path.open("w") as f:
        write_random_day(f, shape, 6_000 * gpus, seed=gpus)
    with open_trace(str(path)) as trace:
        items = list(trace.stretches)
    stream = list(each_snapshot(items))
    a, expected = one_by_one(Config(), stream)
    assert any(e.signature.value == "busy_spin" and e.severity.value == "critical" for e in expected)
    b, got = in_stretches(Config(), items, 0)
    assert got == expected
    assert_same_state(a, b)
