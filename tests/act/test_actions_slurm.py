"""The `slurm` action under a real single-node Slurm (tests/slurm.py): a hung `sbatch --requeue` job is
requeued, the node is drained with the daemon's reason and resumed only while that reason is still ours;
deploy/slurm's prolog and epilog run as slurmd runs them."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import TARGETS
from tests.fakes.daemon import daemon_config, stepping_clock
from tests.slurm import Slurm, hung_job, slurm_cluster
from watchdog.daemon import Daemon
from watchdog.sample import sim
from watchdog.service import build

HANG_AT = 300.0  # sim.SCENARIOS["zero_util_hang"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def act_on(tmp: Path, slurm: Slurm, pid: int, **slurm_action: object) -> Daemon:
    offset = HANG_AT - 5
    config = daemon_config(
        tmp, source={"scenario": "zero_util_hang", "start_offset_seconds": offset, "pids": {0: [pid]}},
        bundles={"capture_stacks": True}, stacks={"observe_seconds": 0.3},
        actions={"mode": "act", "after_seconds": 10, "do": ["slurm"], "pause_file": str(tmp / "pause"),
                 "slurm": {"conf": slurm.env["SLURM_CONF"], "node_name": slurm.node, **slurm_action}})
    clock = stepping_clock(1.9e9 + offset)
    service = build(config, sim.SimSource(sim.SCENARIOS["zero_util_hang"], 1.0, offset, {0: [pid]}, clock=clock))
    daemon = service.daemon
    deadline = time.monotonic() + 120
    while not daemon.counters.snapshot()["actions_total"]:
        assert time.monotonic() < deadline, "no action within 2 minutes"
        daemon.tick()
        time.sleep(0.1)
    service.close(timeout=15)
    return daemon


def test_a_hung_requeueable_job_is_requeued_and_the_node_drained_with_our_reason(slurm: Slurm, tmp_path: Path) -> None:
    job, pid = hung_job(slurm, tmp_path)
    try:
        _requeued_and_drained(slurm, tmp_path, job, pid)
    finally:  # a failure here leaves the node to the next test as it found it: not drained, the job gone
        slurm.run("scontrol", "update", f"NodeName={slurm.node}", "State=RESUME", check=False)
        slurm.run("scancel", job, check=False)


def _requeued_and_drained(slurm: Slurm, tmp_path: Path, job: str, pid: int) -> None:
    assert job in (slurm.folder / "prolog.ran").read_text().split()  # deploy/slurm/prolog.sh ran for it
    daemon = act_on(tmp_path, slurm, pid, job="requeue", drain=True)
    assert daemon.counters.get("actions_total", "slurm", "done") == 1
    # requeued: once Slurm has cleaned up its old run (COMPLETING), waiting or running again
    shown = slurm.wait_job(job, ("PENDING", "REQUEUED", "REQUEUE_HOLD", "RUNNING"), seconds=30)
    assert shown["Restarts"] == "1", shown
    node = slurm.node_state()
    assert "DRAIN" in node["State"] and node["Reason"].startswith("stall-watchdog: hang of job " + job), node
    deadline = time.monotonic() + 30
    while job not in (slurm.folder / "epilog.ran").read_text().split() if (slurm.folder / "epilog.ran").exists() \
            else True:
        assert time.monotonic() < deadline, "deploy/slurm/epilog.sh did not run when the job ended"
        time.sleep(0.3)

    # Our drain is ours to undo; a person's drain is not.
    assert daemon.responder.actions.resume_drained() == [slurm.node]
    assert "DRAIN" not in slurm.node_state()["State"]
    slurm.run("scontrol", "update", f"NodeName={slurm.node}", "State=DRAIN", "Reason=maintenance by a person")
    daemon.responder.actions.drained.add(slurm.node)
    assert daemon.responder.actions.resume_drained() == []
    assert slurm.node_state()["Reason"].startswith("maintenance by a person")


def test_a_job_id_only_the_rank_claims_is_never_requeued(slurm: Slurm, tmp_path: Path) -> None:
    """A process outside Slurm that sets SLURM_JOB_ID names a job it does not belong to: it is left alone."""
    victim, _ = hung_job(slurm, tmp_path)
    ready = tmp_path / "ready-outsider"
    import subprocess
    outsider = subprocess.Popen([sys.executable, str(TARGETS / "stuck.py"), "queue", str(ready)],
                                env={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": victim, "RANK": "0", "WORLD_SIZE": "1"})
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        daemon = act_on(tmp_path, slurm, outsider.pid, job="requeue")
    finally:
        outsider.kill()
        outsider.wait()
    assert daemon.counters.get("actions_total", "slurm", "skipped") == 1
    assert slurm.job(victim)["Restarts"] == "0"
    slurm.run("scancel", victim)


def test_a_cgroup_a_user_named_after_a_job_gets_no_job_requeued(slurm: Slurm, tmp_path: Path) -> None:
    """A process in a cgroup of a user's delegated subtree named `job_<id>.scope`, after a real running job:
    only slurmstepd's own hierarchy names a Slurm job, so the job is neither requeued nor the node drained."""
    import subprocess
    victim, _ = hung_job(slurm, tmp_path)
    root = Path("/sys/fs/cgroup/freezer")
    forged = root / "user.slice" / "user-1001.slice" / "user@1001.service" / "app.slice" / f"job_{victim}.scope"
    ready = tmp_path / "ready-forged"
    outsider = subprocess.Popen([sys.executable, str(TARGETS / "stuck.py"), "queue", str(ready)],
                                env={"PATH": "/usr/bin:/bin", "RANK": "0", "WORLD_SIZE": "1"})
    try:
        forged.mkdir(parents=True)
        (forged / "cgroup.procs").write_text(str(outsider.pid))
        assert f"/job_{victim}.scope" in Path(f"/proc/{outsider.pid}/cgroup").read_text()
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        daemon = act_on(tmp_path, slurm, outsider.pid, job="requeue", drain=True)
    finally:
        outsider.kill()
        outsider.wait()
        for folder in (forged, *forged.parents):
            if folder == root:
                break
            folder.rmdir()
    assert daemon.counters.get("actions_total", "slurm", "skipped") == 1
    assert slurm.job(victim)["Restarts"] == "0"
    assert "DRAIN" not in slurm.node_state()["State"]
    slurm.run("scancel", victim)


def test_slurm_confirms_a_job_and_its_user_whatever_the_job_calls_itself(slurm: Slurm, tmp_path: Path) -> None:
    """What membership asks Slurm (squeue, a fixed format): a job named and commented to look like another
    user's running job is still its own user's."""
    from watchdog.act.actions import Actions
    from watchdog.config import ActionsConfig
    script = tmp_path / "named.sh"
    script.write_text("#!/bin/sh\nsleep 60\n")
    script.chmod(0o755)
    job = slurm.run("sbatch", "--parsable", "-J", "x UserId=1001(1001) JobState=RUNNING", "--comment",
                    "JobId=999 UserId=nobody(1001)", "-o", "/dev/null", str(script)).strip()
    try:
        slurm.wait_job(job, ("RUNNING",), seconds=30)
        ask = Actions(ActionsConfig(mode="act", slurm={"conf": slurm.env["SLURM_CONF"]})).slurm_job_runs_as
        assert ask(job, 0) is None
        assert ask(job, 1001) == f"Slurm says job {job} runs as uid 0, not as uid 1001"
        assert ask("987654", 0).startswith("squeue --jobs 987654: ")  # type: ignore[union-attr]
    finally:
        slurm.run("scancel", job, check=False)
