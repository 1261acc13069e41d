"""Any shape of nvidia-smi log the generator can make (tests/traces/messy_day.py random_shape: GPU count and
sampling, per-row or per-sample timestamps, index, uuid or neither, units or not, any fields in any order,
fields never reported, scattered [N/A], dropped rows, a GPU out for a while, rows interleaved): the reader's
snapshots are the samples written, GPU by GPU, and the detectors judge its column blocks as they judge the same
snapshots one at a time."""

from __future__ import annotations

import csv
import io
import random
from collections import defaultdict
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.detect.test_stretches import assert_same_state, in_stretches, one_by_one
from tests.traces.messy_day import random_shape, write_random_day
from watchdog.config import Config
from watchdog.sample.replay import open_trace
from watchdog.vocabulary.model import NodeSnapshot, SnapshotBlock, each_snapshot


def written(text: str) -> list[tuple[float, list[tuple[int, float | None, float | None]]]]:
    """The samples a log holds, read with nothing but the csv module and what the generator promises: a sample's
    rows all fall within its second (per-row stamps are milliseconds past it), a row without an index or uuid is
    the GPU of its place in its sample, a uuid's GPU is its number in the order first seen."""
    rows = csv.reader(io.StringIO(text), skipinitialspace=True)
    header = [name.split(" [")[0] for name in next(rows)]
    at = {name: n for n, name in enumerate(header)}
    groups: dict[int, list[list[str]]] = defaultdict(list)
    for row in rows:
        stamp = row[at["timestamp"]]
        groups[int(_seconds(stamp))].append(row)
    uuids: dict[str, int] = {}
    samples = []
    for _, group in sorted(groups.items()):
        gpus = []
        for place, row in enumerate(group):
            if "index" in at:
                gpu = int(row[at["index"]])
            elif "uuid" in at:
                gpu = uuids.setdefault(row[at["uuid"]], len(uuids))
            else:
                gpu = place
            util, power = (_number(row[at[name]]) for name in ("utilization.gpu", "power.draw"))
            gpus.append((gpu, None if util is None else round(util / 100, 9), power))
        samples.append((_seconds(group[0][at["timestamp"]]), sorted(gpus)))
    return samples


def _seconds(stamp: str) -> float:
    from watchdog.sample.smi_cells import parse_timestamp

    return parse_timestamp(stamp)


def _number(cell: str) -> float | None:
    return None if cell.startswith("[") else float(cell.split()[0])


def read_back(path: Path) -> tuple[list[NodeSnapshot | SnapshotBlock], list[NodeSnapshot]]:
    with open_trace(str(path)) as trace:
        items = list(trace.stretches)
    return items, list(each_snapshot(items))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_any_shape_reads_back_as_written(tmp_path: Path, seed: int) -> None:
    shape = random_shape(random.Random(seed))
    path = tmp_path / "day.csv"
    with path.open("w") as f:
        write_random_day(f, shape, 6_000, seed=seed)
    _, snapshots = read_back(path)
    got = [(s.time_seconds, sorted((g.index, None if g.utilization_ratio is None else round(g.utilization_ratio, 9),
                                    g.power_watts) for g in s.gpus)) for s in snapshots]
    assert got == written(path.read_text()), shape.described()


def test_blocks_with_absent_rows_are_judged_as_their_snapshots(tmp_path: Path) -> None:
    """Shapes whose blocks mark rows absent (dropped rows, a GPU out for half an hour) and whose rows come
    interleaved: the events and the learnt state are those of the same snapshots observed one at a time."""
    rng = random.Random(58)
    shapes = [s for s in (random_shape(rng) for _ in range(400)) if s.outage and s.dropped and s.gpus > 1]
    assert len(shapes) >= 3
    for n, shape in enumerate(shapes[:3]):
        path = tmp_path / f"day{n}.csv"
        with path.open("w") as f:
            write_random_day(f, shape, 30_000 * shape.interval, seed=n)
        items, snapshots = read_back(path)
        assert any(isinstance(item, SnapshotBlock) and item.present is not None for item in items), shape
        a, expected = one_by_one(Config(), snapshots)
        b, got = in_stretches(Config(), items, 0)
        assert got == expected, shape.described()
        assert any(e.signature.value == "busy_spin" for e in expected), shape.described()
        assert_same_state(a, b)


def test_a_sample_slow_to_print_stays_whole(tmp_path: Path) -> None:
    """nvidia-smi taking 100-120 ms a GPU (a busy node: a sample's 8 rows span 0.7-0.84 s at -l 1.7): each sample
    stays one sample of 8 GPUs, with none of its rows taken for the start of the next."""
    for spacing in (100, 120):
        lines = ["timestamp, index, utilization.gpu [%], power.draw [W], enforced.power.limit [W]"]
        for second in range(300):
            for gpu in range(8):
                ms = second * 1700 + gpu * spacing
                stamp = f"2025/07/27 00:{ms // 60_000:02d}:{ms // 1000 % 60:02d}.{ms % 1000:03d}"
                lines.append(f"{stamp}, {gpu}, 100 %, {300 + gpu + second % 100 / 100:.2f} W, 700.00 W")
        path = tmp_path / f"slow{spacing}.csv"
        path.write_text("\n".join(lines) + "\n")
        _, snapshots = read_back(path)
        assert len(snapshots) == 300
        assert all(sorted(g.index for g in s.gpus) == list(range(8)) for s in snapshots)
        assert all(g.power_watts is not None and int(g.power_watts) == 300 + g.index for s in snapshots for g in s.gpus)
