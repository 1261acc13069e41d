"""The exposition: a golden file from a scripted scenario, linted by promtool; the table is the API."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from tests.conftest import REPO, need_tool
from tests.fakes.daemon import daemon_config, stepping_clock
from watchdog.export.metrics import (
    METRICS,
    PREFIX,
    AlertRow,
    EpisodeView,
    Published,
    WatchdogCollector,
    metric_list_markdown,
    new_counters,
)
from watchdog.sample import sim
from watchdog.sample.rank_labels import RankRow
from watchdog.service import build
from watchdog.vocabulary.alert_identity import AlertIdentity
from watchdog.vocabulary.model import Severity, Signature, Workload

GOLDEN = REPO / "tests" / "golden" / "odd_rank.prom"
# Values that depend on the machine, not on the scenario.
_VOLATILE = re.compile(r'^(stall_watchdog_build_info\{.*|stall_watchdog_tick_duration_seconds|'
                       r'stall_watchdog_bundle_disk_bytes)( .*)$', re.M)


def scripted_exposition(tmp_path: Path) -> str:
    """odd_rank, 40 s into the wait on GPU 4: a waiting warning with its culprit, one bundle written."""
    ticks = iter(float(n) * 0.001 for n in range(10**6))
    service = build(daemon_config(tmp_path, source={"scenario": "odd_rank"}),
                    sim.SimSource(sim.SCENARIOS["odd_rank"], 1.0, 260, clock=stepping_clock(1.9e9)),
                    monotonic=lambda: next(ticks))
    daemon = service.daemon
    for _ in range(80):
        daemon.tick()
    service.close(timeout=5)
    daemon.tick()
    return service.exposition().decode()  # what GET /metrics serves


def test_exposition_matches_the_golden_file(tmp_path: Path) -> None:
    text = _VOLATILE.sub(lambda m: m.group(1) + " <varies>", scripted_exposition(tmp_path))
    if os.environ.get("STALL_WATCHDOG_RENEW_GOLDEN") == "1":  # a person renews it on purpose, then reviews the diff
        GOLDEN.write_text(text)
    assert GOLDEN.exists(), f"{GOLDEN} is missing: renew it with STALL_WATCHDOG_RENEW_GOLDEN=1 and review it"
    assert text == GOLDEN.read_text(), ("the exposition changed: review it, then renew the golden file with "
                                        "STALL_WATCHDOG_RENEW_GOLDEN=1")
    assert 'stall_watchdog_episode_culprit{gpu="4",signature="waiting"} 1.0' in text
    assert 'stall_watchdog_episode_state{gpu="0",signature="waiting"} 2.0' in text
    assert 'stall_watchdog_episodes_total{severity="warning",signature="waiting"} 1.0' in text


def test_our_exposition_is_prometheus_clients_byte_for_byte() -> None:
    """The server's own renderer against generate_latest on a busy 64-GPU state: every series, label
    values that need escaping (a job name with a quote, a backslash and a newline), counters."""
    snapshots = sim.run(sim.Scenario("wide", "", "h100", 64, 600, ((0, None, "train"), (40, None, "spin")), gpm=True))
    snapshot = [next(snapshots) for _ in range(60)][-1]
    sampled = snapshot.gpus[0]._replace(rank_waits=(7, 0, 960, 288, 0, 960, 290),
                                        nccl_waits=(7, 0, 90_500, 27_150, 0, 60_000, 18_600))
    snapshot = type(snapshot)(snapshot.time_seconds, (sampled, *snapshot.gpus[1:]))
    counters = new_counters()
    counters.inc("episodes_total", "busy_spin", "critical")
    counters.inc("component_errors_total", "sample")
    state = Published(snapshot, (EpisodeView(Signature.WAITING, Severity.WARNING, tuple(range(63)), (63,), 5.0),
                                 EpisodeView(Signature.BUSY_SPIN, None, (1, 2), (), 7.0)),
                      tuple(RankRow(g, 4000 + g, g, 'job "a\\b"\nx', Workload("ml", f"trainer-{g // 8}", "main", "4242",
                                                                              "0", 'o"neil'))
                            for g in range(64)),
                      (AlertRow(AlertIdentity(Signature.WAITING, "node-1", 'job "a\\b"', Workload("ml", "trainer-0")),
                                Severity.WARNING, "GPU 63 (rank 63, pid 4063)"),
                       AlertRow(AlertIdentity(Signature.THROTTLE, "node-1", gpu=5), Severity.WARNING, "")),
                      {"sample": True, "act": False},
                      1.9e9, 0.012, 123456, waits=((0, 0.31), (5, 0.06)), uneven=((2, "from_start", 0.12),))
    collector = WatchdogCollector(lambda: state, counters)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ours, theirs = collector.exposition(), generate_latest(registry)
    assert ours == theirs
    assert ours.count(b"\n") > 1500 and b'training_job="job \\"a\\\\b\\"\\nx"' in ours
    assert b'stall_watchdog_rank_wait_ratio{gpu="5"} 0.06' in ours
    assert b'stall_watchdog_rank_stack_waits_total{gpu="0",uuid="' in ours
    assert re.search(rb'stall_watchdog_rank_nccl_seconds_total\{gpu="0",uuid="[^"]*"\} 27.15\n', ours)
    assert re.search(rb'stall_watchdog_rank_nccl_wall_seconds_total\{gpu="0",uuid="[^"]*"\} 90.5\n', ours)
    assert b'stall_watchdog_rank_first_nccl_ratio{gpu="0"} 0.31' in ours
    assert b'stall_watchdog_uneven_work_ratio{gpu="2",why="from_start"} 0.12' in ours


def test_promtool_lints_the_exposition(tmp_path: Path) -> None:
    promtool = need_tool("promtool")
    result = subprocess.run([promtool, "check", "metrics"], input=scripted_exposition(tmp_path).encode(),
                            capture_output=True)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def test_names_follow_the_conventions() -> None:
    for spec in METRICS:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", spec.name)
        assert (spec.kind == "counter") == spec.name.endswith("_total"), spec.name
        assert "hostname" not in spec.labels and "host" not in spec.labels
        # Prometheus owns `job` and `instance` (scrape target labels): a metric label by those names is renamed.
        assert not {"job", "instance"} & set(spec.labels), spec.name
        if {"rank", "pid", "training_job"} & set(spec.labels):
            assert spec.name.endswith("_info"), f"{spec.name}: rank/pid/training_job labels only on an _info series"


def test_the_docs_list_every_metric_from_the_table() -> None:
    page = (REPO / "docs" / "metrics.md").read_text()
    assert metric_list_markdown() in page, "regenerate it: make docs"


@pytest.mark.parametrize("rules", ["deploy/prometheus/rules.yml", "deploy/grafana/stall-watchdog.json"])
def test_deploy_files_use_only_metrics_in_the_table(rules: str) -> None:
    known = {PREFIX + s.name for s in METRICS}
    used = set(re.findall(r"\b(stall_watchdog_[a-z0-9_]+)", (REPO / rules).read_text()))
    assert used and used <= known, f"unknown metrics: {used - known}"
