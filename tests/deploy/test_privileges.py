"""The daemon under exactly the privileges the shipped units give it, against ranks of another user: the
systemd unit's dynamic user (a non-root uid with the unit's ambient capabilities, with and without the
actions drop-in) and the DaemonSet's root with every capability dropped but those it adds. What each can
do is the README's privilege table ("Security: what the daemon promises")."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.users import ALICE, BOB, portable_install, shared_folder, unit_capabilities, user_process, with_capabilities

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNIT = DEPLOY / "systemd" / "stall-watchdog.service"
DROP_IN = DEPLOY / "systemd" / "actions.conf"
DYNAMIC_USER = 61234  # what systemd's DynamicUser picks from (61184-65519): no account, no group
RANK = {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "alice-run"}


def daemonset_capabilities() -> list[str]:
    documents = yaml.safe_load_all((DEPLOY / "kubernetes" / "daemonset.yaml").read_text())
    [daemonset] = [d for d in documents if d and d.get("kind") == "DaemonSet"]
    [main] = [c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == "stall-watchdog"]
    return [c.lower() for c in main["securityContext"]["capabilities"]["add"]]


@pytest.fixture(scope="module")
def install() -> Iterator[tuple[Path, dict[str, str]]]:
    with shared_folder() as folder:
        yield folder, portable_install(folder)


def run_as(install: tuple[Path, dict[str, str]], caps: list[str], uid: int | None, *args: str,
           python: str = "/usr/bin/python3") -> subprocess.CompletedProcess[str]:
    folder, env = install
    return subprocess.run(with_capabilities([python, *args], caps, uid), env=env, cwd=folder, capture_output=True,
                          text=True, timeout=120)


def dump(install: tuple[Path, dict[str, str]], caps: list[str], uid: int | None, pid: int) -> dict[str, object]:
    done = run_as(install, caps, uid, "-m", "watchdog", "stacks", "dump", "--pid", str(pid), "--json")
    assert done.returncode in (0, 1), done.stderr
    found: dict[str, object] = json.loads(done.stdout.splitlines()[0])
    return found


@pytest.mark.parametrize("who", ["systemd unit", "DaemonSet"])
def test_the_shipped_privileges_read_another_users_ranks_identity_and_stacks(
        install: tuple[Path, dict[str, str]], who: str) -> None:
    caps, uid = (unit_capabilities(UNIT), DYNAMIC_USER) if who == "systemd unit" else (daemonset_capabilities(), None)
    with user_process(install[0], ALICE, ["queue"], RANK) as rank:
        seen = dump(install, caps, uid, rank.pid)
    assert seen["job"] == "run:alice-run" and seen["world_size"] == 4, seen
    [capture] = seen["captures"]  # type: ignore[misc]
    assert capture["result"] == "ok" and capture["rank"] == 3, capture
    assert "Queue.get" in json.dumps(seen["groups"])


def test_ptrace_alone_cannot_name_another_users_rank(install: tuple[Path, dict[str, str]]) -> None:
    """What the units shipped before: py-spy reads the stacks, but /proc/<pid>/environ (0400) is refused, so
    the rank has no rank and no job; the daemon says which capability is missing."""
    with user_process(install[0], ALICE, ["queue"], RANK) as rank:
        seen = dump(install, ["sys_ptrace"], DYNAMIC_USER, rank.pid)
        assert seen["job"] == "unlaunched" and seen["captures"][0]["rank"] is None  # type: ignore[index]
        # Without CAP_SYS_PTRACE no stack is read: the verdict's sentence, which the alert carries, says why.
        blind = dump(install, ["dac_read_search"], DYNAMIC_USER, rank.pid)
        sentence = blind["verdict"]["sentence"]  # type: ignore[index]
        assert "No stack was captured (1 of 1 ranks)" in sentence and "CAP_SYS_PTRACE" in sentence, sentence
        config = install[0] / "config.yaml"
        config.write_text("source: {kind: sim, scenario: healthy}\n")
        config.chmod(0o644)
        checked = run_as(install, ["sys_ptrace"], DYNAMIC_USER, "-m", "watchdog", "check-config", str(config))
    assert checked.returncode == 0, checked.stderr
    assert "lacks CAP_DAC_READ_SEARCH" in checked.stderr and "no rank and no job" in checked.stderr


TERMINATE = """
import json, sys
import psutil
from watchdog.act.actions import Actions, Target
from watchdog.config import ActionsConfig
from watchdog.vocabulary.model import Workload
from watchdog.sample.ranks import RankDiscovery
rank = RankDiscovery().describe(int(sys.argv[1]))
steps = Actions(ActionsConfig(mode="act", grace_seconds=2, timeout_seconds=10)).run(
    Target("run:alice-run", (rank,), Workload(), {}, None, "node"), dry=False)
print(json.dumps([s.to_json() for s in steps]))
"""


def test_terminate_ranks_needs_the_drop_in_and_check_config_says_so(install: tuple[Path, dict[str, str]]) -> None:
    folder = install[0]
    config = folder / "act.yaml"
    config.write_text("source: {kind: sim, scenario: healthy}\n"
                      f"actions: {{mode: act, do: [terminate_ranks], pause_file: {folder / 'pause'}}}\n")
    config.chmod(0o644)
    base, full = unit_capabilities(UNIT), unit_capabilities(UNIT, DROP_IN)
    assert "kill" not in base and "kill" in full
    checked = run_as(install, base, DYNAMIC_USER, "-m", "watchdog", "check-config", str(config))
    assert checked.returncode == 2 and "actions.terminate_ranks: this process lacks CAP_KILL" in checked.stderr
    assert run_as(install, full, DYNAMIC_USER, "-m", "watchdog", "check-config", str(config)).returncode == 0
    with user_process(folder, ALICE, ["queue"], RANK) as rank:
        done = run_as(install, base, DYNAMIC_USER, "-c", TERMINATE, str(rank.pid))
        [step] = json.loads(done.stdout)
        assert step["result"] == "failed" and "CAP_KILL" in step["detail"], step
        assert rank.alive()
        done = run_as(install, full, DYNAMIC_USER, "-c", TERMINATE, str(rank.pid))
        [step] = json.loads(done.stdout)
        assert step["result"] == "done" and not rank.alive(), (step, done.stderr)


def test_this_test_runs_as_root() -> None:
    """The cases above start processes as other users and drop privileges with setpriv: root is needed, as
    it is in CI."""
    import os
    assert os.geteuid() == 0, "run the tests as root (CI does): they start ranks as other users"
    assert sys.platform == "linux"


@pytest.mark.parametrize("drop_in", [False, True], ids=["base unit", "with actions.conf"])
def test_the_daemon_is_armed_only_with_the_capability_to_act(install: tuple[Path, dict[str, str]],
                                                             drop_in: bool) -> None:
    """`run` as the unit runs it, in act mode: without actions.conf it starts, says why at start-up, and
    /metrics says unready, never armed; with it, armed."""
    import socket
    import time
    import urllib.request
    folder, env = install
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = folder / "run.yaml"
    config.write_text("source: {kind: sim, scenario: healthy}\n"
                      f"export: {{listen_address: '127.0.0.1:{port}'}}\n"
                      f"bundles: {{directory: {folder / 'incidents'}}}\n"
                      f"actions: {{mode: act, pause_file: {folder / 'pause'}}}\n")
    config.chmod(0o644)
    daemon = subprocess.Popen(with_capabilities(["/usr/bin/python3", "-m", "watchdog", "run", "--config", str(config)],
                                                unit_capabilities(UNIT, *([DROP_IN] if drop_in else [])),
                                                DYNAMIC_USER),
                              env=env, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, text = time.monotonic() + 60, ""
        while 'state="' not in text:
            assert daemon.poll() is None and time.monotonic() < deadline, "the daemon did not serve /metrics"
            time.sleep(0.5)
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                continue
        state = next(line for line in text.splitlines() if line.startswith("stall_watchdog_action_state{"))
        expected = "armed" if drop_in else "unready"
        assert state == f'stall_watchdog_action_state{{mode="act",state="{expected}"}} 1.0', state
    finally:
        daemon.terminate()
        _, log = daemon.communicate(timeout=30)
    assert ("lacks CAP_KILL" in log) is not drop_in, log[-2000:]
    assert "event=privileges_short" not in log  # the unit's set reads and traces every rank


PROOFS = """
import json, sys
from watchdog.act import membership
from watchdog.sample.ranks import RankDiscovery
ranks = [RankDiscovery().describe(int(pid), (0,)) for pid in sys.argv[1:]]  # both on GPU 0
jobs, left = membership.prove(ranks, float("inf"), membership.no_slurm)
print(json.dumps({"proofs": {str(pid): list(p) for pid, p in membership.proofs(ranks, membership.no_slurm).items()},
                  "keys": {str(r.pid): list(j.ledger_keys) for j in jobs for r in j.ranks},
                  "restarted": {str(r.pid): j.restarted() for j in jobs for r in j.ranks},
                  "targets": {str(t.pid): t.job for t in membership.sample_targets(ranks, membership.no_slurm)},
                  "conflicts": membership.conflicts(jobs), "left": [a.text() for a in left]}))
"""


@pytest.mark.parametrize("who", ["systemd unit", "DaemonSet"])
def test_the_shipped_privileges_prove_two_users_jobs_apart(install: tuple[Path, dict[str, str]], who: str) -> None:
    """As the units run (the unit's dynamic user with its capabilities; the DaemonSet's root with only its own),
    two users' ranks under launchers of their own, both claiming one run id on one GPU: each is proven by its
    launcher with its own uid (rank_info's proof and uid labels), the sampler keys them by proof (never by the
    claim), their ledger keys differ, the restart count is read, and the shared claim is a conflict."""
    caps, uid = (unit_capabilities(UNIT), DYNAMIC_USER) if who == "systemd unit" else (daemonset_capabilities(), None)
    claim = {**RANK, "TORCHELASTIC_RESTART_COUNT": "1"}
    with user_process(install[0], ALICE, ["queue"], claim) as alice, \
            user_process(install[0], BOB, ["queue"], {**claim, "RANK": "2"}) as bob:
        done = run_as(install, caps, uid, "-c", PROOFS, str(alice.pid), str(bob.pid))
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["proofs"] == {str(alice.pid): ["launcher", ALICE], str(bob.pid): ["launcher", BOB]}, seen
    assert len(set(seen["targets"].values())) == 2 and all(k.startswith("launcher:") for k in seen["targets"].values())
    assert seen["keys"][str(alice.pid)] != seen["keys"][str(bob.pid)]
    assert seen["restarted"][str(alice.pid)][0] == 1
    assert len(seen["conflicts"]) == 2 and seen["left"] == []
