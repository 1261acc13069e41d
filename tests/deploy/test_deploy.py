"""What an operator installs: the systemd unit, the Prometheus rules, the Alertmanager route."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, need_tool

DEPLOY = REPO / "deploy"


def tool(name: str) -> str:
    return need_tool(name)


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    unit = (DEPLOY / "systemd" / "stall-watchdog.service").read_text()
    for needed in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "AmbientCapabilities=CAP_SYS_PTRACE",
                   "NoNewPrivileges=yes", "ProtectSystem=strict", "ReadWritePaths=/var/lib/stall-watchdog",
                   "ProtectHome=", "PrivateTmp=yes", "ExecReload=/bin/kill -HUP $MAINPID"):
        assert needed in unit, needed
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


def test_rules_cover_every_failure_the_watchdog_reports() -> None:
    rules = (DEPLOY / "prometheus" / "rules.yml").read_text()
    for alert in ("BusySpinHang", "ZeroUtilHang", "WaitingOnRank", "WaitingTooLong", "Underuse", "GpuLost",
                  "JobCollectiveHang", "JobCulpritNode", "StallWatchdogDown", "StaleSamples", "AlertsFailing",
                  "BundlesFailing"):
        assert re.search(rf"alert: \w*{alert}\b", rules), alert


def test_alertmanager_example_is_valid() -> None:
    result = subprocess.run([tool("amtool"), "check-config", str(DEPLOY / "alertmanager" / "alertmanager.yml")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_is_grafana_json_with_queries() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "stall-watchdog.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(queries) == len(dashboard["panels"]) >= 10
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "instance", "gpu"}
    per_gpu = [q for q in queries if "stall_watchdog_gpu_" in q]
    assert per_gpu and all('gpu=~"$gpu"' in q for q in per_gpu)  # the GPU picker filters every GPU panel
