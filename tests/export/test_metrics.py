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
from watchdog.export.metrics import AlertRow, EpisodeView, Published, WatchdogCollector, new_counters
from watchdog.export.series import METRICS, PREFIX, SERIES_MODES, metric_list_markdown
from watchdog.sample import sim
from watchdog.sample.rank_labels import RankRow
from watchdog.service import build
from watchdog.vocabulary.alert_identity import AlertIdentity
from watchdog.vocabulary.model import GpuHealth, Severity, Signature, Workload

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


def test_a_value_is_written_as_prometheus_client_writes_it() -> None:
    """go_float against prometheus_client's floatToGoString: the exponents Go turns to sooner than Python."""
    import random

    from prometheus_client.utils import floatToGoString

    from watchdog.export.metrics import go_float

    rng = random.Random(58)
    values = [0.0, -0.0, 1.0, -1.0, 1e6, 999999.0, 1234567.0, 1e21, 1e-7, 2**53, float("inf"), -float("inf"),
              float("nan"), 0.1 + 0.2, 80 << 30, 1.9e9, -1e9]
    values += [rng.uniform(-1, 1) * 10 ** rng.randint(-12, 24) for _ in range(5000)]
    assert [go_float(v) for v in values] == [floatToGoString(v) for v in values]


@pytest.mark.parametrize("mode", SERIES_MODES)
def test_our_exposition_is_prometheus_clients_byte_for_byte(mode: str) -> None:
    """The server's own renderer against generate_latest on a busy 64-GPU state: every series, label
    values that need escaping (a job name with a quote, a backslash and a newline), counters; in each
    export.series setting."""
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
                                                                              "0", 'o"neil'),
                                    "pod" if g < 32 else "", "1000" if g < 32 else "")
                            for g in range(64)),
                      (AlertRow(AlertIdentity(Signature.WAITING, "node-1", 'job "a\\b"', Workload("ml", "trainer-0")),
                                Severity.WARNING, "GPU 63 (rank 63, pid 4063)"),
                       AlertRow(AlertIdentity(Signature.THROTTLE, "node-1", gpu=5), Severity.WARNING, "")),
                      {"sample": True, "act": False},
                      1.9e9, 0.012, 123456, waits=((0, 0.31), (5, 0.06)), uneven=((2, "from_start", 0.12),))
    collector = WatchdogCollector(lambda: state, counters, mode)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ours, theirs = collector.exposition(), generate_latest(registry)
    assert ours == theirs
    assert ours.count(b"\n") > 300 and b'training_job="job \\"a\\\\b\\"\\nx"' in ours
    assert (b'stall_watchdog_rank_wait_ratio{gpu="5"} 0.06' in ours) == (mode == "full")
    assert (b"stall_watchdog_gpu_utilization_ratio{" in ours) == (mode != "beside_dcgm")
    assert b'stall_watchdog_gpu_info{gpu="0",memory_total_bytes="85899345920",name="NVIDIA H100 80GB HBM3",' in ours
    full = mode == "full"
    assert (b'stall_watchdog_rank_stack_waits_total{gpu="0",uuid="' in ours) == full
    assert bool(re.search(rb'stall_watchdog_rank_nccl_seconds_total\{gpu="0",uuid="[^"]*"\} 27.15\n', ours)) == full
    assert bool(re.search(rb'stall_watchdog_rank_nccl_wall_seconds_total\{gpu="0",uuid="[^"]*"\} 90.5\n', ours)) == full
    assert (b'stall_watchdog_rank_first_nccl_ratio{gpu="0"} 0.31' in ours) == full
    # the job view in every setting: GPU 0's rank is trainer-0's, proven (GPUs 0-31)
    job = b'{namespace="ml",pod="trainer-0",slurm_job_id="4242",training_job="job \\"a\\\\b\\"\\nx",uid="1000"}'
    assert b"stall_watchdog_job_state" + job + b" 2.0" in ours  # its GPUs wait (a warning)
    waits = job.replace(b'pod="trainer-0",', b"")  # one figure for the job's ranks, whatever their pods
    assert b"stall_watchdog_job_first_wait_ratio" + waits + b" 0.3020833333333333" in ours  # GPU 0's 290 of 960
    assert b"stall_watchdog_job_first_nccl_ratio" + waits + b" 0.31" in ours
    assert b"stall_watchdog_job_wait_ratio{" not in ours  # one render: no window of counts yet
    assert b"stall_watchdog_job_culprit{" not in ours  # GPU 63, the culprit, is not a proven rank's
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
        if {"rank", "pid"} & set(spec.labels):
            assert spec.name.endswith("_info"), f"{spec.name}: rank/pid labels only on an _info series"
        if "training_job" in spec.labels and not spec.name.endswith("_info"):  # the job view: one a job, no GPU
            assert spec.name.startswith("job_") and not {"gpu", "rank", "pid"} & set(spec.labels), spec.name


def test_the_docs_list_every_metric_from_the_table() -> None:
    page = (REPO / "docs" / "metrics.md").read_text()
    assert metric_list_markdown() in page, "regenerate it: make docs"


@pytest.mark.parametrize("rules", ["deploy/prometheus/rules.yml", "deploy/grafana/stall-watchdog.json"])
def test_deploy_files_use_only_metrics_in_the_table(rules: str) -> None:
    known = {PREFIX + s.name for s in METRICS}
    used = set(re.findall(r"\b(stall_watchdog_[a-z0-9_]+)", (REPO / rules).read_text()))
    assert used and used <= known, f"unknown metrics: {used - known}"


def _node(gpus: int = 8) -> tuple[object, tuple[RankRow, ...]]:
    """A healthy 8-GPU H100 node (GPM readings) with one rank on each GPU whose stacks are sampled."""
    snapshots = sim.run(sim.Scenario("budget", "", "h100", gpus, 600, ((0, None, "train"),), gpm=True))
    snapshot = [next(snapshots) for _ in range(30)][-1]
    sampled = tuple(g._replace(rank_waits=(7, g.index, 960, 288, 0, 600, 190)) for g in snapshot.gpus)
    ranks = tuple(RankRow(g, 4000 + g, g, "run-1", Workload(), "launcher", "1000") for g in range(gpus))
    return type(snapshot)(snapshot.time_seconds, sampled), ranks


def _rows(text: str) -> tuple[list[str], list[str]]:
    """(the series of a GPU, the node's own) of an exposition."""
    rows = [line for line in text.splitlines() if line and not line.startswith("#")]
    gpu = [line for line in rows if re.search(r'[{,]gpu="[^"]', line)]
    return gpu, [line for line in rows if line not in gpu]


def test_the_standard_series_fit_the_budget_healthy_and_in_a_hang() -> None:
    """At most 12 series a GPU and 30 a node (docs/metrics.md), with a rank on every GPU: healthy, and
    while every GPU waits on GPU 4 (an open episode on each, its culprit, an alert); full keeps every reading."""
    snapshot, ranks = _node()
    counters = new_counters()
    healthy = Published(snapshot, ranks=ranks, component_up={"sample": True, "act": True}, last_sample_wall=1.9e9)
    waiting = EpisodeView(Signature.WAITING, Severity.CRITICAL, tuple(range(8)), (4,), 1.9e9 - 60)
    hung = Published(snapshot, (waiting,), ranks,
                     (AlertRow(AlertIdentity(Signature.WAITING, "node-1", "run-1"), Severity.CRITICAL, "GPU 4"),),
                     {"sample": True, "act": True}, 1.9e9, uneven=((2, "from_start", 0.12),))
    for state in (healthy, hung):
        text = WatchdogCollector(lambda s=state: s, counters).exposition().decode()
        gpu, node = _rows(text)
        assert len(gpu) <= 12 * 8 and len(node) <= 30, (len(gpu), len(node))
        assert 'stall_watchdog_episode_state{gpu="0",signature="busy_spin"}' not in text  # no state while none open
        full_gpu, _ = _rows(WatchdogCollector(lambda s=state: s, counters, "full").exposition().decode())
        assert len(full_gpu) > 30 * 8  # every reading and every signature's state, as before the budget
    assert 'stall_watchdog_episode_state{gpu="0",signature="waiting"} 3.0' in text
    assert 'stall_watchdog_episode_culprit{gpu="4",signature="waiting"} 1.0' in text


def test_sparse_series_show_only_what_is_wrong() -> None:
    """A GPU with ECC errors, one lost and one throttled show them; the healthy GPUs show no fault rows
    and no health; `full` shows every row, zeros and ok included."""
    snapshot, ranks = _node()
    gpus = list(snapshot.gpus)
    gpus[1] = gpus[1]._replace(ecc_corrected=3, ecc_uncorrected=0)
    gpus[2] = gpus[2]._replace(health=GpuHealth.LOST)
    gpus[3] = gpus[3]._replace(clock_event_reasons=0x40)
    gpus[0] = gpus[0]._replace(ecc_corrected=0, ecc_uncorrected=0, clock_event_reasons=0)
    state = Published(type(snapshot)(snapshot.time_seconds, tuple(gpus)), ranks=ranks)
    text = WatchdogCollector(lambda: state, new_counters()).exposition().decode()
    assert re.search(r'stall_watchdog_gpu_ecc_corrected_errors\{gpu="1",uuid="[^"]*"\} 3.0', text)
    assert 'ecc_corrected_errors{gpu="0"' not in text and 'ecc_uncorrected_errors{gpu="1"' not in text
    assert re.findall(r'stall_watchdog_gpu_health\{gpu="(\d)",health="(\w+)"', text) == [("2", "lost")]
    assert re.findall(r'stall_watchdog_gpu_throttle\{gpu="(\d)"', text) == ["3"]
    full = WatchdogCollector(lambda: state, new_counters(), "full").exposition().decode()
    assert re.search(r'stall_watchdog_gpu_health\{gpu="0",health="ok",uuid="[^"]*"\} 1.0', full)
    assert re.search(r'stall_watchdog_gpu_ecc_corrected_errors\{gpu="0",uuid="[^"]*"\} 0.0', full)
    assert re.search(r'stall_watchdog_gpu_throttle\{gpu="0",uuid="[^"]*"\} 0.0', full)


def test_a_fact_that_fails_to_read_keeps_its_gpu_info_series() -> None:
    """The power limit unread for a tick (NVML's [N/A]) leaves gpu_info as it was: one series, not a second
    with an empty label; a limit set anew is a new value."""
    snapshot, ranks = _node(1)
    gpu = snapshot.gpus[0]
    states = [Published(type(snapshot)(snapshot.time_seconds, (g,))) for g in
              (gpu, gpu._replace(power_limit_watts=None), gpu._replace(power_limit_watts=450.0))]
    now = [states[0]]
    collector = WatchdogCollector(lambda: now[0], new_counters())
    infos = []
    for state in states:
        now[0] = state
        infos += re.findall(r'stall_watchdog_gpu_info\{.*power_limit_watts="([^"]*)"', collector.exposition().decode())
    assert infos == ["700", "700", "450"]


def test_the_setting_offers_the_tables_modes() -> None:
    from typing import get_args

    from watchdog.config.outputs import ExportConfig

    assert get_args(ExportConfig.model_fields["series"].annotation) == SERIES_MODES
