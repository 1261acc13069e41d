"""From a node's verdict to its job's dumps without the time-series database: the daemon's coordinator
receiver pages `stall-watchdog coordinate` with the Slurm job it proved, the coordinator asks a real Slurm
(tests/slurm.py) for the job's nodes and dumps each node's daemon, while Prometheus is down."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.fakes.daemon import daemon_config, stepping_clock
from tests.fakes.loopback import free_port
from tests.slurm import Slurm, hung_job, slurm_cluster
from watchdog.boundary.http_server import Auth
from watchdog.boundary.webhook import PayloadError, SchedulerIds, job_requests
from watchdog.coordinate.nodes import NodeClient
from watchdog.coordinate.scheduler import SchedulerError, SlurmNodes
from watchdog.coordinate.service import Coordinator
from watchdog.sample import sim
from watchdog.service import build

HANG_AT = 300.0  # sim.SCENARIOS["zero_util_hang"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def test_a_page_names_its_job_and_the_slurm_job_it_runs_as() -> None:
    assert job_requests(b'{"training_job": "slurm:42", "slurm_job_id": "42"}') == {"slurm:42": SchedulerIds("42")}
    assert job_requests(b'{"training_job": "run:x"}') == {"run:x": SchedulerIds()}
    assert job_requests(b'{"training_job": "run:x", "namespace": "ml", "pod": "w-0"}') == {
        "run:x": SchedulerIds(None, "ml", "w-0")}
    for bad, why in ((b'{"slurm_job_id": "42"}', "name the training job"),
                     (b'{"training_job": "run:x", "slurm_job_id": "4 2"}', "expected a Slurm job id"),
                     (b'{"training_job": "run:x", "pod": "w-0"}', "namespace and pod go together"),
                     (b'{"training_job": "run:x", "namespace": "ml", "pod": "../x"}', "pod: expected a Kubernetes"),
                     (b'{"training_job": "run:x", "node": "a"}', "unknown field 'node'")):
        with pytest.raises(PayloadError, match=why):
            job_requests(bad)
    alerts = {"version": "4", "groupLabels": {"training_job": "a"}, "alerts": [
        {"labels": {"training_job": "a", "slurm_job_id": "7"}}, {"labels": {"training_job": "b", "slurm_job_id": "8"}},
        {"labels": {"training_job": "b", "slurm_job_id": "9"}}, {"labels": {"training_job": "c", "pod": "p"}},
        {"labels": {"training_job": "d", "namespace": "ml", "pod": "w-0", "slurm_job_id": "x"}}]}
    # b is named with two Slurm jobs: which one is not the coordinator's guess, so Slurm is not asked for it; a
    # pod without its namespace, and a malformed id, are not kept either
    assert job_requests(json.dumps(alerts).encode()) == {"a": SchedulerIds("7"), "b": SchedulerIds(),
                                                         "c": SchedulerIds(), "d": SchedulerIds(None, "ml", "w-0")}


def test_slurm_places_a_running_job_and_refuses_others(slurm: Slurm, tmp_path: Path) -> None:
    nodes = SlurmNodes("{node}:9944", slurm.env["SLURM_CONF"])
    job, _ = hung_job(slurm, tmp_path)
    try:
        placement = nodes.placement(job)
        assert placement.instances == [f"{slurm.node}:9944"] and placement.source == "slurm"
        assert placement.ranks == {}  # each node's daemon proves its own ranks
    finally:
        slurm.run("scancel", job)
    slurm.wait_job(job, ("CANCELLED", "COMPLETED"), seconds=30)
    with pytest.raises(SchedulerError, match=f"Slurm says job {job} is CANCELLED"):
        nodes.placement(job)
    with pytest.raises(SchedulerError, match="squeue exited with status 1"):
        nodes.placement("987654")
    with pytest.raises(SchedulerError, match="cannot start"):
        SlurmNodes("{node}:9944", slurm.env["SLURM_CONF"], squeue="/nonexistent/squeue").placement(job)


def test_a_node_verdict_dumps_its_job_through_slurm_with_prometheus_down(slurm: Slurm, tmp_path: Path) -> None:
    job, pid = hung_job(slurm, tmp_path)
    token, callers = tmp_path / "dump-token", tmp_path / "coordinator-token"
    token.write_text("node-secret-0123456789\n")
    callers.write_text("caller-secret-0123456789\n")
    for path in (token, callers):
        path.chmod(0o600)
    coordinator = Coordinator(f"http://127.0.0.1:{free_port()}", tmp_path / "jobs",
                              NodeClient(token="node-secret-0123456789", timeout_seconds=30), cooldown_seconds=600,
                              auth=Auth(token="caller-secret-0123456789"))
    server = coordinator.serve("127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    offset = HANG_AT - 5
    config = daemon_config(
        tmp_path, source={"scenario": "zero_util_hang", "start_offset_seconds": offset, "pids": {0: [pid]}},
        dump={"open_on_loopback": False, "token_file": str(token)}, stacks={"observe_seconds": 0.3},
        bundles={"capture_stacks": True},
        actions={"slurm": {"conf": slurm.env["SLURM_CONF"], "node_name": slurm.node}},
        alerts={"receivers": [{"type": "coordinator", "name": "coordinator", "token_file": str(callers),
                               "url": f"http://127.0.0.1:{server.server_address[1]}"}]})
    clock = stepping_clock(1.9e9 + offset)
    service = build(config, sim.SimSource(sim.SCENARIOS["zero_util_hang"], 1.0, offset, {0: [pid]}, clock=clock))
    try:
        service.endpoint.start()
        port = int(service.endpoint.url.rsplit(":", 1)[1].split("/")[0])
        coordinator.slurm = SlurmNodes(f"{{node}}:{port}", slurm.env["SLURM_CONF"])
        deadline = time.monotonic() + 120
        while f"slurm:{job}" not in coordinator.latest:
            assert time.monotonic() < deadline, ("no job verdict within 2 minutes: alerts "
                                                  f"{service.daemon.counters.snapshot().get('alerts_total')}")
            service.daemon.tick()
            time.sleep(0.02)
        coordinator.pool.shutdown(wait=True)
    finally:
        service.close(timeout=15)
        server.shutdown()
        server.server_close()
        slurm.run("scancel", job, check=False)
    verdict = coordinator.latest[f"slurm:{job}"]
    assert verdict["placed_by"] == "slurm" and verdict["problem"] is None, verdict
    assert verdict["nodes_answered"] == 1 and verdict["nodes"][0]["instance"] == f"{slurm.node}:{port}"  # type: ignore[index]
    assert [r["pid"] for r in verdict["ranks"]] == [pid]  # type: ignore[union-attr]
    assert service.daemon.counters.get("alerts_total", "coordinator", "sent") == 1


def test_coordinate_asks_slurm_for_a_job_with_no_prometheus(slurm: Slurm, tmp_path: Path) -> None:
    job, _ = hung_job(slurm, tmp_path)
    port = free_port()
    try:
        done = subprocess.run([sys.executable, "-m", "watchdog", "coordinate", "--slurm-instance", f"{{node}}:{port}",
                               "--slurm-conf", slurm.env["SLURM_CONF"], "--job", f"slurm:{job}", "--slurm-job-id",
                               job, "--json", "--out", str(tmp_path / "jobs"), "--timeout-seconds", "5"],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
    finally:
        slurm.run("scancel", job, check=False)
    answer = json.loads(done.stdout)
    assert answer["placed_by"] == "slurm" and answer["problem"] is None, answer
    assert answer["nodes_silent"] == [f"{slurm.node}:{port}"]  # no daemon there: named, not a crash
    assert "Traceback" not in done.stderr
    refused = subprocess.run([sys.executable, "-m", "watchdog", "coordinate", "--job", "x"], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--slurm-instance" in refused.stderr


def test_slurm_nodes_past_the_cap_or_without_an_instance_are_said(tmp_path: Path) -> None:
    """squeue and scontrol as a site's wrappers might answer: 20,000 names and 3 that make no host:port."""
    squeue, scontrol = tmp_path / "squeue", tmp_path / "scontrol"
    squeue.write_text("#!/bin/sh\necho '42|RUNNING|n[0-19999],x'\n")
    scontrol.write_text("#!/bin/sh\nseq -f 'n%g' 0 19999\necho 'user@host'\necho '-x'\necho 'a/b'\n")
    for program in (squeue, scontrol):
        program.chmod(0o755)
    placement = SlurmNodes("{node}:9944", squeue=str(squeue), scontrol=str(scontrol)).placement("42")
    assert len(placement.instances) == 16_384
    assert placement.note == ("3 of its 20003 node names make no host:port instance with '{node}:9944'; not asked; "
                              "3616 of its nodes are past the 16384 asked of one job; not asked")
