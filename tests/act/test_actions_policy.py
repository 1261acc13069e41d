"""The actions policy and its guards: the rule itself (act/policy.py), the fleet breaker asking a Prometheus
API, and the daemon in observe and dry_run over a real hung process, which must be left alive."""

from __future__ import annotations

import dataclasses
import html
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import python_target
from tests.fakes.daemon import Receiver, daemon_config, scrape, stepping_clock
from tests.fakes.loopback import Quiet, Served, serving
from watchdog.act import fleet, policy
from watchdog.act.actions import problems as action_problems
from watchdog.config import ActionsConfig, ConfigError, FleetConfig, parse_config
from watchdog.daemon import Daemon
from watchdog.sample import sim
from watchdog.service import build
from watchdog.vocabulary.model import Severity

HANG_AT = 300.0  # sim.SCENARIOS["zero_util_hang"]


def cfg(**values: Any) -> ActionsConfig:
    return ActionsConfig(**{"mode": "act", "pause_file": None, **values})


def hang(now: float = 1000.0, onset: float = 800.0, confirmed: bool = True, job: str = "run:a",
         severity: Severity = Severity.CRITICAL) -> policy.Hang:
    return policy.Hang(job, severity, onset, now, onset + 30 if severity is Severity.CRITICAL else None, confirmed)


def test_the_checks_in_their_order(tmp_path: Path) -> None:
    ledger = policy.Ledger()
    assert policy.decide(cfg(mode="observe"), hang(), ledger).name == "observe"
    assert policy.decide(cfg(), hang(severity=Severity.WARNING), ledger).name == "wait"
    assert policy.decide(cfg(after_seconds=300), hang(), ledger).name == "wait"
    assert policy.decide(cfg(), hang(confirmed=False), ledger).name == "unconfirmed"
    assert policy.decide(cfg(on_telemetry_only=True), hang(confirmed=False), ledger).name == "act"
    assert policy.decide(cfg(mode="dry_run"), hang(), ledger).name == "dry_run"
    unkept = policy.decide(cfg(), dataclasses.replace(hang(), kept=False), ledger)
    assert unkept.name == "no_evidence" and unkept.said and not unkept.final
    assert policy.decide(cfg(paused=True), hang(), ledger).name == "paused"
    pause = tmp_path / "pause"
    assert policy.decide(cfg(pause_file=str(pause)), hang(), ledger).name == "act"
    pause.touch()
    decided = policy.decide(cfg(pause_file=str(pause)), hang(), ledger)
    assert decided.name == "paused" and str(pause) in decided.reason


def test_a_relapse_soon_after_an_action_is_deterministic_and_later_it_is_not() -> None:
    ledger = policy.Ledger()
    ledger.record(700.0, "run:a")
    decided = policy.decide(cfg(), hang(onset=800.0), ledger)
    assert decided.name == "deterministic" and decided.final and "100 s after it was restarted" in decided.reason
    assert policy.decide(cfg(cooldown_seconds=0), hang(onset=800.0, job="run:b"), ledger).name == "act"
    ledger = policy.Ledger()
    ledger.record(0.0, "run:a")
    assert policy.decide(cfg(deterministic_within_seconds=600), hang(onset=800.0), ledger).name == "act"


def test_an_action_under_any_of_a_jobs_keys_holds_it_and_counts_once() -> None:
    """A job is known to the ledger by several keys (its Slurm job and its user's program): an action recorded
    under them is one action, and a relaunch that shares only one of the keys is held by it."""
    ledger = policy.Ledger()
    ledger.record(700.0, "slurm:4242", "command:1001:ab")
    assert ledger.on_job(("slurm:4300", "command:1001:ab")) == [700.0]
    relaunched = dataclasses.replace(hang(onset=800.0, job="slurm:4300"), also=("command:1001:ab",))
    assert policy.decide(cfg(), relaunched, ledger).name == "deterministic"
    other = dataclasses.replace(hang(onset=800.0, job="slurm:4300"), also=("command:1002:ab",))
    assert policy.decide(cfg(cooldown_seconds=0), other, ledger).name == "act"
    assert [(job, count) for job, _, count in ledger.summary()] == [("command:1001:ab", 1), ("slurm:4242", 1)]


def test_a_hang_soon_after_the_launcher_restarted_the_job_is_deterministic_on_any_node() -> None:
    """No ledger needed: ranks that torchrun or Slurm restarted say so, and the kernel says when they started. A
    second node of a job another node acted on, or a daemon that lost its ledger, still leaves the relapse to a
    person; a restart long before the hang, or none, does not hold the action."""
    ledger = policy.Ledger()
    soon = dataclasses.replace(hang(onset=800.0), restarted=(1, 500.0))
    decided = policy.decide(cfg(), soon, ledger)
    assert decided.name == "deterministic" and "5 min 0 s after its launcher restarted it (1 restart)" in \
        decided.reason, decided
    assert policy.decide(cfg(deterministic_within_seconds=200), soon, ledger).name == "act"
    assert policy.decide(cfg(), dataclasses.replace(soon, restarted=(3, 900.0)), ledger).name == "act"  # after it
    assert policy.decide(cfg(), hang(onset=800.0), ledger).name == "act"


def test_a_name_claimed_by_two_proven_jobs_holds_both() -> None:
    conflict = dataclasses.replace(hang(), conflict="2 proven jobs on these GPUs claim the name run:x")
    decided = policy.decide(cfg(), conflict, policy.Ledger())
    assert decided.name == "conflict" and decided.said and not decided.final and "run:x" in decided.reason
    assert policy.decide(cfg(), dataclasses.replace(conflict, target=None), policy.Ledger()).name == "no_target"


def test_the_budget_and_the_cooldown_are_per_job() -> None:
    ledger = policy.Ledger()
    for at in (-5000.0, -3000.0):
        ledger.record(at, "run:a")
    config = cfg(max_per_job=2, budget_window_seconds=7200, deterministic_within_seconds=0)
    assert policy.decide(config, hang(), ledger).name == "budget"
    assert policy.decide(cfg(max_per_job=3, budget_window_seconds=7200, deterministic_within_seconds=0), hang(),
                         ledger).name == "act"
    ledger.record(900.0, "run:other")
    relaxed = cfg(cooldown_seconds=300, deterministic_within_seconds=0, max_per_job=5)
    assert policy.decide(relaxed, hang(), ledger).name == "act"  # another job's action holds nobody else
    ledger.record(900.0, "run:a")
    decided = policy.decide(relaxed, hang(), ledger)
    assert decided.name == "cooldown" and not decided.final and "this job was acted on" in decided.reason


def test_the_ledger_outlives_the_daemon_and_a_bad_file_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "ledger.json"
    first = policy.Ledger(path)
    first.record(700.0, "slurm:4242")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    again = policy.Ledger(path)  # the daemon restarted
    assert again.on_job("slurm:4242") == [700.0] and again.problem is None
    assert policy.decide(cfg(), hang(onset=800.0, job="slurm:4242"), again).name == "deterministic"
    path.write_text("[" * 100_000)  # deep nesting: no RecursionError, an empty ledger and the reason
    broken = policy.Ledger(path)
    assert broken.on_job("slurm:4242") == [] and "not a ledger" in (broken.problem or "")
    path.write_bytes(b"x" * (1 << 20))
    assert "cap" in (policy.Ledger(path).problem or "")
    path.write_text('[[' + '9' * 400 + ', "slurm:1"]]')  # a number no float holds: said, not a crash
    assert "not a ledger" in (policy.Ledger(path).problem or "")
    path.write_text('[[1e18, "slurm:1"], [-5, "slurm:2"], [700.0, "slurm:3"]]')  # from the future, before 1970
    assert [job for job, _, _ in policy.Ledger(path).summary()] == ["slurm:3"]
    assert policy.Ledger(tmp_path / "absent.json").problem is None


def test_an_action_on_another_node_counts_for_the_same_job(prom: PromApi) -> None:
    """A requeued job that hangs again on another node: that node's ledger, read through Prometheus, makes it
    deterministic here; this node's own action, seen there too, is counted once."""
    ledger = policy.Ledger()
    ledger.record(650.0, "slurm:4242")
    assert ledger.on_job("slurm:4242", [650.4, 700.0]) == [650.0, 700.0]
    decided = policy.decide(cfg(), hang(onset=800.0, job="slurm:4242"), policy.Ledger(), elsewhere=[700.0])
    assert decided.name == "deterministic", decided
    prom.answer = "700.0"
    elsewhere, why = fleet.actions_elsewhere(FleetConfig(prometheus_url=prom.url), 'slurm:4242"}) or vector(1')
    assert elsewhere == [700.0] and why == ""
    assert 'ledger_key%3D%22slurm%3A4242%5C%22%7D%29+or+vector%281%22' in prom.queries[-1]  # quoted, not injected
    prom.answer = None
    assert fleet.actions_elsewhere(FleetConfig(prometheus_url=prom.url), "slurm:1") == ([], "")
    assert fleet.actions_elsewhere(FleetConfig(), "slurm:1") == ([], "")
    prom.raw = b'{"status": "error"}'
    elsewhere, why = fleet.actions_elsewhere(FleetConfig(prometheus_url=prom.url), "slurm:1")
    assert elsewhere is None and "status 'error'" in why
    prom.raw = None


def test_no_proven_job_and_a_sign_of_life_hold_an_action() -> None:
    ledger = policy.Ledger()
    none = policy.decide(cfg(), dataclasses.replace(hang(), target=None, unproven="pid 5: not a rank"), ledger)
    assert none.name == "no_target" and none.said and not none.final and "pid 5: not a rank" in none.reason
    alive = policy.decide(cfg(), dataclasses.replace(hang(), alive="rank 0 moved 4.0 MB of I/O in 1.0 s"), ledger)
    assert alive.name == "alive" and not alive.final and "4.0 MB" in alive.reason


def test_the_fleet_breaker_holds_above_its_share_and_when_it_cannot_see() -> None:
    ledger = policy.Ledger()
    assert policy.decide(cfg(), hang(), ledger, (0.05, "")).name == "act"
    assert policy.decide(cfg(), hang(), ledger, (0.3, "")).name == "breaker"
    blind = policy.decide(cfg(), hang(), ledger, (None, "Prometheus: 127.0.0.1: connection refused"))
    assert blind.name == "breaker" and "connection refused" in blind.reason


class PromApi(Served):
    """Answers /api/v1/query as Prometheus does, with the value set in `answer` (None: an empty result)."""

    def __init__(self) -> None:
        self.answer: Any = "0.25"
        self.raw: bytes | None = None  # a whole answer of its own, in place of the query result
        self.queries: list[str] = []
        outer = self

        class Handler(Quiet):
            def do_GET(self) -> None:  # noqa: N802
                outer.queries.append(self.path)
                if outer.raw is not None:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(outer.raw)))
                    self.end_headers()
                    self.wfile.write(outer.raw)
                    return
                result = [] if outer.answer is None else [{"metric": {"__name__": fleet.RECORD},
                                                           "value": [time.time(), outer.answer]}]
                self.answer_json(200, {"status": "success", "data": {"resultType": "vector", "result": result}})

        self.handler = Handler


@pytest.fixture
def prom() -> Iterator[PromApi]:
    with PromApi().running() as api:
        yield api  # type: ignore[misc]


def test_the_fleet_share_is_asked_of_prometheus(prom: PromApi) -> None:
    assert fleet.acted_ratio(FleetConfig()) == (0.0, "")  # no breaker configured
    config = FleetConfig(prometheus_url=prom.url)
    assert fleet.acted_ratio(config) == (0.25, "")
    assert "query=stall_watchdog%3Afleet_acted_ratio" in prom.queries[0]
    prom.answer = None
    share, why = fleet.acted_ratio(config)
    assert share is None and "rules.yml" in why
    prom.answer = "NaN"
    assert fleet.acted_ratio(config)[0] is None
    prom.answer = True  # a JSON true where Prometheus writes a number as a string
    assert fleet.acted_ratio(config)[0] is None
    prom.answer = "0.25"
    for raw in (b'{"status": "error", "errorType": "bad_data", "error": "parse error", "data": {"resultType": '
                b'"vector", "result": [{"metric": {}, "value": [1, "0.0"]}]}}', b"true", b"[" * 50_000 + b"]" * 50_000,
                b'{"status": "success", "data": {"resultType": "matrix", "result": []}}'):
        prom.raw = raw
        share, why = fleet.acted_ratio(config)
        assert share is None and why, raw[:40]
    prom.raw = None
    with serving(prom.handler) as gone:
        pass  # a port that was served and is closed now
    share, why = fleet.acted_ratio(FleetConfig(prometheus_url=gone, timeout_seconds=1))
    assert share is None and why.startswith("Prometheus: 127.0.0.1")


def test_a_policy_that_cannot_work_is_refused_with_its_key() -> None:
    with pytest.raises(ConfigError, match="actions.after_seconds: expected a number >= 0"):
        parse_config({"actions": {"mode": "act", "after_seconds": -1}})
    with pytest.raises(ConfigError, match="give actions.command"):
        parse_config({"actions": {"mode": "act", "do": ["command"]}})
    with pytest.raises(ConfigError, match="actions.do"):
        parse_config({"actions": {"do": ["reboot"]}})
    with pytest.raises(ConfigError, match="named twice"):
        parse_config({"actions": {"do": ["slurm", "slurm"]}})
    with pytest.raises(ConfigError, match="actions: do is empty: mode act would never do anything"):
        parse_config({"actions": {"mode": "act", "do": []}})
    with pytest.raises(ConfigError, match="actions.pause_file: expected an absolute path"):
        parse_config({"actions": {"mode": "act", "pause_file": ""}})
    with pytest.raises(ConfigError, match="bundles.capture_stacks is off: no rank would ever be seen"):
        parse_config({"actions": {"mode": "dry_run"}, "bundles": {"capture_stacks": False}})
    assert action_problems(ActionsConfig(mode="act", pause_file="/nonexistent/folder/actions.pause")) == [
        "actions.pause_file: its folder /nonexistent/folder does not exist, so the pause switch could never be set "
        "(systemd: deploy/systemd/actions.conf makes /run/stall-watchdog; Kubernetes: the actions component mounts "
        "it)"]


def watch(tmp: Path, pid: int, receiver: Receiver, extra_pids: list[int] | None = None, critical: bool = True,
          **actions: Any) -> Daemon:
    """The daemon over zero_util_hang with a real hung process on GPU 0 (and `extra_pids` beside it), until the
    episode is critical and has lasted after_seconds, plus a while for the decision. `critical` False: the
    evidence may keep the episode a warning; it is watched as long as a hang takes to turn critical."""
    offset = HANG_AT - 5
    pids = {0: [pid, *(extra_pids or [])]}
    config = daemon_config(
        tmp, source={"scenario": "zero_util_hang", "start_offset_seconds": offset, "pids": pids},
        bundles={"capture_stacks": True}, stacks={"observe_seconds": 0.3},
        alerts={"receivers": [{"type": "webhook", "name": "hook", "url": receiver.url}]},
        actions={"after_seconds": 10, "pause_file": str(tmp / "pause"), **actions})
    service = build(config, sim.SimSource(sim.SCENARIOS["zero_util_hang"], 1.0, offset, pids,
                                         clock=stepping_clock(1.9e9 + offset)))
    daemon = service.daemon
    critical_for = 0
    for _ in range(900):  # host progress is measured on the real clock: still ranks turn it critical
        daemon.tick()
        time.sleep(0.1)
        critical_for += any(ep.fired_severity is Severity.CRITICAL for ep in daemon.engine.open_episodes())
        if critical_for > 40 and not any(state.acting for state in daemon.incidents.open.values()):
            break
    assert critical_for > 40 or not critical, "the hang never turned critical"
    service.close(timeout=15)
    return daemon


def summaries(receiver: Receiver) -> list[str]:
    return [body["alert"]["summary"] for _, body in receiver.requests]


def action_state(daemon: Daemon) -> str:
    lines = scrape(daemon).splitlines()
    return next(line for line in lines if line.startswith("stall_watchdog_action_state{"))


def test_dry_run_ends_nothing_and_the_alert_says_what_would_have_been_done(tmp_path: Path) -> None:
    receiver = Receiver()
    with python_target("queue", tmp_path, env={"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "dry"}) as rank:
        daemon = watch(tmp_path, rank.pid, receiver, mode="dry_run")
        assert rank.poll() is None, "dry_run ended the rank"
    receiver.close()
    said = [s for s in summaries(receiver) if s.startswith("DRY RUN:")]
    assert len(said) == 1, said
    assert said[0].startswith("DRY RUN: would terminate rank 0 of job run:dry (started by pid "), said
    # The bundle and its page say what the alert said: one sentence, rendered once from the incident's fields.
    (_, body), = [(path, body) for path, body in receiver.requests if body["alert"]["summary"] == said[0]]
    bundle = Path(body["alert"]["bundle"])
    summary = json.loads((bundle / "summary.json").read_text())
    assert summary["verdict"] == said[0] and summary["telling"]["action"].startswith("DRY RUN: would terminate")
    assert f"evidence: {bundle}" in said[0]
    assert html.escape(summary["telling"]["action"]) in (bundle / "report.html").read_text()
    assert daemon.counters.get("actions_total", "terminate_ranks", "dry_run") == 1
    assert ("terminate_ranks", "done") not in daemon.counters.snapshot()["actions_total"]
    assert 'mode="dry_run"' in action_state(daemon)


def test_observe_ends_nothing_and_says_nothing_more(tmp_path: Path) -> None:
    receiver = Receiver()
    with python_target("queue", tmp_path, env={"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "obs"}) as rank:
        daemon = watch(tmp_path, rank.pid, receiver, mode="observe")
        assert rank.poll() is None
    receiver.close()
    assert summaries(receiver) and not any(s.startswith(("ACTED", "DRY RUN", "NOT ACTED")) for s in summaries(receiver))
    assert daemon.counters.snapshot()["actions_total"] == {}
    assert action_state(daemon) == 'stall_watchdog_action_state{mode="observe",state="observe"} 1.0'


def test_act_while_paused_by_the_file_ends_nothing_and_says_so(tmp_path: Path) -> None:
    receiver = Receiver()
    (tmp_path / "pause").touch()
    with python_target("queue", tmp_path, env={"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "p"}) as rank:
        daemon = watch(tmp_path, rank.pid, receiver, mode="act")
        assert rank.poll() is None
    receiver.close()
    said = [s for s in summaries(receiver) if s.startswith("NOT ACTED (paused)")]
    assert len(said) == 1 and str(tmp_path / "pause") in said[0]
    assert daemon.counters.snapshot()["actions_total"] == {}
    assert 'state="paused"' in action_state(daemon)


def test_check_config_finds_an_action_that_would_fail_every_time(tmp_path: Path) -> None:
    import subprocess
    import sys
    config = tmp_path / "config.yaml"
    config.write_text("actions:\n  mode: dry_run\n  do: [terminate_ranks, slurm, command, kubernetes]\n"
                      "  command: [/nonexistent/notify]\n  slurm: {scontrol: scontrol-not-installed}\n"
                      f"  kubernetes: {{token_file: {tmp_path / 'no-token'}}}\n")
    done = subprocess.run([sys.executable, "-m", "watchdog", "check-config", str(config)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 3, lines
    assert "actions.slurm: scontrol-not-installed is not an executable" in lines[0]
    assert "actions.command: /nonexistent/notify is not an executable" in lines[1]
    assert "actions.kubernetes: actions.kubernetes.token_file:" in lines[2]
    config.write_text("actions:\n  mode: observe\n  do: [command]\n  command: [/nonexistent/notify]\n")
    done = subprocess.run([sys.executable, "-m", "watchdog", "check-config", str(config)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr  # observing: nothing will run


def test_sighup_applies_a_new_policy(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    base = ("source: {kind: sim, scenario: healthy}\nexport: {listen_address: '127.0.0.1:0'}\n"
            f"bundles: {{directory: {tmp_path / 'incidents'}}}\n")
    config.write_text(base + "actions: {mode: observe}\n")
    from watchdog.config import load_config
    service = build(load_config(str(config)), config_path=str(config))
    daemon = service.daemon
    daemon.tick()
    assert 'mode="observe",state="observe"' in action_state(daemon)
    config.write_text(base + f"actions: {{mode: dry_run, pause_file: {tmp_path / 'pause'}}}\n")
    assert daemon.reload()
    daemon.tick()
    assert 'mode="dry_run",state="armed"' in action_state(daemon)
    assert daemon.responder.actions.cfg.mode == "dry_run"
    config.write_text(base + "actions: {mode: act, do: [command]}\n")  # no command given: rejected, kept
    assert not daemon.reload()
    daemon.tick()
    assert 'mode="dry_run"' in action_state(daemon)
    service.close(timeout=5)
