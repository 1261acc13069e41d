"""The two shipped sharded setups (deploy/sharded/), run on loopback with the Debian packages: Prometheus 2.42
shards by hashmod writing to a global view that evaluates rules.yml, and vmagent in cluster mode writing to
VictoriaMetrics with vmalert evaluating the same rules.yml. Six simulated nodes (the real collector's
exposition) run one training job that spins on every node, so each node pages and the job-wide collective-hang
rule needs every node in one place. One shard (one vmagent) is killed mid-hang: every node's evidence keeps
arriving and no critical alert is lost. With replication 1 the same check sees the lost nodes (it can fail)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, need_tool, until
from tests.fakes.fleet import PORT, fleet_relabels, hashmod, node_body, serving_nodes
from tests.fakes.loopback import free_port, get_json

sys.path.insert(0, str(REPO / "deploy" / "sharded"))
import render  # noqa: E402  (deploy/sharded/render.py: the shipped files' one source)

RULES = REPO / "deploy" / "prometheus" / "rules.yml"
SHARDS = 3
JOB = "run:wide"
# A node whose newest alert sample in the store is this much older than the freshest node's has stopped arriving
# (against the other nodes, not the clock: a loaded machine delays every node's writes alike).
FRESH_SECONDS = 12.0


def _nodes() -> list[str]:
    """Six node names, two in each of the three hashmod buckets, so that every shard scrapes some."""
    picked: dict[int, list[str]] = {b: [] for b in range(SHARDS)}
    for n in range(100):
        name = f"gpu-node-{n:03d}"
        bucket = picked[hashmod(f"{name}:{PORT}", SHARDS)]
        if len(bucket) < 2:
            bucket.append(name)
    return [name for bucket in picked.values() for name in bucket]


def _query(base: str, promql: str) -> list[dict[str, Any]]:
    answer = get_json(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
    return list(answer["data"]["result"])


def _firing(am: str) -> set[tuple[str, str]]:
    """Alertmanager's active critical alerts as (alertname, node or training job)."""
    alerts = get_json(f"{am}/api/v2/alerts?active=true&silenced=false&inhibited=false")
    return {(a["labels"]["alertname"], a["labels"].get("node") or a["labels"].get("training_job", ""))
            for a in alerts if a["labels"].get("severity") == "critical" and a["status"]["state"] == "active"}


def _expected(nodes: list[str]) -> set[tuple[str, str]]:
    return {("StallWatchdogBusySpin", node) for node in nodes} | {("StallWatchdogJobCollectiveHang", JOB)}


def _stale(store: str, nodes: list[str]) -> set[str]:
    """The nodes whose newest alert sample in the store is FRESH_SECONDS older than the freshest node's (or
    absent)."""
    newest = {r["metric"].get("instance", ""): float(r["value"][1]) for r in _query(
        store, "max by (instance) (timestamp(stall_watchdog_episode_alert_info))")}
    freshest = max(newest.values(), default=0.0)
    return {node for node in nodes if freshest - newest.get(f"{node}:{PORT}", 0.0) > FRESH_SECONDS}


class Processes:
    def __init__(self, folder: Path):
        self.folder, self.running = folder, {}  # type: ignore[var-annotated]

    def start(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = (self.folder / f"{name}.log").open("wb")
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.folder)
        self.running[name] = process
        return process

    def kill(self, name: str) -> None:
        process = self.running.pop(name)
        process.send_signal(signal.SIGKILL)  # no clean stop: a shard lost, not retired
        process.wait()

    def stop(self) -> None:
        """Last started, first stopped: a scraper flushes its writes to a store that is still there (a shard
        whose global view has gone waits out its one-minute flush deadline)."""
        for process in reversed(list(self.running.values())):
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")[-3000:]


@contextmanager
def _stack(tmp: Path) -> Iterator[tuple[Processes, str, list[str], str]]:
    """Alertmanager, the fleet's server and its file_sd list; yields (processes, Alertmanager, nodes, file_sd)."""
    alertmanager = need_tool("prometheus-alertmanager")
    nodes = _nodes()
    bodies = {name: node_body(name, JOB, "7777", "1000", True, first_rank=8 * n) for n, name in enumerate(nodes)}
    processes = Processes(tmp)
    with ExitStack() as stack:
        stack.callback(processes.stop)
        server = stack.enter_context(serving_nodes(bodies))
        (tmp / "am.yml").write_text("route: {receiver: none, group_wait: 1s}\nreceivers: [{name: none}]\n")
        am_port = free_port()
        processes.start("alertmanager", [alertmanager, f"--config.file={tmp / 'am.yml'}",
                                         f"--storage.path={tmp / 'am-data'}", "--cluster.listen-address=",
                                         f"--web.listen-address=127.0.0.1:{am_port}"])
        am = f"http://127.0.0.1:{am_port}"
        until(lambda: _ready(am + "/-/ready"), 60, "Alertmanager to start")
        (tmp / "nodes.json").write_text(json.dumps([{"targets": [f"{name}:{PORT}" for name in nodes]}]))
        yield processes, am, nodes, server


def _ready(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=5).read()
        return True
    except OSError:
        return False


def _with_fleet(job: dict[str, Any], server: str) -> dict[str, Any]:
    job["relabel_configs"] = job.get("relabel_configs", []) + fleet_relabels(server)
    return job


def _ride_out_the_kill(processes: Processes, victim: str, am: str, store: str, nodes: list[str]) -> set[str]:
    """Kill one scraper once every critical is up; for the next 25 s, the nodes that stopped arriving in the
    store, and every critical still firing at Alertmanager."""
    until(lambda: _firing(am) >= _expected(nodes), 180, "every node's critical and the job's collective hang")
    assert not _stale(store, nodes)
    processes.kill(victim)
    lost: set[str] = set()
    end = time.monotonic() + 25
    while time.monotonic() < end:
        time.sleep(1)
        lost |= _stale(store, nodes)
    assert _firing(am) >= _expected(nodes), "a critical alert was lost"
    return lost


def test_the_shipped_files_are_rendered_and_the_rules_run_on_both_engines(tmp_path: Path) -> None:
    promtool, vmalert = need_tool("promtool"), need_tool("vmalert")
    assert subprocess.run([sys.executable, str(REPO / "deploy" / "sharded" / "render.py"), "--check"]).returncode == 0
    # The shards send on every series the rules read, no more.
    import re

    used = set(re.findall(r"\b(stall_watchdog_[a-z0-9_]+)", RULES.read_text())) | {"up"}
    assert {name for name in used if not re.fullmatch(render.RULE_INPUTS, name)} == set()
    for n in range(SHARDS):
        shard = render.HERE / "prometheus" / f"shard-{n}.yml"
        checked = subprocess.run([promtool, "check", "config", str(shard)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    config = render.global_config(rules=str(RULES))
    (tmp_path / "global.yml").write_text(yaml.safe_dump(config))
    checked = subprocess.run([promtool, "check", "config", str(tmp_path / "global.yml")], capture_output=True,
                             text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    dry = subprocess.run([vmalert, "-dryRun", f"-rule={RULES}"], capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr[-2000:]
    # rendered for other hosts: the options reach the files
    done = subprocess.run([sys.executable, str(REPO / "deploy" / "sharded" / "render.py"),
                           "--out", str(tmp_path / "own"), "--shards", "4",
                           "--global", "http://g1:9090/api/v1/write", "--alertmanager", "am1:9093"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    own = yaml.safe_load((tmp_path / "own" / "prometheus" / "shard-3.yml").read_text())
    assert [w["url"] for w in own["remote_write"]] == ["http://g1:9090/api/v1/write"]
    assert own["scrape_configs"][0]["relabel_configs"][1]["regex"] == "0|3"
    assert "am1:9093" in (tmp_path / "own" / "prometheus" / "global.yml").read_text()
    # each hashmod bucket is kept by exactly `replication` shards
    for shards, replication in ((3, 2), (5, 2), (4, 3), (3, 1)):
        kept = [b for n in range(shards) for b in render.buckets(n, shards, replication)]
        assert sorted(kept) == sorted(list(range(shards)) * replication)


@pytest.mark.parametrize("replication", [2, 1])
def test_prometheus_shards_lose_no_critical_when_one_is_killed(tmp_path: Path, replication: int) -> None:
    prometheus = need_tool("prometheus")
    with _stack(tmp_path) as (processes, am, nodes, server):
        global_port = free_port()
        store = f"http://127.0.0.1:{global_port}"
        config = render.global_config((f"127.0.0.1:{am.rsplit(':', 1)[1]}",), str(RULES), interval="1s")
        (tmp_path / "global.yml").write_text(yaml.safe_dump(config))
        processes.start("global", [prometheus, f"--config.file={tmp_path / 'global.yml'}",
                                   f"--storage.tsdb.path={tmp_path / 'global-data'}",
                                   "--web.enable-remote-write-receiver",
                                   f"--web.listen-address=127.0.0.1:{global_port}"])
        until(lambda: _ready(store + "/-/ready"), 60, "the global Prometheus to start")
        shard_urls = []
        for n in range(SHARDS):
            config = render.shard_config(n, SHARDS, replication, (f"{store}/api/v1/write",),
                                         str(tmp_path / "nodes.json"), interval="1s")
            _with_fleet(config["scrape_configs"][0], server)
            (tmp_path / f"shard-{n}.yml").write_text(yaml.safe_dump(config))
            port = free_port()
            shard_urls.append(f"http://127.0.0.1:{port}")
            processes.start(f"shard-{n}", [prometheus, f"--config.file={tmp_path / f'shard-{n}.yml'}",
                                           f"--storage.tsdb.path={tmp_path / f'shard-{n}-data'}",
                                           f"--web.listen-address=127.0.0.1:{port}"])
        for url in shard_urls:
            until(lambda url=url: _ready(url + "/-/ready"), 60, "a shard to start")
        # the shards split the nodes: each scrapes the nodes of its buckets, every node `replication` times
        def targets() -> list[set[str]]:
            return [{t["labels"]["instance"] for t in get_json(url + "/api/v1/targets")["data"]["activeTargets"]}
                    for url in shard_urls]

        until(lambda: all(targets()), 60, "the shards to read the node list")
        scraped = targets()
        assert sorted(len(s) for s in scraped) == [2 * replication] * SHARDS, scraped
        lost = _ride_out_the_kill(processes, "shard-0", am, store, nodes)
        only_there = {node for node in nodes if [f"{node}:{PORT}" in s for s in scraped] == [True, False, False]}
        if replication == 2:
            assert lost == set(), processes.log("global")
        else:
            assert only_there and lost == only_there  # the check sees the nodes a lone shard took with it


def test_vmagent_cluster_loses_no_critical_when_one_is_killed(tmp_path: Path) -> None:
    vmagent, victoria, vmalert = need_tool("vmagent"), need_tool("victoria-metrics"), need_tool("vmalert")
    with _stack(tmp_path) as (processes, am, nodes, server):
        vm_port = free_port()
        store = f"http://127.0.0.1:{vm_port}"
        # dedup: the replicas' samples of a series are one; latencyOffset: the newest second is queryable
        processes.start("victoria-metrics", [victoria, f"-storageDataPath={tmp_path / 'vm-data'}",
                                             f"-httpListenAddr=127.0.0.1:{vm_port}", "-dedup.minScrapeInterval=1s",
                                             "-search.latencyOffset=1s"])
        until(lambda: _ready(store + "/health"), 60, "VictoriaMetrics to start")
        config = render.vmagent_config(str(tmp_path / "nodes.json"), interval="1s")
        _with_fleet(config["scrape_configs"][0], server)
        (tmp_path / "scrape.yml").write_text(yaml.safe_dump(config))
        for n in range(SHARDS):
            processes.start(f"vmagent-{n}", [
                vmagent, f"-promscrape.config={tmp_path / 'scrape.yml'}", f"-remoteWrite.url={store}/api/v1/write",
                f"-remoteWrite.tmpDataPath={tmp_path / f'vmagent-{n}'}", f"-httpListenAddr=127.0.0.1:{free_port()}",
                f"-promscrape.cluster.membersCount={SHARDS}", f"-promscrape.cluster.memberNum={n}",
                "-promscrape.cluster.replicationFactor=2", "-remoteWrite.flushInterval=1s"])
        processes.start("vmalert", [
            vmalert, f"-rule={RULES}", f"-datasource.url={store}", f"-remoteWrite.url={store}",
            f"-remoteRead.url={store}", f"-notifier.url={am}", "-evaluationInterval=1s",
            "-remoteWrite.flushInterval=1s", f"-httpListenAddr=127.0.0.1:{free_port()}"])
        lost = _ride_out_the_kill(processes, "vmagent-0", am, store, nodes)
        assert lost == set(), processes.log("vmalert")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
