"""The shipped rules at fleet scale: a real store and rule engine on loopback scraping simulated nodes of 8
GPUs each, with deploy/prometheus/rules.yml loaded: `--engine prometheus` (Prometheus scrapes and evaluates)
or `--engine vmalert` (VictoriaMetrics scrapes, vmalert evaluates against it and writes back). Goal (issue
57): at 12,500 nodes every rule group evaluates in under 1 s a cycle, no iteration missed in 30 minutes, the
store within 4 GiB. Prints the targets up, the series per node, each rule group's evaluation times (max,
median, p95; wall time, so a busy machine shows in it, and the load average is printed), the slowest rules,
the iterations missed and failed, the alerts firing, and the engine's memory (RSS, store and rule engine
together) and CPU. `--rules` loads other rule files instead, for a candidate measured beside the shipped one.

Each node's /metrics is what the real daemon exports: a daemon built over the simulator (healthy, a
busy-spin hang, an odd rank the others wait on), with 8 real processes as its ranks, renders the bodies;
each node then gets its own name, GPU UUIDs, pids, ranks, training job and Slurm job. Training jobs span
1 to 64 nodes; one 16-node job hangs in a collective, one 32-node job waits on one node's odd rank, one
single-node job spins, so the job rules and the alerts have work. One loopback server answers every
target (`/metrics?node=...`: Prometheus relabels each target's address to it, keeping the node's name as
`instance`). Needs `prometheus` on the PATH (Debian: apt-get install prometheus).

    python bench/prometheus_fleet.py [--nodes 1000] [--interval-seconds 10] [--cycles 6 | --minutes 30]
        [--engine prometheus|vmalert]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fakes.fleet import fleet_relabels, serving_nodes  # noqa: E402
from tests.fakes.loopback import Quiet, free_port, serving, started  # noqa: E402
from watchdog.config import parse_config  # noqa: E402
from watchdog.daemon import Daemon  # noqa: E402
from watchdog.export.metrics import go_float  # noqa: E402
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
    # The ranks are not Python (no stack samples): each node's job counts them as 8 ranks sampled 8 times a
    # second for 5 minutes, about 30% of them waiting (a little noise each scrape), 30% in their first look, so
    # that the straggler rules have their inputs.
    job = re.search(r"^stall_watchdog_job_state(\{\{.*\}\}) ", text, flags=re.M)  # its braces doubled: a template
    assert job, "the body has no job_state: its ranks are not proven"
    labels = re.sub(r'pod="[^"]*",', "", job[1])  # the job's wait series have no pod
    for name, value in (("job_wait_ratio", "{share}"), ("job_wait_samples", "19200"), ("job_first_wait_ratio", "0.3")):
        text = text.replace(f"# TYPE stall_watchdog_{name} gauge\n",
                            f"# TYPE stall_watchdog_{name} gauge\nstall_watchdog_{name}{labels} {value}\n")
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
        def body() -> bytes:
            now = time.time()
            share = 0.3 + random.uniform(-0.01, 0.01)
            return next(turn).format(now=go_float(now), share=f"{share:.4f}", **node.fields).encode()

        return body

    return {node.name: of(node) for node in nodes}


def scrape_config(nodes: list[Node], server: str, interval: int) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": f"{interval}s", "scrape_timeout": f"{max(1, interval // 2)}s"},
        "scrape_configs": [{
            "job_name": "stall-watchdog",
            "static_configs": [{"targets": [f"{node.name}:9944" for node in nodes]}],
            "relabel_configs": fleet_relabels(server),
        }],
    }


@contextmanager
def prometheus(folder: Path, nodes: list[Node], server: str, interval: int, rules: list[Path]) -> Iterator[Engine]:
    """The real Prometheus with the rules, scraping every node under job="stall-watchdog"."""
    config = scrape_config(nodes, server, interval)
    config["global"]["evaluation_interval"] = f"{interval}s"
    config["rule_files"] = [str(path.resolve()) for path in rules]
    (folder / "prometheus.yml").write_text(json.dumps(config))
    url = f"http://127.0.0.1:{free_port()}"
    with started("prometheus", ["prometheus", f"--config.file={folder / 'prometheus.yml'}",
                                f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address={url[7:]}",
                                "--log.level=warn"], folder, f"{url}/-/ready") as process:
        yield Engine(url, url, (psutil.Process(process.pid),), "prometheus_rule_group_iterations_missed_total",
                     ("prometheus_rule_evaluation_failures_total",))


@contextmanager
def victoria_metrics(folder: Path, nodes: list[Node], server: str, interval: int,
                     rules: list[Path]) -> Iterator[Engine]:
    """VictoriaMetrics (single node) scraping every node, and vmalert evaluating the rules against it, writing
    what they record back to it and sending its alerts to a loopback sink."""
    (folder / "scrape.yml").write_text(json.dumps(scrape_config(nodes, server, interval)))
    store, alerter = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"

    class Sink(Quiet):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.end_headers()

    with serving(Sink) as sink, \
            started("victoria-metrics", ["victoria-metrics", f"-storageDataPath={folder / 'vm'}",
                                         f"-httpListenAddr={store[7:]}", f"-promscrape.config={folder / 'scrape.yml'}",
                                         # the bench's own counts select every node's series (the rules select
                                         # a few per node): above VictoriaMetrics' default of 300,000
                                         "-search.maxUniqueTimeseries=4000000", "-loggerLevel=ERROR"], folder,
                    f"{store}/health") as vm, \
            started("vmalert", ["vmalert", *[f"-rule={path.resolve()}" for path in rules],
                                f"-datasource.url={store}", f"-remoteWrite.url={store}", f"-remoteRead.url={store}",
                                f"-notifier.url=http://{sink}", f"-evaluationInterval={interval}s",
                                f"-httpListenAddr={alerter[7:]}", "-loggerLevel=ERROR"], folder,
                    f"{alerter}/health") as vmalert:
        yield Engine(store, alerter, (psutil.Process(vm.pid), psutil.Process(vmalert.pid)),
                     "vmalert_iteration_missed_total",
                     ("vmalert_execution_errors_total", "vmalert_alerting_rules_error",
                      "vmalert_recording_rules_error"))


def query(url: str, promql: str) -> list[dict[str, object]]:
    with urllib.request.urlopen(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": promql}), timeout=300) as r:
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


@dataclass(frozen=True)
class Engine:
    """A running store and rule engine: where to query, where its rules API and own metrics are, its
    processes (memory and CPU), and the names of its own counters of missed and failed evaluations."""

    store: str
    rules: str
    processes: tuple[psutil.Process, ...]
    missed: str
    failed: tuple[str, ...]


class GroupSeconds:
    """Each group's last evaluation: Prometheus's rules API says it; vmalert's says each rule's time since its
    group's evaluation began, so its own vmalert_iteration_duration_seconds summary is read instead (the sum
    and count it adds for each evaluation)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.last: dict[str, tuple[float, float]] = {}

    def __call__(self, group: dict[str, Any]) -> float:
        if "evaluationTime" in group:
            return float(group["evaluationTime"])
        metrics = own_metrics(self.engine.rules)
        sums = {dict(k)["group"]: v for k, v in metrics.get("vmalert_iteration_duration_seconds_sum", {}).items()}
        counts = {dict(k)["group"]: v for k, v in metrics.get("vmalert_iteration_duration_seconds_count", {}).items()}
        name = group["name"]
        now = (sums.get(name, 0.0), counts.get(name, 0.0))
        before = self.last.get(name, (0.0, 0.0))
        self.last[name] = now
        evaluations = now[1] - before[1]
        return (now[0] - before[0]) / evaluations if evaluations > 0 else max(
            float(rule["evaluationTime"]) for rule in group["rules"])


def _version(package: str) -> str:
    """The Debian package's name and version (VictoriaMetrics' binaries print none)."""
    found = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", package], capture_output=True, text=True)
    return f"{package} {found.stdout.strip() or '(version unknown)'}"


def measure(args: argparse.Namespace) -> None:
    nodes, jobs = fleet(args.nodes)
    hung = sum(node.state != "healthy" for node in nodes)
    logfmt.setup(logfmt.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        templates: dict[str, list[str]] = {}
        for state in STATES:
            bodies, pids = render_bodies(state, folder)
            templates[state] = [template(body, pids) for body in bodies]
        version = _version("prometheus" if args.engine == "prometheus" else "victoria-metrics")
        print(f"fleet: {len(nodes):,} nodes x {GPUS} GPUs, {jobs} training jobs of 1-64 nodes, {hung} nodes hung; "
              f"{version}{' with vmalert' if args.engine == 'vmalert' else ''}, scrape and rule evaluation every "
              f"{args.interval_seconds} s (rules.yml sets no group interval); {os.cpu_count()} cores, "
              f"{platform.machine()}")
        engine = prometheus if args.engine == "prometheus" else victoria_metrics
        with serving_nodes(node_bodies(nodes, templates)) as server, \
                engine(folder, nodes, server, args.interval_seconds, args.rules) as running:
            run(args, running, nodes)


def run(args: argparse.Namespace, engine: Engine, nodes: list[Node]) -> None:
    url = engine.store
    begun = time.monotonic()
    deadline = begun + 6 * args.interval_seconds + 180
    up = 0.0
    while up < len(nodes) and time.monotonic() < deadline:
        time.sleep(2)
        up = scalar(url, 'count(up{job="stall-watchdog"} == 1)')
    print(f"targets up: {up:.0f} / {len(nodes)} ({time.monotonic() - begun:.0f} s after start)")
    if up < len(nodes):
        raise SystemExit("not every target came up: nothing measured")

    # Each group's evaluations for `minutes` (or its next `cycles`), read from the rules API each second and kept
    # when the group's last evaluation moves on, each rule's with it, and the engine's memory and CPU meanwhile.
    # The first evaluation with every node up also creates the recording rules' series.
    group_seconds = GroupSeconds(engine)
    for g in rule_groups(engine.rules):
        group_seconds(g)  # where vmalert's sums start
    seen = {g["name"]: g["lastEvaluation"] for g in rule_groups(engine.rules)}
    history: dict[str, list[float]] = {group: [] for group in seen}
    slowest: dict[tuple[str, str], float] = {}  # (group, rule) -> the most one evaluation of it took
    rss = 0
    cpu0, t0 = [p.cpu_times() for p in engine.processes], time.monotonic()
    cycles = args.minutes * 60 // args.interval_seconds if args.minutes else args.cycles
    while min(len(times) for times in history.values()) < cycles:
        time.sleep(1)
        rss = max(rss, sum(p.memory_info().rss for p in engine.processes))
        for g in rule_groups(engine.rules):
            if seen.get(g["name"]) != g["lastEvaluation"]:
                seen[g["name"]] = g["lastEvaluation"]
                history.setdefault(g["name"], []).append(group_seconds(g))
                before = 0.0
                for rule in g["rules"]:
                    key = (g["name"], rule["name"])
                    took = rule["evaluationTime"] - before  # vmalert's: since its group's evaluation began
                    before = rule["evaluationTime"] if "evaluationTime" not in g else 0.0
                    slowest[key] = max(slowest.get(key, 0.0), took)
    cpu1, elapsed = [p.cpu_times() for p in engine.processes], time.monotonic() - t0
    metrics = own_metrics(engine.rules)
    missed = sum(metrics.get(engine.missed, {}).values())
    failed = sum(sum(metrics.get(name, {}).values()) for name in engine.failed)

    for group, times in sorted(history.items(), key=lambda item: -max(item[1])):
        verdict = "ok" if max(times) < GOAL_SECONDS else "OVER"
        ordered = sorted(times)
        print(f"rule group {group}: {max(times) * 1000:.0f} ms max, {ordered[len(times) // 2] * 1000:.0f} ms median, "
              f"{ordered[int(len(times) * 0.95)] * 1000:.0f} ms p95 over {len(times)} evaluations "
              f"(goal < {GOAL_SECONDS:.0f} s: {verdict})"
              + (": " + " ".join(f"{t * 1000:.0f}" for t in times) if len(times) <= 12 else ""))
    ranked = sorted(slowest.items(), key=lambda item: -item[1])
    shown = ranked[:3] + [r for r in ranked[3:] if r[1] >= 0.1]
    print("slowest rules (the most one evaluation took): "
          + "; ".join(f"{rule} {seconds * 1000:.0f} ms" for (_, rule), seconds in shown))
    print(f"rule evaluations: {missed:.0f} iterations missed, {failed:.0f} failures; RSS at most "
          f"{rss / 2**20:,.0f} MiB (the series counts below query every node's series: slow at this size)")
    n = len(nodes)
    with urllib.request.urlopen(f"{url}/api/v1/status/tsdb", timeout=60) as r:  # both engines answer it
        status = json.load(r)["data"]
    head = float(status["headStats"]["numSeries"] if "headStats" in status else status["totalSeries"])
    ours = sorted(float(r["value"][1]) for r in query(  # type: ignore[index]
        url, 'count by (instance) ({__name__=~"stall_watchdog_.+", job="stall-watchdog"})'))
    scrape_meta = scalar(url, 'count({job="stall-watchdog", __name__=~"up|scrape_.+"})')
    derived = scalar(url, 'count({__name__=~"stall_watchdog:.+|ALERTS|ALERTS_FOR_STATE"})')
    p50 = scalar(url, 'quantile(0.5, scrape_duration_seconds{job="stall-watchdog"})')
    top = scalar(url, 'max(scrape_duration_seconds{job="stall-watchdog"})')
    print(f"scrapes: {p50 * 1000:.0f} ms median, {top * 1000:.0f} ms max (the simulator's loopback server included)")
    print(f"series per node: {head / n:.0f} ({head:,.0f} / {n:,}): stall-watchdog's own "
          f"{sum(ours) / n:.0f} (healthy {ours[0]:.0f}, hung up to {ours[-1]:.0f}), {scrape_meta / n:.0f} of the "
          f"scrape (up, scrape_*), {derived / n:.1f} from the rules (recording rules, ALERTS)")
    firing = query(url, 'count by (alertname) (ALERTS{alertstate="firing"})')
    print("alerts firing: " + (", ".join(f"{r['metric']['alertname']} {r['value'][1]}"  # type: ignore[index]
                                         for r in firing) or "none"))
    cores = sum(b.user + b.system - a.user - a.system for a, b in zip(cpu0, cpu1)) / elapsed
    minutes = (time.time() - engine.processes[0].create_time()) / 60
    print(f"{args.engine} memory: RSS {rss / 2**20:,.0f} MiB (max over the window; the store and the rule engine "
          f"together) ({rss / head / 1024:.1f} KiB a series) after {minutes:.1f} min; CPU {cores:.2f} cores over the "
          f"window")
    print(f"load average {' / '.join(f'{x:.1f}' for x in os.getloadavg())} (1/5/15 min; the machine is shared)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--interval-seconds", type=int, default=10, help="scrape and rule evaluation interval")
    parser.add_argument("--cycles", type=int, default=6, help="rule evaluations measured per group")
    parser.add_argument("--minutes", type=int, default=0, help="measure this long instead of --cycles evaluations")
    parser.add_argument("--engine", choices=("prometheus", "vmalert"), default="prometheus",
                        help="prometheus: Prometheus scrapes and evaluates; vmalert: VictoriaMetrics scrapes, vmalert "
                             "evaluates")
    parser.add_argument("--rules", type=Path, nargs="+", default=[RULES],
                        help="rule files to load (a candidate beside the shipped one: give its groups other names)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the engine on the way out
    needed = ("prometheus",) if args.engine == "prometheus" else ("victoria-metrics", "vmalert")
    missing = [name for name in needed if shutil.which(name) is None]
    if missing:
        print(f"{', '.join(missing)} not on the PATH (Debian: apt-get install prometheus victoria-metrics): "
              "nothing measured")
        return
    measure(args)


if __name__ == "__main__":
    main()
