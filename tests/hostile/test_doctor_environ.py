"""The doctor's job checks say only what the ranks' environments show: a rank's variables, read, are reported as
set; an environment that could not be read (another user's rank without the capabilities, root with every
capability dropped) makes each job check "unknown" with why, never "unset" and never ok. Real processes, the
real CLI, run as root, as another user and as a capability-less root."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.users import ALICE, BOB, portable_install, shared_folder, user_process, with_capabilities

# What the reviewer's rank set: NCCL_DEBUG and the whole Flight Recorder
RANK_ENV = {"NCCL_DEBUG": "INFO", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/tmp/p_", "RANK": "0", "WORLD_SIZE": "2"}
# The findings the job checks make (doctor/checks.py JOB_CHECKS), under any of their names
JOB_FINDINGS = {"job_environment", "socket_ifname", "ib_disable", "p2p_settings", "diagnosis_settings", "nccl_debug",
                "timeouts", "flight_recorder", "visible_devices", "job_consistency", "job_gpu_models",
                "job_nccl_settings"}


@pytest.fixture(scope="module")
def install() -> Iterator[tuple[Path, dict[str, str]]]:
    with shared_folder() as folder:
        yield folder, portable_install(folder)


def doctor(install: tuple[Path, dict[str, str]], pid: int, caps: list[str] | None = None,
           uid: int | None = None) -> list[dict[str, str]]:
    """`doctor --pid PID --json`'s findings: as root with every capability (caps None), else under setpriv with
    exactly `caps`, as `uid` (None: root)."""
    folder, env = install
    argv = ["/usr/bin/python3", "-m", "watchdog", "doctor", "--pid", str(pid), "--json"]
    if caps is not None:
        argv = with_capabilities(argv, caps, uid)
    done = subprocess.run(argv, env=env, cwd=folder, capture_output=True, text=True, timeout=120)
    assert done.returncode in (0, 4), done.stderr
    [line] = done.stdout.splitlines()
    findings: list[dict[str, str]] = json.loads(line)["findings"]
    return findings


def by_check(findings: list[dict[str, str]]) -> dict[str, dict[str, str]]:
    return {f["check"]: f for f in findings}


def assert_read(findings: list[dict[str, str]]) -> None:
    seen = by_check(findings)
    assert not [f for f in findings if "unset" in f["evidence"]], findings
    assert seen["nccl_debug"]["severity"] == "ok" and "NCCL_DEBUG=INFO" in seen["nccl_debug"]["evidence"], seen
    recorder = seen["flight_recorder"]
    assert recorder["severity"] == "ok", recorder
    for name in ("TORCH_NCCL_TRACE_BUFFER_SIZE=2000", "TORCH_NCCL_DUMP_ON_TIMEOUT=1",
                 "TORCH_NCCL_DEBUG_INFO_PIPE_FILE=/tmp/p_"):
        assert name in recorder["evidence"], recorder


def assert_unknown(findings: list[dict[str, str]], pid: int) -> None:
    jobs = [f for f in findings if f["check"] in JOB_FINDINGS]
    assert not [f for f in findings if "unset" in f["evidence"]], findings
    assert jobs and all(f["severity"] == "unknown" for f in jobs), jobs
    for check in ("diagnosis_settings", "ib_disable", "p2p_settings", "socket_ifname"):
        assert by_check(findings)[check]["evidence"] == "not checked: no rank's environment could be read"
    why = by_check(findings)["job_environment"]
    assert why["severity"] == "unknown" and f"pid {pid}: environ: permission denied" in why["evidence"], why


def test_a_ranks_variables_read_are_reported_as_set(install: tuple[Path, dict[str, str]]) -> None:
    """As root: the rank's own process (root's) and another user's."""
    mine = subprocess.Popen(["/bin/sleep", "300"], env={"PATH": "/usr/bin:/bin", **RANK_ENV})
    try:
        assert_read(doctor(install, mine.pid))
    finally:
        mine.kill()
        mine.wait()
    with user_process(install[0], ALICE, ["queue"], RANK_ENV) as rank:
        assert_read(doctor(install, rank.pid))


def test_an_environment_not_read_makes_every_job_check_unknown(install: tuple[Path, dict[str, str]]) -> None:
    """Another user without capabilities (/proc/<pid>/environ is 0400), and root with every capability dropped
    reading a root process that holds them (the kernel refuses a less privileged reader)."""
    with user_process(install[0], ALICE, ["queue"], RANK_ENV) as rank:
        assert_unknown(doctor(install, rank.pid, [], BOB), rank.pid)
    mine = subprocess.Popen(["/bin/sleep", "300"], env={"PATH": "/usr/bin:/bin", **RANK_ENV})
    try:
        assert os.getuid() == 0
        assert_unknown(doctor(install, mine.pid, [], None), mine.pid)
    finally:
        mine.kill()
        mine.wait()


PARTIAL = """
import json, sys
from watchdog.doctor.job_checks import job_findings
from watchdog.doctor.facts import NodeFacts
from watchdog.sample.ranks import RankDiscovery
ranks = [RankDiscovery().describe(int(pid)) for pid in sys.argv[1:]]
print(json.dumps([f.to_json() for f in job_findings(ranks, NodeFacts())]))
"""


def test_a_job_read_in_part_is_checked_on_what_was_read_and_says_what_was_not(
        install: tuple[Path, dict[str, str]]) -> None:
    """Bob reads his own rank and not Alice's: the checks judge Bob's, and one finding names Alice's as unread."""
    folder, env = install
    with user_process(folder, ALICE, ["queue"], RANK_ENV) as theirs, \
            user_process(folder, BOB, ["queue"], {**RANK_ENV, "RANK": "1"}) as own:
        done = subprocess.run(with_capabilities(["/usr/bin/python3", "-c", PARTIAL, str(own.pid), str(theirs.pid)],
                                                [], BOB), env=env, cwd=folder, capture_output=True, text=True,
                              timeout=120)
    assert done.returncode == 0, done.stderr
    findings = json.loads(done.stdout)
    assert_read(findings)
    unread = by_check(findings)["job_environment"]
    assert unread["severity"] == "unknown" and f"pid {theirs.pid}" in unread["evidence"], unread
    assert "1 of 2 ranks" in unread["evidence"] and f"pid {own.pid}" not in unread["evidence"], unread
