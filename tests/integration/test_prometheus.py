"""Real Prometheus and Alertmanager on loopback, scraping real `stall-watchdog run` daemons:

- node A plays a busy-spin hang: the shipped rule StallWatchdogBusySpin fires in Prometheus, the daemon's
  own Alertmanager receiver sends its alert too, and Alertmanager (running the shipped routing, its
  receivers pointed at a local sink) holds one alert and sends one page;
- node B plays one odd rank (GPU 4) with real processes on its GPUs: culprit and rank series appear;
- every Grafana panel query returns data from that Prometheus.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, TARGETS, need_tool, wait_for
from tests.fakes.loopback import free_port, get_json
from tests.fakes.nccl_inspector import line
from watchdog.act import fleet
from watchdog.config import FleetConfig
from watchdog.export.series import METRICS, PREFIX

LEDGER_AT = 1_700_000_000.0  # in the past: a ledger entry from the future is dropped at load


def until(check, timeout: float, what: str) -> object:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except OSError as exc:
            last = exc
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    prometheus, alertmanager = need_tool("prometheus"), need_tool("prometheus-alertmanager")
    tmp = tmp_path_factory.mktemp("stack")
    ports = {name: free_port() for name in ("prom", "am", "a", "b")}
    processes: list[subprocess.Popen[bytes]] = []

    def start(args: list[str], log: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=(tmp / log).open("wb"),
                                   env={**os.environ, **(env or {})})
        processes.append(process)
        return process

    inspector, writing = tmp / "nccl-inspector", threading.Event()
    inspector.mkdir()
    try:
        # Real processes standing in for node B's ranks (one per GPU), launched with rank variables; they enable
        # NCCL's Inspector, whose lines a thread writes for them (the plugin needs NCCL and a GPU).
        readies = []
        pids: dict[int, list[int]] = {}
        for gpu in range(8):
            ready = tmp / f"rank-{gpu}"
            readies.append(ready)
            rank = start([sys.executable, str(TARGETS / "stuck.py"), "queue", str(ready)], f"rank{gpu}.log",
                         {"RANK": str(gpu), "WORLD_SIZE": "8", "LOCAL_RANK": str(gpu),
                          "TORCHELASTIC_RUN_ID": "llm-42",  # torchrun under srun: Slurm's variables too
                          "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_JOB_USER": "alice",
                          "NCCL_INSPECTOR_ENABLE": "1", "NCCL_INSPECTOR_DUMP_DIR": str(inspector)})
            pids[gpu] = [rank.pid]
        wait_for(readies, processes=processes)
        logs = {gpu: inspector / f"{socket.gethostname()}-pid{pid}.log" for gpu, (pid,) in pids.items()}
        threading.Thread(target=collectives, args=(logs, writing), daemon=True).start()

        sink = Sink()
        shipped = (REPO / "deploy" / "alertmanager" / "alertmanager.yml").read_text()
        (tmp / "coordinator-token").write_text("callers-token\n")
        shipped = shipped.replace("/etc/alertmanager/coordinator-token", str(tmp / "coordinator-token"))
        (tmp / "am.yml").write_text(re.sub(r"http://127\.0\.0\.1:\d+/(\w+)(/\w+)?",
                                           lambda m: f"{sink.url}/{m.group(1)}", shipped))
        start([alertmanager, f"--config.file={tmp / 'am.yml'}", f"--storage.path={tmp / 'am-data'}",
               f"--web.listen-address=127.0.0.1:{ports['am']}", "--cluster.listen-address="], "am.log")
        am_url = f"http://127.0.0.1:{ports['am']}"
        until(lambda: get_json(am_url + "/api/v2/status"), 60, "Alertmanager to start")

        # Node A once acted on Slurm job 4242 (its ledger, kept on disk, outlives the daemon's restarts).
        (tmp / "incidents-a").mkdir(mode=0o700)
        (tmp / "incidents-a" / "actions-ledger.json").write_text(json.dumps([[LEDGER_AT, "slurm:4242"]]))
        for node, scenario, extra in (("a", "spin_hang", ""), ("b", "odd_rank", f"  pids: {json.dumps(pids)}\n")):
            (tmp / f"{node}.yaml").write_text(
                f"source:\n  kind: sim\n  scenario: {scenario}\n  start_offset_seconds: 292\n{extra}"
                f"export: {{listen_address: '127.0.0.1:{ports[node]}'}}\n"
                f"bundles: {{directory: '{tmp / ('incidents-' + node)}'}}\n"
                f"stacks: {{observe_seconds: 0.2, sample_seconds: 4, sample_rate_hz: 40}}\n"
                f"alerts:\n  instance: node-{node}\n  receivers:\n"
                f"    - {{type: alertmanager, name: am, url: '{am_url}'}}\n")
            start([sys.executable, "-m", "watchdog", "run", "--config", str(tmp / f"{node}.yaml")], f"{node}.log")

        (tmp / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"alerting: {{alertmanagers: [{{static_configs: [{{targets: ['127.0.0.1:{ports['am']}']}}]}}]}}\n"
            f"rule_files: ['{REPO / 'deploy' / 'prometheus' / 'rules.yml'}']\n"
            "scrape_configs:\n  - job_name: stall-watchdog\n    static_configs:\n"
            f"      - targets: ['127.0.0.1:{ports['a']}', '127.0.0.1:{ports['b']}']\n")
        start([prometheus, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'prom-data'}",
               f"--web.listen-address=127.0.0.1:{ports['prom']}"], "prom.log")
        prom_url = f"http://127.0.0.1:{ports['prom']}"
        until(lambda: get_json(prom_url + "/-/ready") if False else urllib.request.urlopen(prom_url + "/-/ready"),
              60, "Prometheus to start")
        yield {"prom": prom_url, "am": am_url, "tmp": tmp, "node_a": f"127.0.0.1:{ports['a']}", "sink": sink}
    finally:
        writing.set()
        stop_all(processes)
        sink.close()


def collectives(logs: dict[int, Path], done: threading.Event) -> None:
    """Each rank's NCCL Inspector log gains a collective a second, 300 ms of it inside the collective."""
    sn = 0
    while not done.wait(1.0):
        sn += 1
        for gpu, log in logs.items():
            with log.open("a") as out:
                out.write(line(gpu, sn, 300_000))


class Sink:
    """Alertmanager's webhook receivers, on loopback: every notification, by the path it came to."""

    def __init__(self) -> None:
        received: list[tuple[str, dict[str, object]]] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                received.append((self.path, json.loads(body)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.received = received
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def stop_all(processes: list[subprocess.Popen[bytes]]) -> None:
    """Terminate every started server and daemon; kill what does not stop within 15 s."""
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()


def query(prom: str, expr: str) -> list[dict[str, object]]:
    data = get_json(f"{prom}/api/v1/query?query={urllib.parse.quote(expr)}")
    assert data["status"] == "success", data  # type: ignore[index]
    return data["data"]["result"]  # type: ignore[index,no-any-return]


def test_prometheus_scrapes_and_the_shipped_spin_rule_fires(stack: dict[str, object]) -> None:
    prom = str(stack["prom"])
    until(lambda: len(query(prom, 'up{job="stall-watchdog"} == 1')) == 2, 60, "both watchdogs scraped")

    def firing() -> list[dict[str, object]]:
        alerts = get_json(prom + "/api/v1/alerts")["data"]["alerts"]  # type: ignore[index]
        return [a for a in alerts if a["labels"]["alertname"] == "StallWatchdogBusySpin" and a["state"] == "firing"]

    (alert,) = until(firing, 120, "StallWatchdogBusySpin to fire")  # type: ignore[misc]
    assert alert["labels"] == {"alertname": "StallWatchdogBusySpin", "severity": "critical", "signature": "busy_spin",
                               "node": "node-a", "training_job": "unknown"}
    assert alert["annotations"]["runbook_url"].endswith("/docs/runbook.md#stallwatchdogbusyspin")


def test_the_daemon_and_the_rule_make_one_alert_and_one_page(stack: dict[str, object]) -> None:
    """Both report node A's spin to the same Alertmanager: it lists one alert, with the labels Prometheus's
    rule gave it, and pages once."""
    prom, am = str(stack["prom"]), str(stack["am"])
    sink = stack["sink"]
    assert isinstance(sink, Sink)

    def rule_alert() -> list[dict[str, object]]:
        alerts = get_json(prom + "/api/v1/alerts")["data"]["alerts"]  # type: ignore[index]
        return [a for a in alerts if a["labels"]["alertname"] == "StallWatchdogBusySpin" and a["state"] == "firing"]

    def sent(metrics_url: str, series: str) -> float:
        """A counter from a server's own /metrics (Prometheus does not scrape itself here)."""
        lines = urllib.request.urlopen(metrics_url, timeout=5).read().decode().splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(series))

    (fired,) = until(rule_alert, 120, "the rule's alert")  # type: ignore[misc]
    until(lambda: sent(prom + "/metrics", "prometheus_notifications_sent_total") > 0
          and sent(f"http://{stack['node_a']}/metrics", 'stall_watchdog_alerts_total{receiver="am",result="sent"}') > 0,
          60, "both to notify Alertmanager")

    def in_alertmanager() -> list[dict[str, object]]:
        alerts = get_json(am + "/api/v2/alerts")
        return [a for a in alerts if a["labels"].get("alertname") == "StallWatchdogBusySpin"]  # type: ignore[union-attr]

    (alert,) = until(in_alertmanager, 60, "the alert in Alertmanager")  # type: ignore[misc]
    assert alert["labels"] == fired["labels"]
    time.sleep(5)  # the daemon refreshes and Prometheus re-sends: still one
    (alert,) = in_alertmanager()
    assert alert["status"]["state"] == "active"

    def pages() -> list[dict[str, object]]:
        return [body for path, body in sink.received if path == "/page"
                and any(a["labels"]["alertname"] == "StallWatchdogBusySpin" for a in body["alerts"])]  # type: ignore[index,union-attr]

    (page,) = until(pages, 60, "the page")  # type: ignore[misc]
    assert [a["labels"]["node"] for a in page["alerts"]] == ["node-a"]  # type: ignore[index]


def test_the_daemons_alert_reaches_alertmanager(stack: dict[str, object]) -> None:
    am = str(stack["am"])

    def listed() -> list[dict[str, object]]:
        alerts = get_json(am + "/api/v2/alerts")
        return [a for a in alerts if a["labels"].get("alertname") == "StallWatchdogBusySpin"
                and a["annotations"].get("bundle")]  # type: ignore[union-attr]

    (alert,) = until(listed, 120, "the daemon's alert in Alertmanager")  # type: ignore[misc]
    labels, annotations = alert["labels"], alert["annotations"]
    assert labels["severity"] == "critical" and labels["node"] == "node-a" and "gpu" not in labels
    assert "HANG (critical): GPUs 0-7 spin at 100% util" in annotations["summary"]
    assert annotations["bundle"].startswith(str(stack["tmp"]))


def test_the_job_alerts_lead_to_the_slurm_job(stack: dict[str, object]) -> None:
    """Node B's ranks run in Slurm job 4242: the rules' job view, the culprit-node alert that real Prometheus
    fires and the daemon's own alert in Alertmanager all carry it."""
    prom, am = str(stack["prom"]), str(stack["am"])
    info = until(lambda: query(prom, 'stall_watchdog:job_nodes:count{slurm_job_id="4242"}'), 60, "the job view")
    assert [(s["metric"]["training_job"], s["value"][1]) for s in info] == [("run:llm-42", "1")]  # type: ignore[index]

    def culprit() -> list[dict[str, object]]:
        alerts = get_json(prom + "/api/v1/alerts")["data"]["alerts"]  # type: ignore[index]
        return [a for a in alerts if a["labels"]["alertname"] == "StallWatchdogJobCulpritNode"
                and a["state"] == "firing"]

    (fired,) = until(culprit, 180, "StallWatchdogJobCulpritNode to fire")  # type: ignore[misc]
    assert fired["labels"]["slurm_job_id"] == "4242" and "(Slurm job 4242)" in fired["annotations"]["summary"]

    def waiting() -> list[dict[str, object]]:
        alerts = get_json(am + "/api/v2/alerts")
        return [a for a in alerts if a["labels"].get("alertname") == "StallWatchdogWaiting"]  # type: ignore[union-attr]

    (alert,) = until(waiting, 120, "node B's waiting alert in Alertmanager")  # type: ignore[misc]
    assert alert["labels"]["slurm_job_id"] == "4242" and alert["labels"]["slurm_user"] == "alice"


def test_a_nodes_ledger_reaches_the_fleet(stack: dict[str, object]) -> None:
    """What node A's ledger holds is what another node learns through Prometheus about the same job (a job
    requeued there is not acted on as if it were new)."""
    config = FleetConfig(prometheus_url=str(stack["prom"]), timeout_seconds=5)

    def seen() -> list[float] | None:
        return fleet.actions_elsewhere(config, "slurm:4242")[0]

    assert until(seen, 60, "node A's ledger in Prometheus") == [LEDGER_AT]
    assert fleet.actions_elsewhere(config, "slurm:1") == ([], "")


def test_every_grafana_panel_query_returns_data(stack: dict[str, object]) -> None:
    prom = str(stack["prom"])
    until(lambda: query(prom, "stall_watchdog_episode_culprit == 1"), 120, "node B's culprit series")
    until(lambda: query(prom, "stall_watchdog_stack_captures_total"), 60, "node B's stack captures")
    until(lambda: query(prom, "stall_watchdog_job_wait_ratio"), 120, "node B's ranks' wait shares")
    until(lambda: query(prom, "stall_watchdog_job_nccl_ratio"), 120, "node B's ranks' NCCL Inspector shares")
    # increase() needs two scrapes of a counter: the episodes' is born when the first episode fires
    until(lambda: query(prom, "increase(stall_watchdog_episodes_total[1h])"), 60, "two scrapes of episodes_total")
    dashboard = json.loads((REPO / "deploy" / "grafana" / "stall-watchdog.json").read_text())
    empty = []
    # A panel that reads only sparse series (a GPU's faults) is empty while nothing is wrong: its query must run.
    sparse = {PREFIX + spec.name for spec in METRICS if spec.sparse}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$instance", ".*").replace("$gpu", ".*").replace("$__rate_interval", "5m")
            if not query(prom, expr) and not set(re.findall(r"stall_watchdog_[a-z_]+", expr)) <= sparse:
                empty.append(f"{panel['title']}: {expr}")
    assert not empty, "panels with no data:\n" + "\n".join(empty)
    panel = {p["title"].split(":")[0]: p["targets"][0]["expr"] for p in dashboard["panels"]}
    culprits = query(prom, panel["Culprits"].replace("$instance", ".*").replace("$gpu", ".*"))
    one_gpu = query(prom, panel["GPU utilization (NVML"].replace("$instance", ".*").replace("$gpu", "4"))
    assert one_gpu and {s["metric"]["gpu"] for s in one_gpu} == {"4"}  # type: ignore[index]
    assert [c["metric"]["rank"] for c in culprits] == ["4"]  # type: ignore[index]
    assert culprits[0]["metric"]["training_job"] == "run:llm-42"  # type: ignore[index]
    job_view = until(lambda: query(prom, 'stall_watchdog:job_culprit_nodes:count{training_job="run:llm-42"}'), 60,
                     "the job rules' evaluation after the culprit's first scrape")
    assert [s["value"][1] for s in job_view] == ["1"]  # type: ignore[index]
