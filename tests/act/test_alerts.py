"""Alert delivery against real local receivers: labels and resolve, dedupe, rate limit, the command
hook, and secrets kept out of the logs."""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.conftest import until
from tests.fakes.daemon import Receiver
from watchdog.act.alerts import Alert, AlertDispatcher, AlertmanagerReceiver, build_receivers
from watchdog.config import parse_config
from watchdog.export.metrics import new_counters
from watchdog.plumbing.counters import Counters
from watchdog.vocabulary.alert_identity import AlertIdentity
from watchdog.vocabulary.model import Severity, Signature


def alerts_config(receivers: list[dict[str, object]], **extra: object):  # type: ignore[no-untyped-def]
    return parse_config({"alerts": {"receivers": receivers, "backoff_seconds": 0.05, "max_attempts": 2,
                                    **extra}}).alerts


def alert(key: str = "busy_spin@1", status: str = "firing", severity: str = "critical") -> Alert:
    return Alert(key=key, status=status, identity=AlertIdentity(Signature.BUSY_SPIN, "node-a", "run:llm"),
                 severity=Severity(severity), gpus=(0, 1), culprit_gpus=(), summary="Busy-spin hang on GPUs 0-1",
                 onset=1.9e9, at=1.9e9 + 40, bundle="/var/lib/stall-watchdog/incidents/x",
                 runbook_url="https://runbooks.example/stall#stallwatchdogbusyspin")


def deliver(config, *alerts: Alert) -> Counters:  # type: ignore[no-untyped-def]
    counters = new_counters()
    dispatcher = AlertDispatcher(config, counters)
    for a in alerts:
        dispatcher.submit(a)
    dispatcher.close(timeout=5)
    return counters


def test_alertmanager_fires_then_resolves_with_the_same_labels() -> None:
    server = Receiver()
    try:
        deliver(alerts_config([{"type": "alertmanager", "name": "am", "url": server.url}]),
                alert(), alert(status="resolved"))
    finally:
        server.close()
    (path1, (fired,)), (path2, (resolved,)) = server.requests
    assert path1 == path2 == "/api/v2/alerts"
    # the labels the shipped rules give the same incident (tests/deploy checks the rules' side)
    assert fired["labels"] == resolved["labels"] == {
        "alertname": "StallWatchdogBusySpin", "severity": "critical", "signature": "busy_spin", "node": "node-a",
        "training_job": "run:llm"}
    # a firing alert ends by itself unless refreshed (a dead daemon's alerts do not fire forever)
    ends = datetime.fromisoformat(fired["endsAt"]).timestamp()
    assert 250 < ends - time.time() <= 300 and resolved["endsAt"].startswith("2030-")
    assert fired["annotations"]["bundle"] == "/var/lib/stall-watchdog/incidents/x"
    assert fired["annotations"]["runbook_url"] == "https://runbooks.example/stall#stallwatchdogbusyspin"


def test_an_escalation_ends_the_warning_in_the_same_request() -> None:
    """As the rules do: the warning alert resolves when the critical one fires, so Alertmanager never holds
    a stale warning that later reads as an all-clear."""
    server = Receiver()
    try:
        deliver(alerts_config([{"type": "alertmanager", "name": "am", "url": server.url}]),
                alert(severity="warning"), alert(severity="critical"), alert(status="resolved"))
    finally:
        server.close()
    (_, (warning,)), (_, (ended, critical)), (_, (resolved,)) = server.requests
    assert warning["labels"]["severity"] == ended["labels"]["severity"] == "warning"
    assert ended["endsAt"].startswith("2030-") and not critical["endsAt"].startswith("2030-")
    assert critical["labels"] == resolved["labels"] == {**warning["labels"], "severity": "critical"}


def test_alertmanager_is_told_again_while_the_alert_fires(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(AlertmanagerReceiver, "refresh_seconds", 0.3)
    server = Receiver()
    try:
        config = alerts_config([{"type": "alertmanager", "name": "am", "url": server.url}])
        counters = new_counters()
        dispatcher = AlertDispatcher(config, counters)
        dispatcher.submit(alert())
        until(lambda: counters.get("alerts_total", "am", "refreshed") >= 2, 60, "two refreshes of a firing alert")
        dispatcher.submit(alert(status="resolved"))
        time.sleep(0.8)  # resolved: no more refreshes
        dispatcher.close(timeout=5)
    finally:
        server.close()
    statuses = ["firing" if not body[0]["endsAt"].startswith("2030-") else "resolved" for _, body in server.requests]
    assert statuses[0] == "firing" and statuses[-1] == "resolved" and statuses.count("resolved") == 1
    assert statuses.count("firing") >= 3, statuses
    assert counters.get("alerts_total", "am", "refreshed") == statuses.count("firing") - 1


def test_the_same_alert_goes_out_once_and_floods_are_limited() -> None:
    server = Receiver()
    try:
        config = alerts_config([{"type": "webhook", "name": "hook", "url": server.url}], rate_limit_per_minute=2)
        counters = deliver(config, alert("a"), alert("a"), alert("b"), alert("c"))
    finally:
        server.close()
    assert [body["alert"]["key"] for _, body in server.requests] == ["a", "b"]
    assert counters.get("alerts_total", "hook", "deduplicated") == 1
    assert counters.get("alerts_total", "hook", "rate_limited") == 1
    assert counters.get("alerts_total", "hook", "sent") == 2


def test_min_severity_filters() -> None:
    server = Receiver()
    try:
        deliver(alerts_config([{"type": "webhook", "name": "pager", "url": server.url, "min_severity": "critical"}]),
                alert("w", severity="warning"), alert("c"))
    finally:
        server.close()
    assert [body["alert"]["key"] for _, body in server.requests] == ["c"]


def test_the_coordinator_is_paged_once_for_a_critical_hang_of_a_known_job(tmp_path: Path) -> None:
    """Only a firing critical stall of a known training job pages the coordinator, with the Slurm job the daemon
    proved; a Slurm id only the rank's environment claims stays behind, and per-GPU alerts and resolutions are
    not the coordinator's."""
    from dataclasses import replace

    from watchdog.vocabulary.model import Workload
    token = tmp_path / "token"
    token.write_text("caller-token-0123456789\n")
    token.chmod(0o600)
    proven = AlertIdentity(Signature.ZERO_UTIL, "node-a", "slurm:42", Workload(slurm_job_id="42"))
    claimed = AlertIdentity(Signature.BUSY_SPIN, "node-a", "run:x",
                            Workload(slurm_job_id="7", claimed=("slurm_job_id",)))
    server = Receiver()
    try:
        deliver(alerts_config([{"type": "coordinator", "name": "coordinator", "url": server.url + "/base/",
                                "token_file": str(token)}]),
                alert("warn", severity="warning"), replace(alert("proven"), identity=proven),
                replace(alert("proven"), identity=proven),  # the same episode again: once
                replace(alert("proven", status="resolved"), identity=proven),
                replace(alert("claimed"), identity=claimed),
                replace(alert("pod"), identity=AlertIdentity(Signature.BUSY_SPIN, "node-a", "run:k",
                                                             Workload(namespace="training", pod="llm-0"))),
                replace(alert("gpu"), identity=AlertIdentity(Signature.GPU_LOST, "node-a", "run:y", gpu=3)),
                replace(alert("nobody"), identity=AlertIdentity(Signature.BUSY_SPIN, "node-a")))
    finally:
        server.close()
    assert server.requests == [("/base/v1/alerts", {"training_job": "slurm:42", "slurm_job_id": "42"}),
                               ("/base/v1/alerts", {"training_job": "run:x"}),
                               ("/base/v1/alerts", {"training_job": "run:k", "namespace": "training", "pod": "llm-0"})]
    assert {h["Authorization"] for h in server.headers} == {"Bearer caller-token-0123456789"}


def test_command_gets_the_alert_on_stdin_and_the_bundle_as_argument(tmp_path: Path) -> None:
    out = tmp_path / "got.json"
    script = ("import json, sys; data = json.load(sys.stdin); "
              f"open({str(out)!r}, 'w').write(json.dumps({{'alert': data, 'argv': sys.argv[1:]}}))")
    counters = deliver(alerts_config([{"type": "command", "name": "hook", "argv": [sys.executable, "-c", script]}]),
                       alert())
    got = json.loads(out.read_text())
    assert got["argv"] == ["/var/lib/stall-watchdog/incidents/x"]
    assert got["alert"]["alertname"] == "StallWatchdogBusySpin" and got["alert"]["status"] == "firing"
    assert counters.get("alerts_total", "hook", "sent") == 1


def test_a_failing_command_is_retried_then_counted() -> None:
    counters = deliver(alerts_config([{"type": "command", "name": "hook", "argv": ["false"]}]), alert())
    assert counters.get("alerts_total", "hook", "failed") == 1


def test_secrets_come_from_files_and_never_reach_the_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dead = "http://127.0.0.1:9/hooks/T0KEN-s3cret"  # nothing listens on port 9
    (tmp_path / "url").write_text(dead + "\n")
    (tmp_path / "token").write_text("bearer-s3cret\n")
    config = alerts_config([{"type": "webhook", "name": "slack", "url_file": str(tmp_path / "url"),
                             "token_file": str(tmp_path / "token")}])
    caplog.set_level(logging.INFO, logger="stall_watchdog")
    counters = deliver(config, alert())
    assert counters.get("alerts_total", "slack", "failed") == 1
    assert "receiver=slack" in caplog.text
    assert "s3cret" not in caplog.text and "T0KEN" not in caplog.text


def test_a_missing_secret_names_the_receiver(tmp_path: Path) -> None:
    config = alerts_config([{"type": "webhook", "name": "slack", "url_env": "NO_SUCH_VARIABLE_FOR_TEST"}])
    with pytest.raises(ValueError,
                       match="receiver slack: url_env: environment variable NO_SUCH_VARIABLE_FOR_TEST is not set"):
        build_receivers(config)


def test_a_hung_receiver_does_not_hold_up_another() -> None:
    """The healthy receiver gets its alert while the hung one still holds its request (a dispatcher that
    delivered in turn would reach it only once the hung request timed out, a minute on)."""
    hung, fine = Receiver("hold"), Receiver()
    try:
        config = alerts_config([{"type": "webhook", "name": "hung", "url": hung.url, "timeout_seconds": 60},
                                {"type": "webhook", "name": "fine", "url": fine.url}])
        counters = new_counters()
        dispatcher = AlertDispatcher(config, counters)
        dispatcher.submit(alert())
        until(lambda: fine.requests, 50, "the healthy receiver's alert")
        assert hung.requests and hung.holding == 1, "the hung receiver's request was no longer held"
        dispatcher.close(timeout=1)
    finally:
        hung.close()
        fine.close()


class _BuggyReceiver:
    """A receiver whose first send raises something no receiver should: a bug, not a delivery failure."""

    name = "buggy"
    min_severity = "warning"

    def __init__(self) -> None:
        self.sent: list[str] = []

    def send(self, alert: Alert) -> None:
        if not self.sent:
            self.sent.append("boom")
            raise KeyError("a bug in the receiver")
        self.sent.append(alert.key)


def test_a_receiver_bug_costs_one_alert_never_the_worker() -> None:
    counters = new_counters()
    receiver = _BuggyReceiver()
    dispatcher = AlertDispatcher(alerts_config([]), counters, [receiver])  # type: ignore[list-item]
    dispatcher.submit(alert("first"))
    until(lambda: counters.get("alerts_total", "buggy", "failed") >= 1, 60, "the bug counted as a failed alert")
    assert dispatcher.receiver_up() == {"receiver_buggy": False}
    assert counters.get("component_errors_total", "receiver_buggy") == 1
    dispatcher.submit(alert("second"))
    dispatcher.close(timeout=5)
    assert receiver.sent == ["boom", "second"] and dispatcher.receiver_up() == {"receiver_buggy": True}
