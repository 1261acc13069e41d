"""The actions policy against a real torchrun job: the daemon (real py-spy, real rank discovery, the real
policy and terminate_ranks) ends a hung job's workers, torchrun's elastic agent restarts them, and training
resumes from the last checkpoint past the step where it hung. The same job hanging again soon after is
left to a person: one action, then notify only."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from tests.conftest import until
from tests.elastic import FollowingSource, last_progress, steps, torchrun_job
from tests.fakes.daemon import Receiver, daemon_config
from watchdog.service import Service, build


def summaries(receiver: Receiver) -> list[str]:
    return [str(body["alert"]["summary"]) for _, body in list(receiver.requests) if isinstance(body, dict)]


def start(tmp: Path, source: FollowingSource, receiver: Receiver, **actions: Any) -> Service:
    config = daemon_config(
        tmp, sample={"interval_seconds": 1.0}, bundles={"capture_stacks": True},
        stacks={"observe_seconds": 0.5},
        actions={"mode": "act", "after_seconds": 5, "grace_seconds": 5, "cooldown_seconds": 0,
                 "pause_file": str(tmp / "actions.pause"), **actions},
        alerts={"receivers": [{"type": "webhook", "name": "hook", "url": receiver.url}]})
    service = build(config, source)
    service.start()  # the endpoint (a free loopback port) and the stack sampler, as `run` has them
    threading.Thread(target=service.run, daemon=True).start()
    return service


def test_a_hung_torchrun_job_is_ended_resumes_from_its_checkpoint_and_a_quick_relapse_is_left_alone(
        tmp_path: Path) -> None:
    receiver = Receiver()
    # Hangs at step 30 on the first run (the checkpoint is at step 20), and at step 45 after the restart.
    with torchrun_job(tmp_path, hangs="0:30,1:45") as agent:
        source = FollowingSource(agent, tmp_path)
        service = start(tmp_path, source, receiver)
        daemon = service.daemon
        try:
            until(lambda: any(s == 29 for s, _ in steps(tmp_path)), 120, "the job reached its hang")
            until(lambda: source.hung_since is not None, 30, "the GPUs read as hung")
            onset = last_progress(tmp_path)
            until(lambda: any(r == 1 for _, r in steps(tmp_path)), 240, "the job trained again after a restart")
            again = last_progress(tmp_path)
            print(f"\nhang onset -> training again: {again - onset:.1f} s (actions.after_seconds 5)")
            until(lambda: any(s == 44 and r == 1 for s, r in steps(tmp_path)), 120, "the restarted job passed step 30")
            until(lambda: any(t.startswith("NOT ACTED (deterministic)") for t in summaries(receiver)), 240,
                  "the second hang said as deterministic")
        finally:
            daemon.stop_requested.set()
            time.sleep(1.5)
            service.close(timeout=15)
            receiver.close()
    resumed = [s for s, r in steps(tmp_path) if r == 1]
    assert resumed[0] == 21, f"resumed at step {resumed[0]}, not from the checkpoint of step 20"
    assert 30 in resumed and 31 in resumed
    assert daemon.counters.get("actions_total", "terminate_ranks", "done") == 1
    assert sum(v for (action, _), v in daemon.counters.snapshot()["actions_total"].items()) == 1
    acted = [t for t in summaries(receiver) if t.startswith("ACTED:")]
    assert acted and "terminated ranks 0-3 of job run:" in acted[0] and "evidence: " in acted[0], acted
    bundles = [p for p in (tmp_path / "incidents").iterdir() if (p / "summary.json").exists()]
    records = [r for b in bundles for r in json.loads((b / "summary.json").read_text()).get("actions", [])]
    act = [r for r in records if r["decision"] == "act"]
    assert len(act) == 1 and act[0]["steps"][0]["result"] == "done" and act[0]["evidence"].startswith("before-action")
    evidence = next(b for b in bundles if any(r["decision"] == "act" for r in
                                              json.loads((b / "summary.json").read_text()).get("actions", [])))
    assert len(list((evidence / act[0]["evidence"] / "stacks").iterdir())) == 4
    page = (evidence / "report.html").read_text()
    assert "<h2>Actions</h2>" in page and "terminate_ranks done: terminated ranks 0-3" in page
    assert [r["decision"] for r in records].count("deterministic") == 1


def test_a_relaunch_under_a_new_run_id_and_folder_after_the_daemon_restarted_is_left_alone(tmp_path: Path) -> None:
    """One action, then the daemon restarts and the job is launched again by hand or by a scheduler: a new
    torchrun (a new run id) writing to a new folder, hanging the same way. The ledger read back at start knows
    the program and its user, so the relapse is notify only."""
    receiver = Receiver()
    first, second = tmp_path / "run-1", tmp_path / "run-2"
    for work in (first, second):
        work.mkdir()
    with torchrun_job(first, hangs="0:30") as agent:
        service = start(tmp_path, FollowingSource(agent, first), receiver)
        try:
            until(lambda: any(t.startswith("ACTED:") for t in summaries(receiver)), 240, "the first hang acted on")
        finally:
            service.daemon.stop_requested.set()
            time.sleep(1.5)
            service.close(timeout=15)
    with torchrun_job(second, hangs="0:30") as agent:
        service = start(tmp_path, FollowingSource(agent, second), receiver)  # the daemon, restarted
        try:
            until(lambda: any(t.startswith("NOT ACTED (deterministic)") for t in summaries(receiver)), 240,
                  "the relaunched job's hang said as deterministic")
            assert not any(r > 0 for _, r in steps(second)), "the relaunched job was restarted"
        finally:
            service.daemon.stop_requested.set()
            time.sleep(1.5)
            service.close(timeout=15)
            receiver.close()
    assert service.daemon.counters.snapshot()["actions_total"] == {}
    acted = [t for t in summaries(receiver) if t.startswith("ACTED:")]
    assert len(set(acted)) == 1, acted


def test_a_second_node_of_a_job_another_node_restarted_leaves_its_relapse_alone(tmp_path: Path) -> None:
    """Two nodes' daemons over one job, no fleet Prometheus: node a acts first, torchrun restarts the job, and it
    hangs again. Node b never acted, so its ledger is empty; the ranks' launcher says it restarted them, and
    when, so node b leaves the relapse to a person too."""
    receivers = {"a": Receiver(), "b": Receiver()}
    for name in receivers:
        (tmp_path / name).mkdir()
    with torchrun_job(tmp_path, hangs="0:30,1:45") as agent:
        services = {name: start(tmp_path / name, FollowingSource(agent, tmp_path), receivers[name],
                                after_seconds=5 if name == "a" else 40) for name in receivers}
        try:
            until(lambda: any(s == 44 and r == 1 for s, r in steps(tmp_path)), 360, "the restarted job passed step 30")
            until(lambda: all(any(t.startswith("NOT ACTED (deterministic)") for t in summaries(receiver))
                              for receiver in receivers.values()), 240, "both nodes said the relapse deterministic")
        finally:
            for service in services.values():
                service.daemon.stop_requested.set()
            time.sleep(1.5)
            for name, service in services.items():
                service.close(timeout=15)
                receivers[name].close()
    assert services["b"].daemon.counters.snapshot()["actions_total"] == {}
    said = [t for t in summaries(receivers["b"]) if t.startswith("NOT ACTED (deterministic)")]
    assert "after its launcher restarted it (1 restart)" in said[0], said
    assert not any(r > 1 for _, r in steps(tmp_path)), "the job was restarted twice"
