"""What an operator installs: the systemd unit, the Prometheus rules, the Alertmanager route."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, need_tool
from watchdog.vocabulary.alert_identity import RUNBOOK_URL, alert_name, runbook_url
from watchdog.vocabulary.model import Signature

DEPLOY = REPO / "deploy"


def tool(name: str) -> str:
    return need_tool(name)


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    unit = (DEPLOY / "systemd" / "stall-watchdog.service").read_text()
    for needed in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "AmbientCapabilities=CAP_SYS_PTRACE",
                   "NoNewPrivileges=yes", "ProtectSystem=strict", "ReadWritePaths=/var/lib/stall-watchdog",
                   "ProtectHome=", "PrivateTmp=yes", "ExecReload=/bin/kill -HUP $MAINPID"):
        assert needed in unit, needed
    # `systemctl help` opens what Documentation= names: pages that exist for every install (pip installs no
    # README under /opt), the runbook being the one the alerts link to
    from watchdog.config import AlertsConfig
    [documentation] = [line.split("=", 1)[1].split() for line in unit.splitlines()
                       if line.startswith("Documentation=")]
    assert all(url.startswith("https://") for url in documentation), documentation
    assert AlertsConfig().runbook_url in documentation
    assert (REPO / "docs" / AlertsConfig().runbook_url.rsplit("/docs/", 1)[1]).is_file()
    # systemd-analyze checks that ExecStart exists: verify a copy that starts this checkout's command,
    # identical but for that path.
    installed = str(Path(sys.executable).with_name("stall-watchdog"))  # this environment's console script
    assert Path(installed).exists(), installed
    copy = tmp_path / "stall-watchdog.service"
    copy.write_text(unit.replace("/opt/stall-watchdog/bin/stall-watchdog", installed))
    assert sum(a != b for a, b in zip(unit.splitlines(), copy.read_text().splitlines())) == 1
    result = subprocess.run([tool("systemd-analyze"), "verify", str(copy)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "stall-watchdog.service" not in result.stderr, result.stderr  # no warnings about our unit


def test_prometheus_rules_check_and_unit_tests_pass() -> None:
    promtool = tool("promtool")
    check = subprocess.run([promtool, "check", "rules", str(DEPLOY / "prometheus" / "rules.yml")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    tests = subprocess.run([promtool, "test", "rules", "rules_test.yml"], cwd=DEPLOY / "prometheus",
                           capture_output=True, text=True)
    assert tests.returncode == 0, tests.stdout + tests.stderr


def _rules() -> list[dict[str, object]]:
    groups = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_rules_cover_every_failure_the_watchdog_reports() -> None:
    names = {str(rule["alert"]) for rule in _rules()}
    # One rule per signature, named as the daemon names its own alert: Alertmanager keeps one of the two.
    for signature in Signature:
        assert alert_name(signature) in names, signature
        (rule,) = [r for r in _rules() if r["alert"] == alert_name(signature)]
        assert f'stall_watchdog:episode_alert:held{{signature="{signature.value}"}}' == str(rule["expr"]).strip()
    groups = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())["groups"]
    (held,) = [r for g in groups for r in g["rules"] if r.get("record") == "stall_watchdog:episode_alert:held"]
    assert "stall_watchdog_episode_alert_info" in str(held["expr"])
    for alert in ("JobCollectiveHang", "JobCulpritNode", "Down", "StaleSamples", "ComponentFailing",
                  "AlertsFailing", "BundlesFailing"):
        assert "StallWatchdog" + alert in names, alert


def test_every_alert_links_its_runbook_section() -> None:
    """Every page carries a runbook_url, the daemon's and the rules' alike, to a section that exists."""
    runbook = (REPO / "docs" / "runbook.md").read_text()
    anchors = {line[3:].strip().lower() for line in runbook.splitlines() if line.startswith("## ")}
    for rule in _rules():
        annotations = rule["annotations"]
        assert isinstance(annotations, dict)
        base, _, anchor = str(annotations["runbook_url"]).partition("#")
        assert base == RUNBOOK_URL and anchor == str(rule["alert"]).lower() and anchor in anchors, rule["alert"]
    for signature in Signature:
        assert runbook_url(signature).partition("#")[2] in anchors


def test_alertmanager_example_is_valid() -> None:
    result = subprocess.run([tool("amtool"), "check-config", str(DEPLOY / "alertmanager" / "alertmanager.yml")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("labels", "receivers"), [
    # a stall pages, once per training job; its warning goes to chat; the job-level alerts reach the coordinator
    (["alertname=StallWatchdogBusySpin", "severity=critical", "node=a", "training_job=run:1"], "pager"),
    (["alertname=StallWatchdogWaiting", "severity=warning", "node=a", "training_job=run:1"], "chat"),
    (["alertname=StallWatchdogZeroUtil", "severity=critical", "node=a", "training_job=unknown"], "pager"),
    (["alertname=StallWatchdogJobCollectiveHang", "severity=critical", "training_job=run:1"], "coordinator,pager"),
    (["alertname=StallWatchdogJobCulpritNode", "severity=warning", "training_job=run:1"], "coordinator,chat"),
    (["alertname=StallWatchdogDown", "severity=critical", "instance=a:9944"], "pager"),
    (["alertname=StallWatchdogAlertsFailing", "severity=warning", "instance=a:9944"], "chat"),
])
def test_alertmanager_example_routes(labels: list[str], receivers: str) -> None:
    result = subprocess.run([tool("amtool"), "config", "routes", "test", "--config.file",
                             str(DEPLOY / "alertmanager" / "alertmanager.yml"), *labels],
                            capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == receivers, result.stdout + result.stderr


def test_dashboard_is_grafana_json_with_queries() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "stall-watchdog.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(queries) == len(dashboard["panels"]) >= 10
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "instance", "gpu"}
    per_gpu = [q for q in queries if "stall_watchdog_gpu_" in q]
    assert per_gpu and all('gpu=~"$gpu"' in q for q in per_gpu)  # the GPU picker filters every GPU panel
    # A counter plotted raw is a line that only climbs: every _total is read through rate() or increase()
    import re
    for query in queries:
        for counter in re.finditer(r"stall_watchdog_\w+_total\{[^}]*\}(\[[^\]]+\])?", query):
            assert counter.group(1), f"the counter in {query!r} is plotted raw"


def verified_with_the_unit(tmp: Path, name: str) -> str:
    """deploy/systemd/<name> as systemd reads it, the unit with the drop-in beside it: its text, once
    `systemd-analyze verify` finds nothing wrong with either."""
    unit = (DEPLOY / "systemd" / "stall-watchdog.service").read_text()
    drop_in = (DEPLOY / "systemd" / name).read_text()
    installed = str(Path(sys.executable).with_name("stall-watchdog"))
    (tmp / "stall-watchdog.service").write_text(unit.replace("/opt/stall-watchdog/bin/stall-watchdog", installed))
    (tmp / "stall-watchdog.service.d").mkdir()
    (tmp / "stall-watchdog.service.d" / name).write_text(drop_in)
    result = subprocess.run([tool("systemd-analyze"), "verify", str(tmp / "stall-watchdog.service")],
                            capture_output=True, text=True)
    assert result.returncode == 0 and name not in result.stderr, result.stderr
    return drop_in


def test_the_actions_drop_in_verifies_with_the_unit_and_adds_only_cap_kill_to_its_set(tmp_path: Path) -> None:
    """deploy/systemd/actions.conf, as systemd reads it: the unit with the drop-in beside it."""
    drop_in = verified_with_the_unit(tmp_path, "actions.conf")
    caps = {line.split("=", 1)[1] for line in drop_in.splitlines() if line.startswith(("Ambient", "CapabilityB"))}
    assert caps == {"CAP_SYS_PTRACE CAP_DAC_READ_SEARCH CAP_KILL"}


def test_the_dump_token_drop_in_verifies_with_the_unit(tmp_path: Path) -> None:
    """deploy/systemd/dump-token.conf hands the dynamic user the token the Slurm epilog sends."""
    drop_in = verified_with_the_unit(tmp_path, "dump-token.conf")
    assert "LoadCredential=dump.token:/etc/stall-watchdog/dump.token" in drop_in.splitlines()
    assert "/etc/stall-watchdog/dump.token" in (DEPLOY / "slurm" / "epilog.sh").read_text()
