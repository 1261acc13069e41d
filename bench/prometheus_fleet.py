"""The shipped rules at fleet scale: the real Prometheus (on loopback, a temporary TSDB) scraping 1,000
simulated nodes of 8 GPUs each, with deploy/prometheus/rules.yml loaded. Goal: every rule group evaluates
in under 1 s at 1,000 nodes. Prints the targets up, the series per node, each rule group's evaluation time
(prometheus_rule_group_last_duration_seconds of each evaluation once every target is up: the most and the
median; wall time, so a busy machine shows in it, and the load average is printed), the slowest rules,
Prometheus's memory (RSS and process_resident_memory_bytes), and a linear estimate for 10,000 nodes.
`--rules` loads other rule files instead, for a candidate measured beside the shipped one.

Each node's /metrics is what the real daemon exports: a daemon built over the simulator (healthy, a
busy-spin hang, an odd rank the others wait on), with 8 real processes as its ranks, renders the bodies;
each node then gets its own name, GPU UUIDs, pids, ranks, training job and Slurm job. Training jobs span
1 to 64 nodes; one 16-node job hangs in a collective, one 32-node job waits on one node's odd rank, one
single-node job spins, so the job rules and the alerts have work. One loopback server answers every
target (`/metrics?node=...`: Prometheus relabels each target's address to it, keeping the node's name as
`instance`). Needs `prometheus` on the PATH (Debian: apt-get install prometheus).

    python bench/prometheus_fleet.py [--nodes 1000] [--interval-seconds 10] [--cycles 6]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fakes.fleet import fleet_relabels, serving_nodes  # noqa: E402
from tests.fakes.loopback import free_port  # noqa: E402
from watchdog.config import parse_config  # noqa: E402
from watchdog.daemon import Daemon  # noqa: E402
from watchdog.plumbing import logfmt  # noqa: E402
from watchdog.sample import sim  # noqa: E402
from watchdog.service import build  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "deploy" / "prometheus" / "rules.yml"
GOAL_SECONDS = 1.0
GPUS = 8
# Stand-ins the template bodies carry, replaced per node (unlike any value the daemon writes).
NODE, JOB, SLURM_JOB, USER = "bench-node-x", "bench-job-x", "987654321", "bench-user-x"
# The node states: the simulator's scenario, where to start in it, and the ticks that bring its episode to
# an alert (a critical busy_spin; a critical wait on GPU 4's rank).
STATES = {"healthy": ("healthy", 100, 30), "spin": ("spin_hang", 285, 70), "odd": ("odd_rank", 295, 50)}
BODIES_PER_STATE = 6  # successive ticks, served in turn so the readings move between scrapes
USERS = ("alice", "bob", "carol", "dave")


@dataclass(frozen=True)
class Node:
    name: str
    state: str
    fields: dict[str, str]  # what fills the state's template, the time of the last sample aside


def _stepping(start: float) -> Iterator[float]:
    while True:
        yield start
        start += 1.0


def _wait_for_looks(daemon: Daemon) -> None:
    """The stacks the incidents started looking at (off the loop) were looked at: the alert names the job."""
    deadline = time.monotonic() + 30
    opened = daemon.incidents.open.values()
    while any(s.look is None or not s.look.done() for s in opened) and time.monotonic() < deadline:
        time.sleep(0.05)


def render_bodies(state: str, folder: Path) -> tuple[list[str], dict[int, int]]:
    """BODIES_PER_STATE successive /metrics bodies of a real daemon over the simulator, and its ranks' pids
    by GPU. The ranks are real processes with a launcher's environment, so rank_info and the alert carry a
    training job and a Slurm job as on a real node (their stacks are not Python: captures say so)."""
    scenario, offset, ticks = STATES[state]
    launcher = {"TORCHELASTIC_RUN_ID": JOB, "WORLD_SIZE": "512", "SLURM_JOB_ID": SLURM_JOB, "SLURM_STEP_ID": "0",
                "SLURM_JOB_USER": USER}
    ranks = [subprocess.Popen(["sleep", "3600"], env={**os.environ, **launcher, "RANK": str(g), "LOCAL_RANK": str(g)})
             for g in range(GPUS)]
    try:
        pids = {g: rank.pid for g, rank in enumerate(ranks)}
        config = parse_config({"alerts": {"node": NODE}, "bundles": {"directory": str(folder / state)}})
        wall = _stepping(time.time() - ticks - 5 * BODIES_PER_STATE)
        steps = iter(n * 0.001 for n in range(10**9))
        service = build(config, sim.SimSource(sim.SCENARIOS[scenario], 1.0, offset, {g: [p] for g, p in pids.items()},
                                             clock=lambda: next(wall)), monotonic=lambda: next(steps))
        daemon = service.daemon
        for _ in range(ticks):
            daemon.tick()
            _wait_for_looks(daemon)
        bodies = []
        for _ in range(BODIES_PER_STATE):
            for _ in range(5):
                daemon.tick()
            bodies.append(service.exposition().decode())
        service.close(timeout=10)
        return bodies, pids
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()


def template(body: str, pids: dict[int, int]) -> str:
    """A body as a str.format template: the node's name, training job, Slurm job, user, GPU UUIDs, pids
    and ranks, and the time of the last sample (the time of each scrape, so no node looks stale)."""
    gpu_of = {str(pid): gpu for gpu, pid in pids.items()}
    text = body.replace("{", "{{").replace("}", "}}")
    text = text.replace(NODE, "{node}").replace(f"run:{JOB}", "{job}").replace(SLURM_JOB, "{slurm_job}")
    text = text.replace(USER, "{user}").replace('-000000000000"', '-{uuid}"')
    text = re.sub(r'pid="(\d+)"', lambda m: f'pid="{{pid{gpu_of[m[1]]}}}"', text)
    text = re.sub(r"pid (\d+)\)", lambda m: f"pid {{pid{gpu_of[m[1]]}}})", text)
    text = re.sub(r'rank="(\d+)"', lambda m: f'rank="{{rank{m[1]}}}"', text)
    text = re.sub(r"\(rank (\d+),", lambda m: f"(rank {{rank{m[1]}}},", text)
    text = re.sub(r"^(stall_watchdog_last_sample_timestamp_seconds) .*$", r"\1 {now}", text, flags=re.M)
    missing = [stand_in for stand_in in (NODE, JOB, SLURM_JOB, USER) if stand_in in text]
    assert not missing, f"left in the template: {missing}"
    return text


def fleet(nodes: int) -> tuple[list[Node], int]:
    """Training jobs of 1, 2, 4 ... 64 nodes in turn; the first 16-node job hangs in a collective, the first
    32-node job waits on its first node's odd rank, the first single-node job spins."""
    out: list[Node] = []
    sizes = (1, 2, 4, 8, 16, 32, 64)
    job = 0
    while len(out) < nodes:
        size = min(sizes[job % len(sizes)], nodes - len(out))
        first = job < len(sizes)
        for position in range(size):
            n = len(out)
            state = "healthy"
            if first and size in (1, 16, 32):
                state = "odd" if size == 32 and position == 0 else "spin"
            fields = {"node": f"gpu-node-{n:04d}", "job": f"run:llm-{job:03d}", "slurm_job": str(41000 + job),
                      "user": USERS[job % len(USERS)], "uuid": f"{n:012x}"}
            for g in range(GPUS):
                fields[f"pid{g}"] = str(200_000 + 16 * (n % 4096) + g)
                fields[f"rank{g}"] = str(position * GPUS + g)
            out.append(Node(fields["node"], state, fields))
        job += 1
    return out, job


def node_bodies(nodes: list[Node], templates: dict[str, list[str]]) -> dict[str, Callable[[], bytes]]:
    """Each node's next body at each scrape: its state's bodies in turn, filled with its fields and now."""

    def of(node: Node) -> Callable[[], bytes]:
        turn = itertools.cycle(templates[node.state])
        return lambda: next(turn).format(now=floatToGoString(time.time()), **node.fields).encode()

    return {node.name: of(node) for node in nodes}


@contextmanager
def prometheus(binary: str, folder: Path, nodes: list[Node], server: str, interval: int,
               rules: list[Path]) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """The real Prometheus with the rules, scraping every node under job="stall-watchdog"."""
    config = {
        "global": {"scrape_interval": f"{interval}s", "scrape_timeout": f"{max(1, interval // 2)}s",
                   "evaluation_interval": f"{interval}s"},
        "rule_files": [str(path.resolve()) for path in rules],
        "scrape_configs": [{
            "job_name": "stall-watchdog",
            "static_configs": [{"targets": [f"{node.name}:9944" for node in nodes]}],
            "relabel_configs": fleet_relabels(server),
        }],
    }
    (folder / "prometheus.yml").write_text(json.dumps(config))
    port = free_port()
    log = (folder / "prometheus.log").open("wb")
    process = subprocess.Popen([binary, f"--config.file={folder / 'prometheus.yml'}",
                                f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                                "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/-/ready", timeout=2).read()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"Prometheus did not start: see {folder / 'prometheus.log'}") from None
                time.sleep(0.5)
        yield process, url
    finally:
        process.terminate()  # SIGTERM: Prometheus stops cleanly
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def query(url: str, promql: str) -> list[dict[str, object]]:
    with urllib.request.urlopen(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": promql}), timeout=30) as r:
        answer = json.load(r)
    assert answer["status"] == "success", answer
    return list(answer["data"]["result"])


def scalar(url: str, promql: str) -> float:
    result = query(url, promql)
    return float(result[0]["value"][1]) if result else 0.0  # type: ignore[index]


def rule_groups(url: str) -> list[dict[str, Any]]:
    """The rules API: each group's last evaluation (time, duration) and each rule's."""
    with urllib.request.urlopen(f"{url}/api/v1/rules", timeout=30) as r:
        return list(json.load(r)["data"]["groups"])


def own_metrics(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Prometheus's own /metrics: name -> labels -> value."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def groups(metrics: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str) -> dict[str, float]:
    """A per-rule-group metric by group name (the label is 'file;name')."""
    return {dict(labels)["rule_group"].split(";", 1)[1]: value for labels, value in metrics.get(name, {}).items()}


def measure(args: argparse.Namespace, binary: str) -> None:
    nodes, jobs = fleet(args.nodes)
    hung = sum(node.state != "healthy" for node in nodes)
    logfmt.setup(logfmt.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        templates: dict[str, list[str]] = {}
        for state in STATES:
            bodies, pids = render_bodies(state, folder)
            templates[state] = [template(body, pids) for body in bodies]
        version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.split()[2]
        print(f"fleet: {len(nodes):,} nodes x {GPUS} GPUs, {jobs} training jobs of 1-64 nodes, {hung} nodes hung; "
              f"Prometheus {version}, scrape and rule evaluation every {args.interval_seconds} s (rules.yml sets no "
              f"group interval); {os.cpu_count()} cores, {platform.machine()}")
        with serving_nodes(node_bodies(nodes, templates)) as server, \
                prometheus(binary, folder, nodes, server, args.interval_seconds, args.rules) as (process, url):
            run(args, url, psutil.Process(process.pid), nodes)


def run(args: argparse.Namespace, url: str, process: psutil.Process, nodes: list[Node]) -> None:
    started = time.monotonic()
    deadline = started + 6 * args.interval_seconds + 120
    up = 0.0
    while up < len(nodes) and time.monotonic() < deadline:
        time.sleep(2)
        up = scalar(url, 'count(up{job="stall-watchdog"} == 1)')
    print(f"targets up: {up:.0f} / {len(nodes)} ({time.monotonic() - started:.0f} s after start)")
    if up < len(nodes):
        raise SystemExit("not every target came up: nothing measured")

    # Each group's next `cycles` evaluations: their durations as prometheus_rule_group_last_duration_seconds
    # gives them (read each second, kept when the group's last evaluation time moves on), each rule's from the
    # rules API, and Prometheus's memory and CPU meanwhile. The first evaluation with every node up also
    # creates the recording rules' series.
    stamp = "prometheus_rule_group_last_evaluation_timestamp_seconds"
    duration = "prometheus_rule_group_last_duration_seconds"
    seen = groups(own_metrics(url), stamp)
    seen_rules = {g["name"]: g["lastEvaluation"] for g in rule_groups(url)}
    history: dict[str, list[float]] = {group: [] for group in seen}
    slowest: dict[tuple[str, str], float] = {}  # (group, rule) -> the most one evaluation of it took
    rss = 0
    cpu0, t0 = process.cpu_times(), time.monotonic()
    while min(len(times) for times in history.values()) < args.cycles:
        time.sleep(1)
        metrics = own_metrics(url)
        rss = max(rss, process.memory_info().rss)
        durations = groups(metrics, duration)
        for group, at in groups(metrics, stamp).items():
            if at != seen.get(group):
                seen[group] = at
                history.setdefault(group, []).append(durations[group])
        for g in rule_groups(url):
            if seen_rules.get(g["name"]) != g["lastEvaluation"]:
                seen_rules[g["name"]] = g["lastEvaluation"]
                for rule in g["rules"]:
                    key = (g["name"], rule["name"])
                    slowest[key] = max(slowest.get(key, 0.0), rule["evaluationTime"])
    cpu1, elapsed = process.cpu_times(), time.monotonic() - t0
    missed = sum(groups(metrics, "prometheus_rule_group_iterations_missed_total").values())
    failed = sum(metrics.get("prometheus_rule_evaluation_failures_total", {}).values())

    n = len(nodes)
    head = metrics["prometheus_tsdb_head_series"][()]
    ours = sorted(float(r["value"][1]) for r in query(  # type: ignore[index]
        url, 'count by (instance) ({__name__=~"stall_watchdog_.+", job="stall-watchdog"})'))
    scrape_meta = scalar(url, 'count({job="stall-watchdog", __name__=~"up|scrape_.+"})')
    derived = scalar(url, 'count({__name__=~"stall_watchdog:.+|ALERTS|ALERTS_FOR_STATE"})')
    p50 = scalar(url, 'quantile(0.5, scrape_duration_seconds{job="stall-watchdog"})')
    top = scalar(url, 'max(scrape_duration_seconds{job="stall-watchdog"})')
    print(f"scrapes: {p50 * 1000:.0f} ms median, {top * 1000:.0f} ms max (the simulator's loopback server included)")
    print(f"series per node: {head / n:.0f} in the head ({head:,.0f} / {n:,}): stall-watchdog's own "
          f"{sum(ours) / n:.0f} (healthy {ours[0]:.0f}, hung up to {ours[-1]:.0f}), {scrape_meta / n:.0f} of the "
          f"scrape (up, scrape_*), {derived / n:.1f} from the rules (recording rules, ALERTS)")
    for group, times in sorted(history.items(), key=lambda item: -max(item[1])):
        verdict = "ok" if max(times) < GOAL_SECONDS else "OVER"
        print(f"rule group {group}: {max(times) * 1000:.0f} ms max, {sorted(times)[len(times) // 2] * 1000:.0f} ms "
              f"median over {len(times)} evaluations (goal < {GOAL_SECONDS:.0f} s: {verdict}): "
              + " ".join(f"{t * 1000:.0f}" for t in times))
    print("slowest rules: " + "; ".join(f"{rule} {seconds * 1000:.0f} ms" for (_, rule), seconds in
                                        sorted(slowest.items(), key=lambda item: -item[1])[:3]))
    print(f"rule evaluations: {missed:.0f} iterations missed, {failed:.0f} failures")
    firing = query(url, 'count by (alertname) (ALERTS{alertstate="firing"})')
    print("alerts firing: " + (", ".join(f"{r['metric']['alertname']} {r['value'][1]}"  # type: ignore[index]
                                         for r in firing) or "none"))
    resident = metrics["process_resident_memory_bytes"][()]
    cores = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / elapsed
    minutes = (time.time() - process.create_time()) / 60
    print(f"Prometheus memory: RSS {rss / 2**20:,.0f} MiB (max over the window), process_resident_memory_bytes "
          f"{resident / 2**20:,.0f} MiB ({resident / head / 1024:.1f} KiB per head series) after {minutes:.1f} min; "
          f"the head's chunks grow until its first block is cut at 2 h. CPU {cores:.2f} cores over the window")
    print(f"load average {' / '.join(f'{x:.1f}' for x in os.getloadavg())} (1/5/15 min; the machine is shared)")
    scale = 10_000 / n
    slowest_group = max(max(times) for times in history.values())
    print(f"10,000 nodes, an estimate taking series, memory and rule time to scale linearly with nodes: "
          f"{head * scale / 1e6:.2f} M head series, ~{resident * scale / 2**30:.0f} GiB resident, the slowest rule "
          f"group ~{slowest_group * scale:.1f} s (docs/measured.md, Fleet scale, says how to split it)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--interval-seconds", type=int, default=10, help="scrape and rule evaluation interval")
    parser.add_argument("--cycles", type=int, default=6, help="rule evaluations measured per group")
    parser.add_argument("--rules", type=Path, nargs="+", default=[RULES],
                        help="rule files to load (a candidate beside the shipped one: give its groups other names)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop Prometheus on the way out
    binary = shutil.which("prometheus")
    if binary is None:
        print("prometheus is not on the PATH (Debian: apt-get install prometheus): nothing measured")
        return
    measure(args, binary)


if __name__ == "__main__":
    main()
