"""End to end with real torch.distributed ranks on CPU (gloo), real py-spy, and the real command:
`stacks dump` must name the rank the others wait on, and tell a hang from a checkpoint wait."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, gloo_job


def stacks(*args: str) -> tuple[int, list[dict], str]:
    result = subprocess.run([sys.executable, "-m", "watchdog", "stacks", *args], capture_output=True, text=True,
                            timeout=120, cwd=REPO)
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return result.returncode, reports, result.stderr


def pid_args(processes: list[subprocess.Popen[str]]) -> list[str]:
    return [arg for p in processes for arg in ("--pid", str(p.pid))]


def test_rank_stuck_in_its_data_loader_is_named(tmp_path: Path) -> None:
    with gloo_job("dataloader", tmp_path, odd_rank=2) as ranks:
        code, (report,), _ = stacks("dump", "--json", *pid_args(ranks))
    assert code == 0
    assert report["outliers"] == ["rank 2"]
    odd = next(g for g in report["groups"] if g["members"] == ["rank 2"])
    assert odd["activity"] == "data_loading" and "FakeLoader.__next__" in odd["where"]
    waiting = next(g for g in report["groups"] if g["members"] == ["rank 0", "rank 1", "rank 3"])
    assert waiting["activity"] == "collective" and waiting["collective"] == "all_reduce"
    assert report["verdict"]["kind"] == "hang" and report["verdict"]["severity"] == "critical"
    assert report["summary"].startswith("3 of 4 ranks wait in all_reduce")
    assert f"rank 2 (pid {ranks[2].pid}) is in FakeLoader.__next__ -> Queue.get" in report["summary"]
    assert all(c["result"] == "ok" and not c["blocking"] for c in report["captures"])


def test_rank_in_a_different_collective_is_named(tmp_path: Path) -> None:
    with gloo_job("collective", tmp_path, odd_rank=1) as ranks:
        code, (report,), _ = stacks("dump", "--json", *pid_args(ranks))
    assert code == 0 and report["outliers"] == ["rank 1"]
    odd = next(g for g in report["groups"] if g["members"] == ["rank 1"])
    assert (odd["activity"], odd["collective"]) == ("collective", "broadcast")
    assert report["verdict"]["kind"] == "hang" and "another collective" in report["verdict"]["sentence"]


def test_rank_saving_a_checkpoint_is_a_wait_not_a_hang(tmp_path: Path) -> None:
    with gloo_job("checkpoint", tmp_path) as ranks:
        code, (report,), _ = stacks("dump", "--json", *pid_args(ranks))
    assert code == 0 and report["outliers"] == ["rank 0"]
    odd = next(g for g in report["groups"] if g["members"] == ["rank 0"])
    assert odd["activity"] == "checkpoint_io"
    assert report["verdict"]["kind"] == "waiting" and report["verdict"]["severity"] == "warning"
    assert report["host_activity"]["rank 0"]["write_bytes"] > 0


def test_all_finds_the_ranks_and_out_then_analyze_agrees(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    run_id = f"all-{os.getpid()}-{tmp_path.name}"
    with gloo_job("dataloader", job, odd_rank=3, env={"TORCHELASTIC_RUN_ID": run_id}) as ranks:
        # --all sees every training process on the machine, other jobs' too: --job keeps this test's own, so
        # a machine running other jobs neither slows it down nor has its processes captured.
        code, reports, _ = stacks("dump", "--all", "--job", f"run:{run_id}", "--json", "--out", str(tmp_path / "out"))
        assert code == 0
        missing, _, err = stacks("dump", "--all", "--job", "run:no-such-job")
    assert missing == 1 and "no ranks of run:no-such-job found; jobs seen:" in err and f"run:{run_id}" in err
    pids = {r.pid for r in ranks}
    (ours,) = reports
    assert {c["pid"] for c in ours["captures"]} == pids and ours["outliers"] == ["rank 3"]
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "analysis.json" in files and sum(f.startswith("rank-") for f in files) == 4
    assert all(((tmp_path / "out" / f).stat().st_mode & 0o777) == 0o600 for f in files)
    code, (again,), _ = stacks("analyze", str(tmp_path / "out"), "--json")
    assert code == 0 and again["outliers"] == ["rank 3"] and again["verdict"]["kind"] == "hang"
    assert len(ranks) == 4


def test_text_output_marks_the_outlier(tmp_path: Path) -> None:
    with gloo_job("dataloader", tmp_path, odd_rank=0) as ranks:
        result = subprocess.run([sys.executable, "-m", "watchdog", "stacks", "dump", *pid_args(ranks)],
                                capture_output=True, text=True, timeout=120, cwd=REPO)
    lines = result.stdout.splitlines()
    assert lines[1].startswith("  HANG (critical): 3 of 4 ranks wait in all_reduce")
    marked = [line for line in lines if line.startswith(" *")]
    assert len(marked) == 1 and "[rank 0]" in marked[0] and "data loading" in marked[0]
    assert "captured 4 of 4 ranks" in result.stdout


def test_a_healthy_fast_job_is_never_paged_from_looks_at_its_stacks(tmp_path: Path) -> None:
    """Two ranks stepping dozens of times a second sit inside all_reduce most of the time: one look often
    finds both there. Neither a live dump (which looks again before it says hang) nor `analyze` of the saved
    dumps (one look) may call that a critical hang."""
    out = tmp_path / "out"
    (tmp_path / "job").mkdir()
    with gloo_job("healthy", tmp_path / "job", ranks=2) as ranks:
        looks = [stacks("dump", "--json", *pid_args(ranks), *(["--out", str(out)] if n == 0 else []))
                 for n in range(3)]
    for code, (report,), _ in looks:
        assert code == 0 and report["verdict"]["severity"] != "critical", report["verdict"]
    code, (saved,), _ = stacks("analyze", str(out), "--json")
    assert code == 0 and saved["verdict"]["severity"] != "critical", saved["verdict"]
    if saved["verdict"]["kind"] == "hang":
        assert "One look" in saved["verdict"]["sentence"]
