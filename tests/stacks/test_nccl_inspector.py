"""NCCL Inspector logs (stacks/nccl_inspector.py, rank_files.read_tail): the folder the plugin writes to, from the
variables it reads; its lines (the format of NCCL's plugins/profiler/inspector README) counted for their GPU time;
a rank's log followed from its end, a line not yet ended left for the next read, a recreated log read from its
start, a log past the cap read from its newest part; links, two logs and a FIFO refused; the sampler turning what
a log gained into timed counts on the rank's GPU."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.fakes.nccl_inspector import line
from watchdog.boundary import rank_files
from watchdog.boundary.rank_files import RankFileError
from watchdog.config import StacksConfig
from watchdog.stacks import nccl_inspector
from watchdog.stacks.capture import StackCapturer
from watchdog.stacks.nccl_inspector import InspectorTail, collective_micros, log_folder
from watchdog.stacks.sampling import RankSampler, SampleTarget
from watchdog.vocabulary.model import RANK_WAITS, GpuSample, NodeSnapshot


def p2p(exec_us: int) -> str:
    return json.dumps({"header": {"id": "0x1", "rank": 0, "n_ranks": 2, "nnodes": 1}, "metadata": {},
                       "p2p_perf": {"p2p_operation": "Send", "p2p_exec_time_us": exec_us}}) + "\n"


def test_the_folder_is_the_one_the_plugin_writes_to() -> None:
    assert log_folder({"NCCL_INSPECTOR_ENABLE": "1", "SLURM_JOBID": "9" * 5000}) == "nccl-inspector-unknown-jobid"
    assert log_folder({"NCCL_INSPECTOR_ENABLE": "1", "SLURM_JOBID": "0042"}) == "nccl-inspector-42"  # as strtol
    assert log_folder({"NCCL_INSPECTOR_ENABLE": "1", "NCCL_INSPECTOR_DUMP_DIR": "d" * 5000}) is None
    assert log_folder({}) is None
    assert log_folder({"NCCL_INSPECTOR_ENABLE": "0", "NCCL_INSPECTOR_DUMP_DIR": "/x"}) is None
    assert log_folder({"NCCL_INSPECTOR_ENABLE": "1", "NCCL_INSPECTOR_DUMP_DIR": "/logs/j1"}) == "/logs/j1"
    assert log_folder({"NCCL_INSPECTOR_ENABLE": "1", "SLURM_JOBID": "4242"}) == "nccl-inspector-4242"
    assert log_folder({"NCCL_INSPECTOR_ENABLE": "1", "SLURM_JOBID": "abc"}) == "nccl-inspector-unknown-jobid"
    assert log_folder({"NCCL_INSPECTOR_ENABLE": "1"}) == "nccl-inspector-unknown-jobid"
    assert log_folder({"NCCL_INSPECTOR_ENABLE": "1", "NCCL_INSPECTOR_PROM_DUMP": "1"}) is None  # averages only


def test_a_line_counts_its_collective_time_and_nothing_else_does() -> None:
    data = (line(0, 1, 61974) + line(0, 2, 41057, verbose=True) + p2p(5000)
            + '{"coll_perf": {"coll_exec_time_us": "12"}}\n'  # text, not a number
            + '{"coll_perf": {"coll_exec_time_us": 1234567890123456789}}\n'  # past any collective
            + "not json at all\n").encode()
    assert collective_micros(data) == (2, 61974 + 41057)


@contextmanager
def rank_in(folder: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A process of this test's user whose working directory holds `folder`, the way a rank's does."""
    process = subprocess.Popen(["sleep", "60"], cwd=folder.parent)
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def test_a_log_is_followed_from_its_end_in_whole_lines(tmp_path: Path) -> None:
    folder = tmp_path / "nccl-inspector-unknown-jobid"
    folder.mkdir()
    with rank_in(folder) as rank:
        log = folder / f"node-a-pid{rank.pid}.log"
        log.write_text(line(0, 1, 1000) * 50)  # before the watchdog looked: not counted
        tail = InspectorTail(rank.pid, folder.name)
        assert tail.read(10.0) is None
        with log.open("a") as out:
            out.write(line(0, 2, 400_000) + line(0, 3, 600_000) + line(0, 4, 999)[:40])  # the last not ended
        timed = tail.read(12.0)
        assert timed is not None and (timed.span_ms, timed.busy_ms, timed.collectives) == (2000, 1000, 2)
        with log.open("a") as out:
            out.write(line(0, 4, 999)[40:])
        assert tail.read(13.0).collectives == 1  # type: ignore[union-attr]  # the line, once ended
        assert tail.tail is not None and tail.tail.data == b""  # where it ended is kept, not what was read
        log.unlink()
        log.write_text(line(0, 1, 5_000_000) * 3)  # the log made anew (a restarted rank): from its start
        timed = tail.read(20.0)
        assert timed is not None and timed.collectives == 3 and timed.busy_ms == 7000  # at most the span


def test_a_log_past_the_cap_is_read_from_its_newest_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "insp"
    folder.mkdir()
    monkeypatch.setattr(nccl_inspector, "MAX_TAIL_BYTES", 4096)
    with rank_in(folder) as rank:
        log = folder / f"h-pid{rank.pid}.log"
        log.write_text("")
        tail = InspectorTail(rank.pid, folder.name)
        tail.read(0.0)
        one = line(1, 1, 100)
        log.write_text(one * 100)
        timed = tail.read(100.0)
        assert timed is not None
        read = 4096 // len(one)
        assert read - 1 <= timed.collectives <= read  # the newest whole lines, the first cut
        assert timed.busy_ms == pytest.approx(100 * 100 / 1000, rel=0.1)  # the rest counted by proportion
        assert tail.tail is not None and tail.tail.offset == log.stat().st_size


def test_links_fifos_and_two_logs_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "insp"
    folder.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with rank_in(folder) as rank:
        name = f"h-pid{rank.pid}.log"
        (elsewhere / name).write_text(line(0, 1, 1))
        (folder / name).symlink_to(elsewhere / name)
        with pytest.raises(RankFileError, match="link"):
            InspectorTail(rank.pid, folder.name).read(0.0)
        (folder / name).unlink()
        os.mkfifo(folder / name)
        with pytest.raises(RankFileError, match="not a regular file"):
            InspectorTail(rank.pid, folder.name).read(0.0)
        (folder / name).unlink()
        (tmp_path / "linked").symlink_to(elsewhere)
        with pytest.raises(RankFileError, match="link"):
            InspectorTail(rank.pid, "linked").read(0.0)
        (folder / name).write_text("")
        (folder / f"other-host-pid{rank.pid}.log").write_text("")
        with pytest.raises(RankFileError, match="2 logs"):
            InspectorTail(rank.pid, folder.name).read(0.0)
        with pytest.raises(RankFileError, match="'..' is refused"):
            rank_files.read_tail(rank.pid, "../elsewhere", name, None, 100)


def test_the_sampler_puts_timed_counts_on_the_ranks_gpu(tmp_path: Path) -> None:
    folder = tmp_path / "insp"
    folder.mkdir()
    clock = iter(float(t) for t in range(0, 10_000, 15))
    problems: list[tuple[int, str]] = []
    with rank_in(folder) as rank:
        log = folder / f"h-pid{rank.pid}.log"
        log.write_text("")
        target = SampleTarget(rank.pid, 1.0, (2,), 3, "job", inspector=folder.name)
        s = RankSampler(StackCapturer(), StacksConfig(sample_rate_hz=20, sample_seconds=2, sample_learn_seconds=10),
                        lambda: [target], on_problem=lambda pid, message: problems.append((pid, message)),
                        monotonic=lambda: next(clock))
        s.sample_once()  # where the log ends
        with log.open("a") as out:
            out.write(line(3, 1, 6_000_000) * 1)
        s.sample_once()  # 15 s on: 6 s of collectives
        with log.open("a") as out:
            out.write(line(3, 2, 3_000_000) * 2)
        s.sample_once()
        s.sample_once()  # nothing new: counts for nothing
        log.unlink()
        s.sample_once()  # the log gone: told once
        s.sample_once()
    reading = dict(zip(RANK_WAITS, s.annotate(NodeSnapshot(0.0, tuple(GpuSample(g) for g in range(3)))).gpus[2]
                       .nccl_waits))
    assert reading == {"job": reading["job"], "rank": 3, "samples": 30_000, "waits": 12_000, "planned": 0,
                       "first_samples": 15_000, "first_waits": 6_000}
    assert [m for _, m in problems if "Inspector" in m] == [
        next(m for _, m in problems if "Inspector" in m)]  # once, not at every record
    assert any("no logs named" in m for _, m in problems)


def test_the_log_is_the_one_of_the_host_the_rank_sees(tmp_path: Path) -> None:
    """A folder shared by two nodes' ranks of the same pid: the rank's own host names its log; with no host
    known, two logs are said, not guessed."""
    folder = tmp_path / "shared"
    folder.mkdir()
    with rank_in(folder) as rank:
        assert nccl_inspector.host_of(rank.pid, "claimed") == socket.gethostname()  # this host's namespace
        mine, theirs = folder / f"node-a-pid{rank.pid}.log", folder / f"node-b-pid{rank.pid}.log"
        mine.write_text("")
        theirs.write_text("")
        tail = InspectorTail(rank.pid, folder.name, host="node-a")
        tail.read(0.0)
        with theirs.open("a") as out:
            out.write(line(0, 1, 9_000_000))
        with mine.open("a") as out:
            out.write(line(0, 1, 1_000_000))
        timed = tail.read(10.0)
        assert timed is not None and timed.busy_ms == 1000
        with pytest.raises(RankFileError, match="2 logs"):
            InspectorTail(rank.pid, folder.name).read(0.0)


def test_a_log_is_checked_before_it_is_opened_to_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The log is opened O_PATH (nothing of a device's or a terminal's open runs), checked, and only then
    reopened to read: the first open of its name never reads."""
    folder = tmp_path / "insp"
    folder.mkdir()
    opened: list[tuple[str, int]] = []
    real_open = os.open

    def spy(path: object, flags: int, *args: object, **kwargs: object) -> int:
        opened.append((str(path), flags))
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    with rank_in(folder) as rank:
        log = folder / f"h-pid{rank.pid}.log"
        log.write_text(line(0, 1, 10))
        tail = InspectorTail(rank.pid, folder.name)
        tail.read(0.0)
        monkeypatch.setattr(os, "open", spy)
        tail.read(1.0)
        os.mkfifo(folder / f"g-pid{rank.pid}.log")
        log.unlink()
        opened.clear()
        with pytest.raises(RankFileError, match="not a regular file"):
            tail.read(2.0)
    by_name = [flags for path, flags in opened if path.endswith(".log")]
    assert by_name and all(flags & os.O_PATH for flags in by_name)
    assert not any(path.startswith("/proc/self/fd/") for path, _ in opened)  # the FIFO never reopened
