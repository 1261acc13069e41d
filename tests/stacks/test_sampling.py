"""The stack sampler (stacks/sampling.py) with real py-spy against a real gloo job: the rank its peers wait for
waits least in its samples; a process py-spy cannot read is told once; what a record prints is parsed as the
rank's own text (bounded, the main thread only); the daemon samples only proven ranks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from tests.conftest import TARGETS, wait_for
from watchdog.config import StacksConfig, parse_config
from watchdog.sample import sim
from watchdog.sample.ranks import RankDiscovery, RankInfo
from watchdog.service import build
from watchdog.stacks.capture import StackCapturer
from watchdog.stacks.sampling import PLANNED, WAITING, WORKING, RankSampler, SampleTarget, main_thread_samples
from watchdog.vocabulary.model import RANK_WAITS, GpuSample, NodeSnapshot


@contextmanager
def steady_job(tmp: Path, plan: dict, ranks: int = 3) -> Iterator[list[subprocess.Popen[str]]]:
    """tests/targets/straggler_job.py as `ranks` processes of this test (their launcher), stepping steadily."""
    (tmp / "control.json").write_text(json.dumps(plan))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    processes = []
    try:
        for rank in range(ranks):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": f"steady-{port}"}
            processes.append(subprocess.Popen([sys.executable, str(TARGETS / "straggler_job.py"),
                                               str(tmp / "control.json"), str(tmp)], env=env, text=True,
                                              stderr=subprocess.DEVNULL))
        wait_for([tmp / f"steps.{r}" for r in range(ranks)], processes=processes)
        time.sleep(1)
        yield processes
    finally:
        for p in processes:
            p.kill()
        for p in processes:
            p.wait()


def sampler(targets: list[SampleTarget], problems: list[tuple[int, str]] | None = None) -> RankSampler:
    cfg = StacksConfig(sample_rate_hz=20, sample_seconds=6, sample_learn_seconds=60)
    told = problems if problems is not None else []
    return RankSampler(StackCapturer(), cfg, lambda: targets,
                       on_problem=lambda pid, message: told.append((pid, message)))


def test_the_rank_its_peers_wait_for_waits_least(tmp_path: Path) -> None:
    with steady_job(tmp_path, {"slow": {"1": 1.6}}) as ranks:
        targets = [SampleTarget(p.pid, 1.0, (n,), n, "steady") for n, p in enumerate(ranks)]
        s = sampler(targets)
        s.sample_once()
    counts = {key[0]: c for key, c in s.counts.items()}
    share = {n: counts[p.pid].waits / counts[p.pid].samples for n, p in enumerate(ranks)}
    assert all(c.samples >= 80 for c in counts.values())  # 20 a second for 6 s, less py-spy's start
    assert share[1] + 0.15 < min(share[0], share[2]), share
    snapshot = s.annotate(NodeSnapshot(0.0, tuple(GpuSample(g) for g in range(4))))
    reading = dict(zip(RANK_WAITS, snapshot.gpus[1].rank_waits))
    assert reading["rank"] == 1 and reading["samples"] == counts[ranks[1].pid].samples
    assert reading["first_samples"] == reading["samples"]  # within its first look
    assert snapshot.gpus[3].rank_waits == ()  # no rank on it


def test_a_process_py_spy_cannot_read_is_told_once(tmp_path: Path) -> None:
    process = subprocess.Popen(["sleep", "60"])
    problems: list[tuple[int, str]] = []
    try:
        s = sampler([SampleTarget(process.pid, 1.0, (0,), 0, "j")], problems)
        s.cfg = StacksConfig(sample_rate_hz=20, sample_seconds=2)
        s.sample_once()
        s.sample_once()
    finally:
        process.kill()
        process.wait()
    assert [pid for pid, _ in problems] == [process.pid]
    assert "not a Python process" in problems[0][1] or "py-spy" in problems[0][1]
    assert s.annotate(NodeSnapshot(0.0, (GpuSample(0),))).gpus[0].rank_waits == ()


def test_only_the_main_thread_counts_and_odd_lines_are_not_believed() -> None:
    raw = "\n".join([
        "thread (42): MainThread;<module> (train.py:9);all_reduce (torch/distributed/distributed_c10d.py:3252) 30",
        "thread (42): MainThread;<module> (train.py:9);save (torch/serialization.py:600) 5",
        "thread (42);<module> (train.py:9);forward (model.py:10) 65",  # a thread with no name
        "thread (43): pin_memory;all_reduce (torch/distributed/distributed_c10d.py:1) 1000",  # another thread
        "thread (4242): MainThread;forward (model.py:10) 1000",  # another process's id
    ]).encode()
    assert main_thread_samples(raw, 42, most=100) == {WAITING: 30, PLANNED: 5, WORKING: 65}
    # A line that does not parse is what a thread name with a new line leaves: nothing of the record is believed.
    for odd in ("thread (42): a;b (c:1) many", "thread (42): a;b (c:1) \u00b2", "garbage without a count",
                "thread (42): x;y (z:1) 99999999999999999999"):
        assert main_thread_samples(raw + b"\n" + odd.encode(), 42, most=100) is None, odd
    # a count past what the record took (100 samples) is not believed either
    assert main_thread_samples(raw + b"\nthread (42): x;y (z:1) 999999", 42, most=100) is None


def test_a_thread_name_that_forges_main_thread_lines_is_not_believed(tmp_path: Path) -> None:
    """A real process names a worker thread with a new line and a main-thread line after it, and its main thread
    with a non-ASCII digit and a new line: py-spy prints both names as they are. The forged line would put the
    worker's samples on the main thread, in all_reduce; the sampler refuses the record (and says so once), and a
    rank beside it keeps its counts (the digit ended every rank's sampling round before)."""
    script = tmp_path / "forger.py"
    script.write_text(
        "import os, threading, time\n"
        "threading.current_thread().name = 'Main \u00b2\\nx'\n"
        "def spin():\n"
        "    while True: sum(range(100))\n"
        "threading.Thread(target=spin, name='w 1\\nthread (%d): MainThread;all_reduce "
        "(torch/distributed/distributed_c10d.py)' % os.getpid()).start()\n"
        "while True: sum(range(1000))\n")
    honest = tmp_path / "honest.py"
    honest.write_text("while True: sum(range(1000))\n")
    forger = subprocess.Popen([sys.executable, str(script)])
    plain = subprocess.Popen([sys.executable, str(honest)])
    problems: list[tuple[int, str]] = []
    try:
        time.sleep(1.0)
        s = sampler([SampleTarget(forger.pid, 1.0, (0,), 0, "j"), SampleTarget(plain.pid, 1.0, (1,), 1, "j")],
                    problems)
        s.cfg = StacksConfig(sample_rate_hz=20, sample_seconds=3)
        s.sample_once()
    finally:
        for p in (forger, plain):
            p.kill()
            p.wait()
    counts = {key[0]: c for key, c in s.counts.items()}
    assert forger.pid not in counts and [pid for pid, _ in problems] == [forger.pid], problems
    assert counts[plain.pid].samples >= 20 and counts[plain.pid].waits == 0


class _CountingDiscovery(RankDiscovery):
    def __init__(self) -> None:
        super().__init__()
        self.described: list[int] = []

    def describe(self, pid: int, *args: Any, **kwargs: Any) -> RankInfo | None:
        self.described.append(pid)
        return super().describe(pid, *args, **kwargs)


def test_the_daemon_samples_the_proven_ranks_on_its_gpus_described_once(tmp_path: Path) -> None:
    """The sampler's ranks are the descriptions the loop keeps by pid and start time: a rank with a huge
    command line is read once, not at every round (each round described every rank again before)."""
    discovery = _CountingDiscovery()
    with steady_job(tmp_path, {}) as ranks:
        scenario = sim.Scenario("t", "", "h100", 4, 600, ((0, None, "train"),))
        config = parse_config({"bundles": {"directory": str(tmp_path / "b"), "capture_stacks": False}})
        service = build(config, sim.SimSource(scenario, pids={n: [p.pid] for n, p in enumerate(ranks)}),
                        discovery=discovery)
        daemon = service.daemon
        daemon.tick()
        targets = list(daemon.sampler.targets())
        for _ in range(5):
            daemon.tick()
            daemon.sampler.targets()
        service.close(2)
    assert sorted((t.pid, t.gpus, t.rank) for t in targets) == [(p.pid, (n,), n) for n, p in enumerate(ranks)]
    assert len({t.job for t in targets}) == 1 and targets[0].job.startswith("launcher:")  # its proof, not its claim
    assert sorted(discovery.described) == sorted(p.pid for p in ranks), discovery.described


def _stand_in(tmp: Path, body: str) -> str:
    """A program in py-spy's place (the prefix stacks.py_spy_command allows): `body` runs with its arguments."""
    script = tmp / "py-spy"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    return str(script)


def test_a_record_that_writes_without_end_is_cut_at_its_bound(tmp_path: Path) -> None:
    # What a record prints is the rank's to choose (its names): an endless one is killed past 1 MiB.
    endless = _stand_in(tmp_path, 'for last; do :; done\nexec yes "thread (1): MainThread;f (x) 1" > "$last"')
    result, message, data = StackCapturer([endless], timeout_seconds=5).record(os.getpid(), 8, 2)
    assert (result, data) == ("failed", b"") and "over 1 MiB" in message  # cut at the cap, not read to its end


def test_a_record_that_never_ends_is_killed(tmp_path: Path) -> None:
    hung = _stand_in(tmp_path, "sleep 300")
    result, message, _ = StackCapturer([hung], timeout_seconds=0.5).record(os.getpid(), 8, 1)
    assert result == "timeout" and "killed" in message  # killed at its deadline: the result says so


class _Canned:
    """Stands in for py-spy's record: each pid's main thread in all_reduce for `waits` of 100 samples."""

    def __init__(self, waits: dict[int, int]):
        self.waits = waits

    def record(self, pid: int, rate: float, seconds: float) -> tuple[str, str, bytes]:
        w = self.waits[pid]
        return "ok", "ok", (f"thread ({pid}): MainThread;all_reduce (torch/distributed/distributed_c10d.py) {w}\n"
                            f"thread ({pid}): MainThread;forward (model.py) {100 - w}\n").encode()


def test_jobs_are_told_apart_by_their_proof_and_a_shared_gpu_keeps_its_training_job() -> None:
    """Two proven jobs are never one in the readings, whatever their names hash to (a CRC32 of the claimed name
    put a twin's ranks in the victim's job); a process of a small job on the training job's GPU (MPS,
    time-slicing) leaves that GPU's reading to the training job's rank (it removed the GPU before)."""
    targets = [SampleTarget(100 + n, 1.0, (n,), n, "launcher:7@1.00") for n in range(4)]
    targets.append(SampleTarget(200, 1.0, (2,), 0, "launcher:9@2.00"))  # another user's job, on GPU 2
    cfg = StacksConfig(sample_rate_hz=20, sample_seconds=5)
    s = RankSampler(_Canned({100: 60, 101: 60, 102: 10, 103: 60, 200: 50}), cfg,  # type: ignore[arg-type]
                    lambda: targets)
    s.sample_once()
    gpus = {g.index: dict(zip(RANK_WAITS, g.rank_waits))
            for g in s.annotate(NodeSnapshot(0.0, tuple(GpuSample(g) for g in range(4)))).gpus}
    assert {gpus[g]["job"] for g in range(4)} == {gpus[0]["job"]}  # the training job's four ranks, one job
    assert gpus[2]["rank"] == 2 and gpus[2]["waits"] == 10  # GPU 2 keeps the training job's rank
    again = RankSampler(_Canned({100: 60, 200: 50}), cfg, lambda: [targets[0], replace(targets[4], gpus=(5,))])
    again.sample_once()
    numbers = {g.index: g.rank_waits[RANK_WAITS.index("job")]
               for g in again.annotate(NodeSnapshot(0.0, (GpuSample(0), GpuSample(5)))).gpus}
    assert numbers[0] != numbers[5]


class _Counting(_Canned):
    """_Canned, counting each round's records; the pids in `slow` are records py-spy cannot finish."""

    def __init__(self, waits: dict[int, int], slow: set[int]):
        super().__init__(waits)
        self.slow, self.recorded = slow, []

    def record(self, pid: int, rate: float, seconds: float) -> tuple[str, str, bytes]:
        self.recorded.append(pid)
        if pid in self.slow:
            return "timeout", "py-spy record did not finish within 27.5 s; killed", b""
        return super().record(pid, rate, seconds)


def test_a_round_is_bounded_shared_by_jobs_and_a_rank_py_spy_cannot_keep_up_with_rests() -> None:
    """32 small ranks of one user and a 2-rank training job on one node: a round records at most max_parallel
    ranks (two waves of 16 stretched every round), the training job's ranks in every round, the 32 in turns; a
    rank whose record never finishes sits out 1, then 2, then 4 rounds, and is said once."""
    small = [SampleTarget(1000 + n, 1.0, (0,), n, "launcher:1@1.00") for n in range(32)]
    training = [SampleTarget(2000 + n, 1.0, (1 + n,), n, "launcher:2@2.00") for n in range(2)]
    slow = SampleTarget(3000, 1.0, (3,), 0, "launcher:3@3.00")
    capturer = _Counting({t.pid: 50 for t in (*small, *training, slow)}, {slow.pid})
    problems: list[tuple[int, str]] = []
    s = RankSampler(capturer, StacksConfig(sample_rate_hz=20, sample_seconds=5, max_parallel=16),  # type: ignore[arg-type]
                    lambda: [*small, *training, slow], on_problem=lambda pid, message: problems.append((pid, message)))
    rounds = []
    for _ in range(12):
        capturer.recorded = []
        s.sample_once()
        rounds.append(list(capturer.recorded))
    assert all(len(r) <= 16 for r in rounds)
    assert all({2000, 2001} <= set(r) for r in rounds)
    assert {t.pid for t in small} <= {pid for r in rounds[:8] for pid in r}  # every small rank within 8 rounds
    assert [n for n, r in enumerate(rounds) if slow.pid in r] == [0, 2, 5, 10]  # rests 1, 2, 4 rounds
    assert [pid for pid, _ in problems] == [slow.pid] and "sampled again after 1 round" in problems[0][1]
