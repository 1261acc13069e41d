"""Across nodes, for real: one torch.distributed gloo job whose four ranks are split over two
`stall-watchdog run` daemons playing two nodes, real Prometheus with the shipped rules, real Alertmanager
with the shipped routing, and `stall-watchdog coordinate`. Rank 2 (on node-b) hangs in its data loader.

The job alert fires in Prometheus, Alertmanager posts it to the coordinator grouped by training_job, the
coordinator asks Prometheus where the job runs, fans POST /v1/dump out to both daemons and names rank 2
on node-b, with its pid, GPU and activity, the Flight Recorder's and NCCL RAS's agreement, and a bundle.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.conftest import REPO, gloo_job, need_tool
from tests.fakes.nccl_ras import FakeRank, json_report
from tests.integration.test_prometheus import free_port, get_json, stop_all, until
from watchdog.coordinate.job_bundle import node_file_name
from watchdog.sample.ranks import RankDiscovery


def test_the_coordinator_names_the_odd_rank_and_its_node(tmp_path: Path) -> None:
    prometheus, alertmanager = need_tool("prometheus"), need_tool("prometheus-alertmanager")
    ports = {name: free_port() for name in ("prom", "am", "a", "b", "coord")}
    processes: list[subprocess.Popen[bytes]] = []

    def start(args: list[str], log: str) -> None:
        processes.append(subprocess.Popen(args, cwd=REPO, stdout=(tmp_path / (log + ".out")).open("wb"),
                                          stderr=(tmp_path / log).open("wb")))

    # Each node's NCCL RAS service: its first rank stands in for it (rank 0 on node-a, rank 2 on node-b),
    # answering with this report of the whole job.
    report = tmp_path / "ras-report.json"
    ras_ports = {"node-a": free_port(), "node-b": free_port()}
    nodes = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
    with gloo_job("dataloader", tmp_path, odd_rank=2, flight_recorder=True,
                  env={"RAS_STAND_IN_REPORT": str(report)},
                  rank_env={r: {"NCCL_RAS_ADDR": f"127.0.0.1:{ras_ports[nodes[r]]}",
                                **({"RAS_STAND_IN_LISTEN": "1"} if r in (0, 2) else {})} for r in nodes}) as ranks:
        report.write_text(json_report([FakeRank(r, nodes[r], p.pid, r % 2, {"AllReduce": 3 if r == 2 else 4})
                                       for r, p in enumerate(ranks)]))
        job = RankDiscovery().describe(ranks[0].pid).job_key  # type: ignore[union-attr]
        try:
            # node-a: GPUs 0-7 spin; its ranks 0 and 1 sit on GPUs 0 and 1. node-b: one odd GPU (4), where
            # rank 2 sits; rank 3 on GPU 0.
            layout = {"a": ("spin_hang", {0: [ranks[0].pid], 1: [ranks[1].pid]}),
                      "b": ("odd_rank", {4: [ranks[2].pid], 0: [ranks[3].pid]})}
            token = tmp_path / "dump-token"
            token.write_text("node-token-for-the-test\n")
            for node, (scenario, pids) in layout.items():
                (tmp_path / f"{node}.yaml").write_text(
                    f"source:\n  kind: sim\n  scenario: {scenario}\n  start_offset_seconds: 292\n"
                    f"  pids: {json.dumps(pids)}\n"
                    f"export: {{listen_address: '127.0.0.1:{ports[node]}'}}\n"
                    f"bundles: {{directory: '{tmp_path / ('incidents-' + node)}'}}\n"
                    "stacks: {observe_seconds: 0.2, nccl_ras_gap_seconds: 1, flight_recorder_wait_seconds: 30}\n"
                    f"alerts: {{node: node-{node}}}\n"
                    f"dump: {{token_file: '{token}'}}\n")
                start([sys.executable, "-m", "watchdog", "run", "--config", str(tmp_path / f"{node}.yaml")], node)
            callers = tmp_path / "coordinator-token"  # holding the node token, it wants its callers' own
            callers.write_text("alertmanagers-token-for-the-test\n")
            start([sys.executable, "-m", "watchdog", "coordinate", "--prometheus", f"http://127.0.0.1:{ports['prom']}",
                   "--listen", f"127.0.0.1:{ports['coord']}", "--out", str(tmp_path / "jobs"),
                   "--node-token-file", str(token), "--token-file", str(callers)], "coord")

            shipped = (REPO / "deploy" / "alertmanager" / "alertmanager.yml").read_text()
            (tmp_path / "am.yml").write_text(shipped.replace("127.0.0.1:9945", f"127.0.0.1:{ports['coord']}")
                                             .replace("/etc/alertmanager/coordinator-token", str(callers)))
            start([alertmanager, f"--config.file={tmp_path / 'am.yml'}", f"--storage.path={tmp_path / 'am-data'}",
                   f"--web.listen-address=127.0.0.1:{ports['am']}", "--cluster.listen-address="], "am")
            (tmp_path / "prometheus.yml").write_text(
                "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                f"rule_files: ['{REPO / 'deploy' / 'prometheus' / 'rules.yml'}']\n"
                f"alerting: {{alertmanagers: [{{static_configs: [{{targets: ['127.0.0.1:{ports['am']}']}}]}}]}}\n"
                "scrape_configs:\n  - job_name: stall-watchdog\n    static_configs:\n"
                f"      - targets: ['127.0.0.1:{ports['a']}', '127.0.0.1:{ports['b']}']\n")
            start([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                   f"--storage.tsdb.path={tmp_path / 'prom-data'}", f"--web.listen-address=127.0.0.1:{ports['prom']}"],
                  "prom")
            prom, coord = f"http://127.0.0.1:{ports['prom']}", f"http://127.0.0.1:{ports['coord']}"

            def job_alert() -> dict[str, Any] | None:
                alerts = get_json(prom + "/api/v1/alerts")["data"]["alerts"]  # type: ignore[index]
                return next((a for a in alerts if a["labels"]["alertname"] == "StallWatchdogJobCulpritNode"
                             and a["state"] == "firing"), None)

            alert = until(job_alert, 180, "StallWatchdogJobCulpritNode to fire in Prometheus")
            fired_at = time.time()
            assert alert["labels"]["training_job"] == job  # type: ignore[index]
            assert alert["labels"]["instance"] == f"127.0.0.1:{ports['b']}"  # type: ignore[index]
            def job_verdict() -> object:
                asked = urllib.request.Request(coord + "/v1/jobs", headers={
                    "Authorization": "Bearer alertmanagers-token-for-the-test"})
                with urllib.request.urlopen(asked, timeout=5) as response:
                    return json.loads(response.read()).get(job)

            verdicts = until(job_verdict, 120, "the coordinator's job verdict")
            verdict_after = time.time() - fired_at
        finally:
            stop_all(processes)

    result: dict[str, Any] = verdicts  # type: ignore[assignment]
    (odd,) = result["odd_ranks"]
    assert (odd["member"], odd["node"], odd["pid"], odd["gpus"]) == ("rank 2", "node-b", ranks[2].pid, [4])
    assert odd["activity"] == "data_loading" and "FakeLoader.__next__" in odd["where"]
    assert odd["instance"] == f"127.0.0.1:{ports['b']}"
    assert result["nodes_answered"] == 2 and result["nodes_silent"] == []
    assert result["outliers"] == ["rank 2"]
    assert result["verdict"]["kind"] == "hang" and result["verdict"]["severity"] == "critical"
    assert "rank 2 (pid" in result["verdict"]["headline"] and "on node-b" in result["verdict"]["headline"]
    assert result["flight_recorder"]["culprits"] == [2]
    assert result["nccl_ras"]["culprits"] == [2] and result["nccl_ras"]["stuck"]
    bundle = Path(result["bundle"])
    assert (bundle / "report.html").is_file() and sorted(p.name for p in (bundle / "nodes").iterdir()) == sorted([
        node_file_name(f"127.0.0.1:{ports['a']}"), node_file_name(f"127.0.0.1:{ports['b']}")])
    page = (bundle / "report.html").read_text()
    assert "rank 2" in page and "node-b" in page and "2 of 2 answered" in page
    # The bundle is evidence `analyze` reads back to the same verdict.
    again = subprocess.run([sys.executable, "-m", "watchdog", "analyze", str(bundle), "--json"], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.splitlines()[0])["outliers"] == ["rank 2"]
    coordinator_log = (tmp_path / "coord").read_text()
    assert "job_verdict" in coordinator_log and "rank 2" in coordinator_log and "node-b" in coordinator_log
    print(f"\njob alert firing -> job verdict: {verdict_after:.1f} s (coordinator's own work "
          f"{result['seconds']:.1f} s)\n{result['verdict']['headline']}\n{result['verdict']['sentence']}")
