"""terminate_ranks over real processes: a pidfd checked against the rank's start time (a reused pid is never
signalled), a zombie counted as gone, a pause during the grace period stopping the SIGKILL and every step
after it, and what the alert then says."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from tests.conftest import python_target
from watchdog.act import policy
from watchdog.act.actions import DONE, FAILED, SKIPPED, STOPPED, Actions, Step, Target
from watchdog.act.responder import action_text
from watchdog.config import ActionsConfig
from watchdog.sample.ranks import RankDiscovery, RankInfo
from watchdog.vocabulary.model import Workload

RANK = {"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "t"}


def target(*ranks: RankInfo) -> Target:
    return Target("run:t", ranks, Workload(), {}, None, "node")


def actions(**values: object) -> Actions:
    return Actions(ActionsConfig(**{"mode": "act", "pause_file": None, "grace_seconds": 5, "timeout_seconds": 10,
                                    **values}))


def describe(pid: int) -> RankInfo:
    rank = RankDiscovery().describe(pid)
    assert rank is not None
    return rank


def test_a_pid_that_names_another_process_now_is_never_signalled(tmp_path: Path) -> None:
    with python_target("queue", tmp_path, env=RANK) as process:
        listed = dataclasses.replace(describe(process.pid), create_time=describe(process.pid).create_time - 60)
        [step] = actions().run(target(listed), dry=False)
        assert step.result == SKIPPED and process.poll() is None


def test_a_rank_whose_parent_never_reaps_it_is_gone_once_it_is_a_zombie() -> None:
    """Its parent (stuck itself) never waits for it: it stays a zombie, which has ended all the same."""
    parent = subprocess.Popen([sys.executable, "-c", "import os, sys, time\npid = os.fork()\nif pid == 0:\n"
                               "    time.sleep(600)\nprint(pid, flush=True)\ntime.sleep(600)\n"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        [step] = actions(grace_seconds=5, timeout_seconds=10).run(target(describe(child)), dry=False)
        assert step.result == DONE and "SIGKILL" not in step.detail, step  # gone at SIGTERM, no grace waited
        assert psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    finally:
        parent.kill()
        parent.wait()


def test_a_pause_during_the_grace_period_stops_the_sigkill_and_the_steps_after(tmp_path: Path) -> None:
    pause = tmp_path / "pause"
    ran = tmp_path / "ran"
    with python_target("deaf", tmp_path, env=RANK) as process:
        timer = threading.Timer(0.8, pause.touch)
        timer.start()
        looks: list[bool] = []  # each time the steps asked whether to stop: was the pause there?

        def stop() -> str | None:
            looks.append(pause.exists())
            return f"paused by {pause}" if looks[-1] else None

        # A grace of ten minutes: steps that looked for the pause only once it ended would still be waiting.
        steps = actions(do=["terminate_ranks", "command"], command=["/bin/touch", str(ran)], grace_seconds=600,
                        timeout_seconds=900).run(target(describe(process.pid)), dry=False, stop=stop)
        timer.join()
        # It looked during the grace, and stopped at its first look after the pause came.
        assert False in looks and True in looks and all(looks[looks.index(True):]), looks
        assert process.poll() is None, "SIGKILL was sent after the pause"
        assert [st.result for st in steps] == [STOPPED, STOPPED]
        assert "SIGKILL not sent" in steps[0].detail and str(pause) in steps[0].detail
        assert not ran.exists()


def test_a_stubborn_rank_gets_sigkill_after_the_grace_period(tmp_path: Path) -> None:
    with python_target("deaf", tmp_path, env=RANK) as process:
        [step] = actions(grace_seconds=0.5).run(target(describe(process.pid)), dry=False)
        assert step.result == DONE and "1 needed SIGKILL" in step.detail
        assert process.wait(5) == -9


@pytest.mark.parametrize(("steps", "head"), [
    ([Step("terminate_ranks", DONE, 0, 1, "terminated rank 0 of job run:t (1 processes)", ended=True)],
     "ACTED: terminated rank 0 of job run:t (1 processes) after 2 min 0 s of hang"),
    ([Step("terminate_ranks", SKIPPED, 0, 0, "no rank of the job is left on the episode's GPUs"),
      Step("slurm", DONE, 0, 1, "drained node n1")],  # a drain alone ends no job
     "NOT ACTED (failed: terminate_ranks skipped: no rank of the job is left on the episode's GPUs), though "
     "drained node n1 after"),
    ([Step("terminate_ranks", FAILED, 0, 0, "cannot signal pid 19400: operation not permitted (the daemon needs "
           "CAP_KILL ...)")],
     "NOT ACTED (failed: terminate_ranks failed: cannot signal pid 19400: operation not permitted (the daemon "
     "needs CAP_KILL ...)) after 2 min 0 s of hang"),
    ([Step("terminate_ranks", STOPPED, 0, 0, "sent SIGTERM; SIGKILL not sent: paused")],
     "NOT ACTED (failed: terminate_ranks stopped: sent SIGTERM; SIGKILL not sent: paused) after 2 min 0 s"),
    ([Step("slurm", SKIPPED, 0, 0, "no Slurm job known")],
     "NOT ACTED (failed: slurm skipped: no Slurm job known) after"),
])
def test_acted_is_said_only_when_the_job_was_ended(steps: list[Step], head: str) -> None:
    said = action_text([("launcher:1@2", policy.Decision("act", "critical"), steps)], 120.0)
    assert said.startswith(head), said


def test_no_evidence_is_kept_for_a_bundle_that_is_gone(tmp_path: Path) -> None:
    """An action waits for its evidence on disk: a bundle rotated away (or a disk that refuses) is an error,
    which the daemon turns into NOT ACTED (no_evidence)."""
    from watchdog.act.bundles import BundleStore
    from watchdog.config import BundlesConfig
    from watchdog.export.metrics import new_counters
    store = BundleStore(BundlesConfig(directory=str(tmp_path)), new_counters())
    with pytest.raises(FileNotFoundError):
        store.keep_evidence(str(tmp_path / "rotated-away"), [])
    (tmp_path / "bundle").mkdir()
    kept = store.keep_evidence(str(tmp_path / "bundle"), [])
    assert kept.startswith("before-action") and (tmp_path / "bundle" / kept).is_dir()


def test_actions_recorded_while_the_verdict_is_rewritten_are_all_kept(tmp_path: Path) -> None:
    """The responder records actions in summary.json while the incident workers rewrite its verdict (an
    escalation, the action's own sentence): each reads, changes and replaces the file, so neither may write back
    a copy without the other's change."""
    import json

    from watchdog.act.bundles import BundleStore
    from watchdog.config import BundlesConfig
    from watchdog.export.metrics import new_counters
    from watchdog.vocabulary.model import EpisodeEvent, EventKind, Severity, Signature
    from watchdog.vocabulary.telling import Telling
    store = BundleStore(BundlesConfig(directory=str(tmp_path)), new_counters(), render_report=lambda folder: None)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "summary.json").write_text("{}")
    event = EpisodeEvent(EventKind.ESCALATED, Signature.ZERO_UTIL, Severity.CRITICAL, (0,), (), 1.9e9, 1.9e9 + 60,
                         "HANG (critical): GPU 0 idle")

    def record() -> None:
        for n in range(60):
            store.record_action(str(bundle), {"decision": "dry_run", "n": n})

    def rewrite() -> None:
        for n in range(60):
            store.rewrite_verdict(str(bundle), event, Telling(event.summary, action=f"DRY RUN {n}"))

    workers = [threading.Thread(target=record), threading.Thread(target=rewrite)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    summary = json.loads((bundle / "summary.json").read_text())
    assert [r["n"] for r in summary["actions"]] == list(range(60))
    assert summary["verdict"] == "DRY RUN 59. HANG (critical): GPU 0 idle"


def test_an_action_under_way_stops_on_a_pause_a_reload_or_its_evidence_gone(tmp_path: Path) -> None:
    """What the daemon asks between two steps and during a grace period (Responder._stop_reason)."""
    from tests.fakes.daemon import daemon_config
    from watchdog.act.open_incident import OpenIncident
    from watchdog.service import build
    config = daemon_config(tmp_path, bundles={"capture_stacks": True},
                           actions={"mode": "act", "pause_file": str(tmp_path / "pause")})
    service = build(config)
    daemon = service.daemon
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    state = OpenIncident(gpus=(0,), bundle=str(bundle))
    stop = daemon.responder._stop_reason
    assert stop(state) is None
    (tmp_path / "pause").touch()
    assert stop(state) == f"paused by {tmp_path / 'pause'}"
    (tmp_path / "pause").unlink()
    daemon.incidents.config = config.model_copy(update={"actions": config.actions.model_copy(
        update={"mode": "observe"})})  # what a reload hands the incident side
    assert stop(state) == "actions.mode is now observe"
    daemon.incidents.config = config
    bundle.rmdir()  # rotated away
    assert stop(state) == "the incident bundle is no longer on disk"
    service.close(timeout=5)
