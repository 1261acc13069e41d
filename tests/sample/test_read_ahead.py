"""A trace read by a second process (what `replay` of one trace does on a machine with two cores): the
same snapshots, flags, skips and errors, in the same order, as reading it here; a reader that dies or
fails is an error, and leaving early leaves no process behind."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest

from watchdog.sample import read_ahead, recording, sim
from watchdog.sample.errors import TraceError
from watchdog.sample.replay import open_trace
from watchdog.vocabulary.model import NodeSnapshot, SnapshotBlock

pytestmark = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork()")


def _csv(path: Path, snapshots: list[NodeSnapshot], broken_at: int | None = None) -> Path:
    lines = ["timestamp, index, utilization.gpu [%], power.draw [W]"]
    for n, snapshot in enumerate(snapshots):
        stamp = time.strftime("%Y/%m/%d %H:%M:%S.000", time.gmtime(snapshot.time_seconds))
        for g in snapshot.gpus:
            lines.append(f"{stamp}, {g.index}, {round((g.utilization_ratio or 0) * 100)} %, {g.power_watts or 0:.2f} W")
        if n == broken_at:
            lines.append(f"{stamp}, 9, lots %, 1 W")
    path.write_text("\n".join(lines) + "\n")
    return path


def _jsonl(path: Path, snapshots: list[NodeSnapshot]) -> Path:
    with path.open("w") as f:
        recording.write(f, recording.header("test", "now"), snapshots)
    return path


SNAPSHOTS = list(sim.run(sim.SCENARIOS["odd_rank"]))


def _read(opener, spec: str, **options):  # type: ignore[no-untyped-def]
    """Everything a reader hands on, then how it ended: ("ok" | the error, naive_time, skips)."""
    got: list[NodeSnapshot] = []
    try:
        with opener(spec, **options) as trace:
            try:
                for item in trace.stretches:
                    got.extend(item.snapshots() if isinstance(item, SnapshotBlock) else [item])
            except TraceError as exc:
                return got, str(exc), trace.naive_time, (trace.skips.count, trace.skips.first)
            return got, "ok", trace.naive_time, (trace.skips.count, trace.skips.first)
    except TraceError as exc:
        return got, str(exc), None, None


@pytest.mark.parametrize("kind", ["csv", "jsonl", "broken csv", "broken csv lenient", "missing", "not a trace"])
def test_read_ahead_hands_on_what_reading_here_does(tmp_path: Path, kind: str) -> None:
    options = {"lenient": kind.endswith("lenient")}
    if kind == "csv":
        spec = str(_csv(tmp_path / "a.csv", SNAPSHOTS))
    elif kind == "jsonl":
        spec = str(_jsonl(tmp_path / "a.jsonl", SNAPSHOTS))
    elif kind.startswith("broken csv"):
        spec = str(_csv(tmp_path / "a.csv", SNAPSHOTS, broken_at=700))
    elif kind == "missing":
        spec = str(tmp_path / "nothing.csv")
    else:
        (tmp_path / "a.csv").write_text("hello\nworld\n")
        spec = str(tmp_path / "a.csv")
    here = _read(open_trace, spec, **options)
    ahead = _read(read_ahead.open_trace_ahead, spec, **options)
    assert ahead == here
    if kind in ("csv", "jsonl", "broken csv lenient"):
        assert len(here[0]) == len(SNAPSHOTS) and here[1] == "ok"
    if kind == "broken csv":
        # The snapshots before the bad line's (still open when it came), then its error.
        assert len(here[0]) == 700 and "a.csv:" in here[1]
    if kind == "broken csv lenient":
        assert here[3][0] == 1


def _reader() -> multiprocessing.process.BaseProcess:
    (child,) = [p for p in multiprocessing.active_children() if p.name == "stall-watchdog trace reader"]
    return child


def test_a_reader_killed_midway_is_an_error_not_a_hang(tmp_path: Path) -> None:
    spec = str(_csv(tmp_path / "a.csv", SNAPSHOTS * 20))
    with pytest.raises(read_ahead.ReaderFailed, match="exit code -9"), read_ahead.open_trace_ahead(spec) as trace:
        items = iter(trace.stretches)
        next(items)
        os.kill(_reader().pid or 0, signal.SIGKILL)
        for _ in items:
            pass
    assert not multiprocessing.active_children()


def test_a_reader_that_fails_says_how(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in the reader")

    monkeypatch.setattr(read_ahead, "open_trace", broken)  # the forked reader runs it
    with pytest.raises(read_ahead.ReaderFailed, match="RuntimeError: a bug in the reader"), \
            read_ahead.open_trace_ahead(str(_csv(tmp_path / "a.csv", SNAPSHOTS))):
        pass


def test_leaving_early_stops_the_reader(tmp_path: Path) -> None:
    spec = str(_csv(tmp_path / "a.csv", SNAPSHOTS * 40))
    with read_ahead.open_trace_ahead(spec) as trace:
        next(iter(trace.stretches))
        reader = _reader()
        time.sleep(0.5)  # the reader runs ahead until the pipe is full, and waits
    assert not reader.is_alive() and not multiprocessing.active_children()


def test_the_replay_takes_in_a_bounded_number_of_messages_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever has arrived is taken in when a message is wanted, up to _AHEAD_BYTES; in order, then the end."""
    size = len(ForkingPickler.dumps(("items", [0])))  # as Connection.send pickles each of these
    monkeypatch.setattr(read_ahead, "_AHEAD_BYTES", 2 * size + 1)  # room for a third to be taken in
    context = multiprocessing.get_context("fork")
    receiving, sending = context.Pipe(duplex=False)

    def send() -> None:
        for n in range(10):
            sending.send(("items", [n]))

    sender = context.Process(target=send)
    sender.start()
    sending.close()
    sender.join()  # all ten wait in the pipe
    inbox = read_ahead._Inbox(receiving, sender)
    assert inbox.take() == ("items", [0])
    assert len(inbox._waiting) == 2  # three taken in, one handed on
    assert [inbox.take() for _ in range(9)] == [("items", [n]) for n in range(1, 10)]
    with pytest.raises(read_ahead.ReaderFailed, match="exit code 0"):
        inbox.take()
    receiving.close()


def test_replay_prints_the_same_with_and_without_a_reading_process(tmp_path: Path) -> None:
    """The command: one trace read ahead (the default with two cores) or in one process (--jobs 1)."""
    traces = [_csv(tmp_path / "a.csv", SNAPSHOTS), _jsonl(tmp_path / "a.jsonl", SNAPSHOTS),
              _csv(tmp_path / "b.csv", SNAPSHOTS, broken_at=1200)]
    for trace in traces:
        runs = [subprocess.run([sys.executable, "-m", "watchdog", "replay", str(trace), *jobs],
                               capture_output=True, text=True, timeout=120) for jobs in ([], ["--jobs", "1"])]
        assert [(r.returncode, r.stdout, r.stderr) for r in runs[:1]] == [(r.returncode, r.stdout, r.stderr)
                                                                         for r in runs[1:]]
        assert "FIRED" in runs[0].stdout
    assert runs[0].returncode == 1 and "b.csv:" in runs[0].stderr
