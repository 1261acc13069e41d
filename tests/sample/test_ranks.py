"""Rank discovery against real processes, and a fixture /proc for what a real one cannot show."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import python_target
from watchdog.sample.proc_counters import HostActivity
from watchdog.sample.ranks import RankDiscovery, RankInfo, group_jobs
from watchdog.vocabulary.model import GpuSample, NodeSnapshot

RANK_ENV = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job-7", "CUDA_VISIBLE_DEVICES": "4,5",
            "NCCL_SOCKET_IFNAME": "eth0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "HF_TOKEN": "secret"}


def test_describes_a_launched_rank(tmp_path: Path) -> None:
    with python_target("queue", tmp_path, RANK_ENV) as process:
        info = RankDiscovery().describe(process.pid, gpus=(5,))
    assert info is not None
    assert (info.rank, info.local_rank, info.world_size) == (5, 1, 16)
    assert info.job_key == "run:job-7" and info.label == f"rank 5 (pid {process.pid}, GPU 5)"
    assert info.env["NCCL_SOCKET_IFNAME"] == "eth0" and info.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert "HF_TOKEN" not in info.env  # only launch and NCCL variables are kept
    assert info.cmdline[1].endswith("stuck.py")
    assert info.activity is not None and info.activity.cpu_seconds >= 0 and sum(info.activity.threads.values()) >= 1


def test_scan_finds_launched_ranks_and_guesses_their_gpu(tmp_path: Path) -> None:
    with python_target("queue", tmp_path, RANK_ENV) as process:
        found = {r.pid: r for r in RankDiscovery().scan()}
    assert process.pid in found and found[process.pid].gpus == (5,)  # LOCAL_RANK 1 of CUDA_VISIBLE_DEVICES 4,5


def test_maps_nvml_processes_to_gpus(tmp_path: Path) -> None:
    with python_target("queue", tmp_path, RANK_ENV) as process:
        snapshot = NodeSnapshot(0.0, (GpuSample(index=2, pids=(process.pid,)), GpuSample(index=3, pids=(99999999,))))
        discovery = RankDiscovery()
        (info,) = discovery.from_snapshot(snapshot)
    assert info.pid == process.pid and info.gpus == (2,)
    assert discovery.counters["gone"] == 1  # the pid NVML listed that no longer exists


def test_a_process_that_exits_and_a_reused_pid(tmp_path: Path) -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    discovery = RankDiscovery()
    assert discovery.describe(process.pid) is None and discovery.counters["gone"] == 1
    with python_target("queue", tmp_path) as live:
        info = discovery.describe(live.pid)
        assert info is not None
        assert discovery.describe(live.pid, expect_create_time=info.create_time - 100) is None
    assert discovery.counters["pid_reused"] == 1


def test_unreadable_environ_is_reported_not_fatal(tmp_path: Path) -> None:
    """A fixture /proc whose environ cannot be read (a directory in its place)."""
    with python_target("queue", tmp_path) as process:
        fake = tmp_path / "proc" / str(process.pid)
        (fake / "environ").mkdir(parents=True)
        (fake / "cgroup").write_text("0::/system.slice/docker-" + "ab" * 32 + ".scope\n")
        task = fake / "task" / "1"
        task.mkdir(parents=True)
        (task / "stat").write_text("1 (python (x) y) D 0 0")
        discovery = RankDiscovery(proc_root=tmp_path / "proc")
        info = discovery.describe(process.pid)
    assert info is not None and info.env == {} and info.problems and info.problems[0].startswith("environ:")
    assert discovery.counters["unreadable_environ"] == 1
    assert info.container == "ab" * 6  # the container id from the cgroup path
    assert info.activity is not None and info.activity.threads == {"D": 1}


def rank(pid: int, rank: int, world: int, key: str = "a") -> RankInfo:
    return RankInfo(pid, 0.0, (), (rank,), {"RANK": str(rank), "WORLD_SIZE": str(world),
                                            "TORCHELASTIC_RUN_ID": key}, None)


def test_jobs_group_by_run_and_know_when_they_span_nodes() -> None:
    jobs = group_jobs([rank(1, 1, 8), rank(2, 0, 8), rank(3, 0, 2, "b"), rank(4, 1, 2, "b")])
    by_key = {j.key: j for j in jobs}
    assert [r.rank for r in by_key["run:a"].ranks] == [0, 1]
    assert by_key["run:a"].spans_other_nodes and not by_key["run:b"].spans_other_nodes


def test_host_activity_deltas() -> None:
    before, after = HostActivity(1.0, 100, 1000), HostActivity(1.5, 100, 5000)
    delta = after.since(before)
    assert (delta.cpu_seconds, delta.read_bytes, delta.write_bytes) == (0.5, 0, 4000)
