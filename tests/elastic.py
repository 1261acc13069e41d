"""A real torchrun job (tests/targets/elastic_job.py) on simulated GPUs that follow it.

torchrun's elastic agent starts 4 workers (or as many as asked) and restarts them (--max-restarts 2) when one fails. The
simulated node has one GPU per worker, holding that worker's pid (found live: the agent's children
with LOCAL_RANK), and reads like a training GPU while the job makes progress and like a hang (the odd
GPU idle with memory held, the others spinning) when no rank has finished a step for a few seconds.
Used by tests/act/test_actions_torchrun.py and bench/act_restart.py.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from watchdog.sample import sim
from watchdog.vocabulary.model import NodeSnapshot

TARGET = Path(__file__).parent / "targets" / "elastic_job.py"
WORKERS = 4
ODD_RANK = 2
STILL_SECONDS = 3.0  # no step finished for this long: the GPUs read as hung


@contextmanager
def torchrun_job(work: Path, hangs: str, workers: int = WORKERS, odd_rank: int = ODD_RANK,
                 **env: str) -> Iterator[subprocess.Popen[bytes]]:
    """torchrun --nproc-per-node 4 --max-restarts 2 over the elastic target; killed with its workers at the end."""
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
         "--max-restarts=2", "--monitor-interval=0.5", str(TARGET), str(work)],
        # TMPDIR: torchrun's own log folders (torchelastic_*) go with the test's folder, not the machine's
        env={**os.environ, "HANGS": hangs, "ODD_RANK": str(odd_rank), "OMP_NUM_THREADS": "1", "TMPDIR": str(work),
             **env},
        stdout=(work / "torchrun.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield agent
    finally:
        for child in _tree(agent.pid):
            child.kill()
        agent.kill()
        agent.wait()


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def workers(agent: subprocess.Popen[bytes]) -> dict[int, list[int]]:
    """LOCAL_RANK -> [pid] of the agent's live workers."""
    found: dict[int, list[int]] = {}
    for child in _tree(agent.pid):
        try:
            local = child.environ().get("LOCAL_RANK")
            if local is not None and child.status() != psutil.STATUS_ZOMBIE:
                found.setdefault(int(local), []).append(child.pid)
        except psutil.Error:
            continue
    return found


def steps(work: Path) -> list[tuple[int, int]]:
    """(step, restart) of rank 0's finished steps, in order."""
    path = work / "progress-0"
    if not path.exists():
        return []
    return [(int(step), int(restart)) for step, restart in (line.split() for line in path.read_text().splitlines())]


def last_progress(work: Path) -> float:
    """Wall time of the latest finished step of any rank (0 before the first)."""
    times = [p.stat().st_mtime for p in work.glob("progress-*")]
    return max(times, default=0.0)


class FollowingSource:
    """Simulated H100s, one per worker, that follow the job: training while it steps, hung while it does not."""

    driver_version: str | None = "simulated"

    def __init__(self, agent: subprocess.Popen[bytes], work: Path, interval: float = 1.0, workers: int = WORKERS,
                 odd_rank: int = ODD_RANK):
        self.agent, self.work, self.interval, self.workers = agent, work, interval, workers
        self.t = 0.0
        self.rng = random.Random(7)
        self.training = sim.Scenario("following", "", "h100", workers, 1, ((0, None, "train"),), gpm=True)
        self.hung = sim.Scenario("following", "", "h100", workers, 1,
                                 ((0, None, "spin"), (0, (odd_rank,), "zero")), gpm=True)
        self.starting = sim.Scenario("following", "", "h100", workers, 1, ((0, None, "startup"),), gpm=True)
        self.hung_since: float | None = None  # wall time the GPUs started to read as hung
        self.stepped: tuple[float, dict[int, list[int]]] = (0.0, {})  # the last progress and who made it

    @property
    def gpu_count(self) -> int:
        return self.workers

    def open(self) -> None:
        return None

    def close(self) -> None:
        return None

    def sample(self) -> NodeSnapshot:
        now, last, pids = time.time(), last_progress(self.work), workers(self.agent)
        if last != self.stepped[0]:
            self.stepped = (last, pids)
        # Before its first step (or the first step after a restart) a job starts up; then it trains while it
        # steps, and reads as hung when it stops.
        starting = not last or pids != self.stepped[1]
        stepping = now - last < STILL_SECONDS
        if stepping or starting:
            self.hung_since = None
        elif self.hung_since is None:
            self.hung_since = now
        self.t += self.interval
        scenario = self.starting if starting else self.training if stepping else self.hung
        return sim.snapshot_at(scenario, self.t, self.rng, now, pids)
