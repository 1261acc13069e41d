"""deploy/slurm: the prolog and the epilog run as slurmd runs them (sh, the environment Slurm gives a
prolog or an epilog) against the real doctor and a live daemon serving /v1/dump over HTTP."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, gloo_job
from tests.fakes.daemon import daemon_config, stepping_clock
from tests.test_daemon import wait_for_looks
from watchdog.daemon import Daemon
from watchdog.sample import sim
from watchdog.service import Service, build
from watchdog.vocabulary.model import EpisodeEvent, EventKind, Severity, Signature

SLURM = REPO / "deploy" / "slurm"
JOB = f"7{os.getpid()}"  # one job id a test worker: the dump scans every process, other workers' ranks too


def slurm_env(script: str, **extra: str) -> dict[str, str]:
    """What slurmd gives a prolog or an epilog (no user environment), plus this checkout's PATH."""
    return {"PATH": os.environ["PATH"], "SLURM_JOB_ID": JOB, "SLURM_JOB_USER": "alice", "SLURM_JOB_UID": "1000",
            "SLURM_CLUSTER_NAME": "test", "SLURMD_NODENAME": "node-a", "SLURM_JOB_PARTITION": "gpu",
            "SLURM_SCRIPT_CONTEXT": f"{script}_slurmd", **extra}


def run_script(name: str, env: dict[str, str], timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["/bin/sh", str(SLURM / name)], env=env, capture_output=True, text=True, timeout=timeout)


def fake_doctor(tmp: Path, status: int, text: str) -> str:
    fake = tmp / "stall-watchdog"
    fake.write_text(f"#!/bin/sh\necho '{text}'\nexit {status}\n")
    fake.chmod(0o755)
    return str(fake)


def test_the_prolog_passes_a_healthy_node_with_the_real_doctor() -> None:
    result = run_script("prolog.sh", slurm_env("prolog"))
    assert result.returncode == 0, result.stderr


def test_the_prolog_drains_on_an_error_and_only_then(tmp_path: Path) -> None:
    drained = run_script("prolog.sh", slurm_env("prolog", STALL_WATCHDOG=fake_doctor(tmp_path, 4, "p2p: broken")))
    assert drained.returncode == 1
    assert "doctor found an error: draining" in drained.stderr and "p2p: broken" in drained.stderr
    warning = fake_doctor(tmp_path, 3, "acs: on")
    assert run_script("prolog.sh", slurm_env("prolog", STALL_WATCHDOG=warning)).returncode == 1  # a fake that says 3
    assert run_script("prolog.sh", slurm_env("prolog", STALL_WATCHDOG=fake_doctor(tmp_path, 0, "ok"))).returncode == 0
    broken = run_script("prolog.sh", slurm_env("prolog", STALL_WATCHDOG=fake_doctor(tmp_path, 1, "Traceback")))
    assert broken.returncode == 0 and "could not run (exit 1); not draining" in broken.stderr
    missing = run_script("prolog.sh", slurm_env("prolog", STALL_WATCHDOG=str(tmp_path / "nowhere")))
    assert missing.returncode == 0 and "not draining" in missing.stderr


def start(tmp: Path, pids: dict[int, list[int]], capture: bool, **dump: object) -> tuple[Daemon, Service]:
    config = daemon_config(tmp, source={"scenario": "odd_rank", "start_offset_seconds": 295, "pids": pids},
                           bundles={"capture_stacks": capture}, stacks={"observe_seconds": 0.3},
                           dump={"cooldown_seconds": 0, **dump})
    service = build(config, sim.SimSource(sim.SCENARIOS["odd_rank"], 1.0, 295, pids, clock=stepping_clock()))
    daemon = service.daemon
    daemon.tick()
    service.endpoint.start()
    return daemon, service


def epilogs(service: Service, *jobs: str) -> list[subprocess.CompletedProcess[str]]:
    """The epilog of each of these jobs against the live daemon, which is stopped afterwards."""
    try:
        return [run_script("epilog.sh", {**slurm_env("epilog", STALL_WATCHDOG_URL=service.endpoint.base_url),
                                         "SLURM_JOB_ID": job}) for job in jobs]
    finally:
        service.close()


def bundles(tmp: Path) -> list[dict[str, Any]]:
    folder = tmp / "incidents"
    return [json.loads((b / "summary.json").read_text()) for b in sorted(folder.glob("*-dump-*"))]


def test_the_epilog_dumps_a_job_that_is_still_there(tmp_path: Path) -> None:
    with gloo_job("dataloader", tmp_path, odd_rank=2, env={"SLURM_JOB_ID": JOB, "SLURM_STEP_ID": "0"}) as ranks:
        daemon, service = start(tmp_path, {g: [p.pid] for g, p in enumerate(ranks)}, capture=False)
        result, other = epilogs(service, JOB, "1")
    assert result.returncode == 0 and "last dump written" in result.stderr, result.stderr
    assert other.returncode == 0 and other.stderr == ""  # another job: a quiet 404
    [summary] = bundles(tmp_path)
    assert summary["slurm_job_id"] == JOB and summary["ended"] is False
    [job] = summary["jobs"]
    assert job["outliers"] == ["rank 2"]
    assert {r["workload"]["slurm_job_id"] for r in job["ranks"]} == {JOB}


@pytest.mark.parametrize("resolved", [False, True], ids=["episode open", "episode resolved by the kill"])
def test_the_epilog_keeps_the_last_look_of_a_job_killed_during_its_hang(tmp_path: Path, resolved: bool) -> None:
    with gloo_job("dataloader", tmp_path, odd_rank=2, env={"SLURM_JOB_ID": JOB}) as ranks:
        pids = {4: [ranks[2].pid], 0: [ranks[0].pid], 1: [ranks[1].pid], 2: [ranks[3].pid]}
        daemon, service = start(tmp_path, pids, capture=True)
        for _ in range(40):
            if daemon.incidents.open:
                break
            daemon.tick()
        wait_for_looks(daemon)
        for p in ranks:  # Slurm kills the job's processes before its epilog runs
            p.kill()
            p.wait()
        if resolved:  # the GPUs fall idle with the ranks gone, and the episode resolves before the epilog
            snapshot = daemon.published.snapshot
            assert snapshot is not None
            for key in list(daemon.incidents.open):
                daemon.incidents.handle(EpisodeEvent(EventKind.RESOLVED, Signature.WAITING, Severity.WARNING, (4,),
                                                     (), 0.0, 1.0, "resolved", key=key), snapshot, [])
            assert not daemon.incidents.open
        result, unrelated = epilogs(service, JOB, "999")
    assert result.returncode == 0 and "last dump written" in result.stderr, result.stderr
    assert unrelated.returncode == 0 and unrelated.stderr == ""
    [summary] = bundles(tmp_path)
    assert summary["ended"] is True and "ranks are gone" in summary["note"]
    [job] = summary["jobs"]
    assert job["outliers"] == ["rank 2"] and len(job["ranks"]) == 4


DEFAULT_TOKEN = Path("/etc/stall-watchdog/dump.token")  # where epilog.sh looks when slurmd names none


def test_the_epilog_sends_the_token_from_its_default_place(tmp_path: Path) -> None:
    """slurmd passes an epilog no variable of ours: with dumps behind a token (the default: no open loopback),
    the epilog finds it at /etc/stall-watchdog/dump.token and is answered, and without it says what to do."""
    made = not DEFAULT_TOKEN.exists()
    if made:
        DEFAULT_TOKEN.parent.mkdir(parents=True, exist_ok=True)
        DEFAULT_TOKEN.write_text("epilog-token-for-tests\n")
        DEFAULT_TOKEN.chmod(0o600)
    try:
        with gloo_job("dataloader", tmp_path, odd_rank=2, env={"SLURM_JOB_ID": JOB}) as ranks:
            daemon, service = start(tmp_path, {g: [p.pid] for g, p in enumerate(ranks)}, capture=False,
                                     open_on_loopback=False, token_file=str(DEFAULT_TOKEN))
            [result] = epilogs(service, JOB)
        assert result.returncode == 0 and "last dump written" in result.stderr, result.stderr
        daemon, service = start(tmp_path, {}, capture=False, open_on_loopback=False, token_file=str(DEFAULT_TOKEN))
        try:  # a token file that is not there: refused, and the epilog says where the token goes
            refused = run_script("epilog.sh", slurm_env("epilog", STALL_WATCHDOG_URL=service.endpoint.base_url,
                                                        STALL_WATCHDOG_TOKEN_FILE=str(tmp_path / "absent")))
        finally:
            service.close()
    finally:
        if made:
            DEFAULT_TOKEN.unlink()
            with contextlib.suppress(OSError):
                DEFAULT_TOKEN.parent.rmdir()
    assert refused.returncode == 0 and "refused the dump (HTTP 401)" in refused.stderr, refused.stderr
    assert "epilog-token" not in refused.stderr + result.stderr


def test_the_epilog_never_fails_the_job(tmp_path: Path) -> None:
    for env in (slurm_env("epilog", STALL_WATCHDOG_URL="http://127.0.0.1:9"),  # no daemon
                {**slurm_env("epilog"), "SLURM_JOB_ID": '1", "x": "'},  # not a job id: never sent
                {key: value for key, value in slurm_env("epilog").items() if key != "SLURM_JOB_ID"}):
        result = run_script("epilog.sh", env)  # returns (the script's own bounds end it), exit 0, with why
        assert result.returncode == 0 and result.stderr, env
