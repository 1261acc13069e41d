"""The coordinator against hostile neighbours, for real: `stall-watchdog coordinate` as its own process, a
real Prometheus scraping fake daemons (the `stall-watchdog` scrape job) and a user's own exporter (another
scrape job, run as another uid) that publish `stall_watchdog_rank_info`, and another user calling it.

- holding the node token, it does not serve without its callers' credentials, loopback included: any
  local user could otherwise have it dump another user's job and read the stacks back (a confused deputy);
- the node token goes only to instances of the daemons' scrape job and of the allow-list;
- an answer speaks only for its own instance: not for another node's name, nor for a rank Prometheus places
  on another instance; a rank two instances answer for is believed of neither;
- a malformed answer costs that node, said as such, never the job verdict, and `analyze` reads the bundle;
- where Prometheus places the job's ranks, a rank-less process or a rank placed nowhere is not counted: no
  node outvotes the others or invents a culprit;
- what a node names (a function, a file) reaches the terminal escaped, and what it sends beside its evidence
  (a bundle path, its NCCL RAS finding) is kept bounded.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, need_tool
from tests.fakes.loopback import Quiet, serving
from tests.integration.test_prometheus import free_port, stop_all, until
from tests.users import ALICE, SYSTEM_PYTHON, shared_folder
from watchdog.coordinate.job_verdict import merge
from watchdog.coordinate.nodes import NodeAnswer, Placement

NODE_TOKEN = "node-token-of-the-fleet"
CALLERS_TOKEN = "alertmanagers-token"
# A function name as a hostile node reports it: it clears the screen, retitles the window, overwrites the
# line and starts a line of its own.
EVIL = "get\x1b[2J\x1b[31mPWNED\x1b]0;title\x07\rFORGED\n  odd: rank 0 on node-a"
STACKS = {"all_reduce": [("all_reduce", "torch/distributed/distributed_c10d.py"), ("train", "train.py")],
          "loader": [("get", "queue.py"), ("__next__", "torch/utils/data/dataloader.py"), ("train", "train.py")],
          "broadcast": [("broadcast", "torch/distributed/distributed_c10d.py"), ("train", "train.py")],
          "evil": [(EVIL, "queue\x1b[8m.py"), ("__next__", "torch/utils/data/dataloader.py"), ("train", "train.py")]}


def rank_row(rank: int, where: str, pid: object = None) -> dict[str, object]:
    """One rank as a daemon's /v1/dump answers it: its py-spy threads, in all_reduce or its data loader."""
    pid = 1000 + rank if pid is None else pid
    return {"rank": rank, "pid": pid, "gpus": [rank % 8], "capture": "ok",
            "threads": [{"pid": pid, "thread_id": 1, "thread_name": "MainThread",
                         "active": where not in ("all_reduce", "broadcast"),
                         "frames": [{"name": f, "filename": p, "line": 1} for f, p in STACKS[where]]}]}


@dataclass
class FakeDaemon:
    """A node's daemon as the coordinator and Prometheus see it: /metrics with rank_info series for the
    ranks it publishes, POST /v1/dump answering `answers[training_job]`; every POST's Authorization kept."""

    node: str
    published: dict[str, list[int]]  # training_job -> ranks in rank_info (proven, as uid 1000)
    answers: dict[str, object] = field(default_factory=dict)  # training_job -> the whole answer body
    seen: list[str | None] = field(default_factory=list)
    instance: str = ""
    uid: int = 1000  # the user its ranks' jobs are proven to run as

    def handler(self) -> type[Quiet]:
        daemon = self

        class Handler(Quiet):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                lines = ["# TYPE stall_watchdog_rank_info gauge"] + [
                    f'stall_watchdog_rank_info{{gpu="{r % 8}",pid="{1000 + r}",rank="{r}",training_job="{job}",'
                    f'proof="launcher",uid="{daemon.uid}"}} 1'
                    for job, ranks in daemon.published.items() for r in ranks]
                data = ("\n".join(lines) + "\n").encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                asked = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                daemon.seen.append(self.headers.get("Authorization"))
                job = asked.get("training_job")
                if job in daemon.answers:
                    self.answer_json(200, daemon.answers[job])
                else:
                    self.answer_json(404, {"error": "no local rank of that training job on this node"})

        return Handler


def picture(job: str, ranks: list[dict[str, object]], **extra: object) -> dict[str, object]:
    return {"training_job": job, "ranks": ranks, **extra}


def rankless(pid: int, where: str) -> dict[str, object]:
    """A process of the job without a rank (counted as "pid N")."""
    return {**rank_row(0, where, pid), "rank": None}


RAS = {"stuck": True, "conclusive": False, "queries": 2, "nccl_version": "2.23.4", "problem": None,
       "summary": "NCCL RAS (two reports): every rank has launched the same collectives", "culprits": [],
       "behind": [], "missing": [], "dead": [], "unreached": [], "status_mismatch": "", "moving": False}


# run:x: one daemon, and alice's own exporter publishing a series for the same job (case 2).
# run:y: a, b honest (rank 3 on b stuck in its data loader); m answers as "node-b" for b's rank 2 (placed on
#        b) in a data loader, and for its own rank 9; m2 answers for b's rank 3 in all_reduce (hiding it).
# run:w: p and q both publish rank 0 and answer for it, in its data loader and in all_reduce.
# run:z: c honest (rank 1 in its data loader); e's answer gives a pid as an object; f's RAS culprits a number.
# run:v: a (0, 1), b (2, 3) in all_reduce; m (9) in all_reduce adds 12 rank-less processes in broadcast.
# run:u: as run:v but rank 3 on b in its data loader; m invents rank 99 in its data loader and 20 more in broadcast.
# run:t: t's rank 2 in a data loader whose function and file names carry terminal escapes.
# run:k: k1's ranks 0-3 wait in all_reduce; k2, another user's job (uid 2000) claiming run:k, has a "rank 4" stuck.
# run:r: r1 sends a bundle path of 1 MiB; r2 a RAS finding with unknown keys of 1 MiB; r3 one of a 1 MiB summary.
DAEMONS = {
    "x": FakeDaemon("node-x", {"run:x": [0]}, {"run:x": {"node": "node-x", "jobs": [
        picture("run:x", [rank_row(0, "all_reduce")])]}}),
    "a": FakeDaemon("node-a", {"run:y": [0, 1], "run:v": [0, 1], "run:u": [0, 1]}, {
        job: {"node": "node-a", "jobs": [picture(job, [rank_row(0, "all_reduce"), rank_row(1, "all_reduce")])]}
        for job in ("run:y", "run:v", "run:u")}),
    "b": FakeDaemon("node-b", {"run:y": [2, 3], "run:v": [2, 3], "run:u": [2, 3]}, {
        job: {"node": "node-b", "jobs": [picture(job, [rank_row(2, "all_reduce"),
                                                       rank_row(3, "all_reduce" if job == "run:v" else "loader")])]}
        for job in ("run:y", "run:v", "run:u")}),
    "m": FakeDaemon("node-m", {"run:y": [9], "run:v": [9], "run:u": [9]}, {
        "run:y": {"node": "node-b", "jobs": [picture("run:y", [rank_row(2, "loader"), rank_row(9, "all_reduce")])]},
        "run:v": {"node": "node-m", "jobs": [picture("run:v", [rank_row(9, "all_reduce")]
                                                     + [rankless(7000 + n, "broadcast") for n in range(12)])]},
        "run:u": {"node": "node-m", "jobs": [picture("run:u", [rank_row(9, "all_reduce"), rank_row(99, "loader")]
                                                     + [rank_row(100 + n, "broadcast") for n in range(20)])]}}),
    "m2": FakeDaemon("node-m2", {"run:y": [10]}, {"run:y": {"node": "node-m2", "jobs": [
        picture("run:y", [rank_row(3, "all_reduce"), rank_row(10, "all_reduce")])]}}),
    "p": FakeDaemon("node-p", {"run:w": [0, 1]}, {"run:w": {"node": "node-p", "jobs": [
        picture("run:w", [rank_row(0, "loader"), rank_row(1, "all_reduce")])]}}),
    "q": FakeDaemon("node-q", {"run:w": [0, 2]}, {"run:w": {"node": "node-q", "jobs": [
        picture("run:w", [rank_row(0, "all_reduce"), rank_row(2, "all_reduce")])]}}),
    "c": FakeDaemon("node-c", {"run:z": [0, 1, 2, 3]}, {"run:z": {"node": "node-c", "jobs": [
        picture("run:z", [rank_row(0, "all_reduce"), rank_row(1, "loader"), rank_row(2, "all_reduce"),
                          rank_row(3, "all_reduce")])]}}),
    "e": FakeDaemon("node-e", {"run:z": [4]}, {"run:z": {"node": "node-e", "jobs": [
        picture("run:z", [rank_row(4, "all_reduce", pid={"pid": 1004})])]}}),
    "f": FakeDaemon("node-f", {"run:z": [5]}, {"run:z": {"node": "node-f", "jobs": [
        picture("run:z", [rank_row(5, "all_reduce")], nccl_ras={"conclusive": True, "culprits": 5,
                                                                 "summary": "rank 5"})]}}),
    "t": FakeDaemon("node-t", {"run:t": [0, 1, 2]}, {"run:t": {"node": "node-t", "jobs": [
        picture("run:t", [rank_row(0, "all_reduce"), rank_row(1, "all_reduce"), rank_row(2, "evil")])]}}),
    "k1": FakeDaemon("node-k1", {"run:k": [0, 1, 2, 3]}, {"run:k": {"node": "node-k1", "jobs": [
        picture("run:k", [rank_row(r, "all_reduce") for r in range(4)])]}}),
    "k2": FakeDaemon("node-k2", {"run:k": [4]}, {"run:k": {"node": "node-k2", "jobs": [
        picture("run:k", [rank_row(4, "loader")])]}}, uid=2000),
    "r1": FakeDaemon("node-r1", {"run:r": [0]}, {"run:r": {"node": "node-r1", "bundle": "/var/lib/" + "B" * 2**20,
                                                           "jobs": [picture("run:r", [rank_row(0, "all_reduce")])]}}),
    "r2": FakeDaemon("node-r2", {"run:r": [1]}, {"run:r": {"node": "node-r2", "bundle": "/var/lib/stall-watchdog/b1",
                                                           "jobs": [picture("run:r", [rank_row(1, "loader")], nccl_ras={
                                                               **RAS, "extra": ["x" * 100] * 10000,
                                                               "dead": [{"rank": 5, "host": "h" * 2**20}]})]}}),
    "r3": FakeDaemon("node-r3", {"run:r": [2]}, {"run:r": {"node": "node-r3", "jobs": [
        picture("run:r", [rank_row(2, "all_reduce")], nccl_ras={**RAS, "summary": "S" * 2**20})]}}),
}

EXPORTER = textwrap.dedent('''
    """A user's own exporter: publishes rank_info for run:x, and notes every POST's Authorization."""
    import http.server, sys
    port, log = int(sys.argv[1]), sys.argv[2]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            data = (b'stall_watchdog_rank_info{gpu="0",pid="7",rank="0",training_job="run:x",proof="launcher",'
                    b'uid="1000"} 1\\n')
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            with open(log, "a") as out:
                out.write(f"{self.path} {self.headers.get('Authorization')}\\n")
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')


@dataclass
class Fleet:
    prometheus: str
    tmp: Path
    exporter: str  # alice's exporter's instance
    exporter_log: Path
    token: Path
    callers: Path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    prometheus = need_tool("prometheus")
    tmp = tmp_path_factory.mktemp("coordinator")
    processes: list[subprocess.Popen[bytes]] = []
    with shared_folder() as folder, _daemons() as instances:
        (folder / "exporter.py").write_text(EXPORTER)
        (folder / "exporter.py").chmod(0o644)
        port, log = free_port(), folder / "exporter.log"
        processes.append(subprocess.Popen([SYSTEM_PYTHON, str(folder / "exporter.py"), str(port), str(log)],
                                          user=ALICE, group=ALICE, extra_groups=[], cwd=folder,
                                          env={"PATH": "/usr/bin:/bin"}, stderr=(tmp / "exporter.err").open("wb")))
        prom_port = free_port()
        (tmp / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s}\nscrape_configs:\n"
            f"  - job_name: stall-watchdog\n    static_configs: [{{targets: {json.dumps(sorted(instances))}}}]\n"
            f"  - job_name: alice-app\n    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n")
        processes.append(subprocess.Popen(
            [prometheus, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'prom-data'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=subprocess.DEVNULL,
            stderr=(tmp / "prometheus.log").open("wb")))
        url = f"http://127.0.0.1:{prom_port}"
        expr = urllib.parse.quote("count by (job, instance) (stall_watchdog_rank_info)")
        until(lambda: len(json.loads(urllib.request.urlopen(f"{url}/api/v1/query?query={expr}", timeout=5).read())
                          ["data"]["result"]) == len(DAEMONS) + 1, 90, "Prometheus to scrape every target")
        token, callers = tmp / "dump-token", tmp / "callers-token"
        token.write_text(NODE_TOKEN + "\n")
        callers.write_text(CALLERS_TOKEN + "\n")
        try:
            yield Fleet(url, tmp, f"127.0.0.1:{port}", log, token, callers)
        finally:
            stop_all(processes)


@pytest.fixture(autouse=True)
def _forget_what_was_seen() -> None:
    for daemon in DAEMONS.values():
        daemon.seen.clear()


class _daemons:  # noqa: N801 (a context manager used like a function)
    """Every fake daemon served on loopback while the block runs: their instances."""

    def __enter__(self) -> list[str]:
        self._contexts = [serving(d.handler()) for d in DAEMONS.values()]
        for daemon, context in zip(DAEMONS.values(), self._contexts):
            daemon.instance = context.__enter__().removeprefix("http://")
        return [d.instance for d in DAEMONS.values()]

    def __exit__(self, *exc: object) -> None:
        for context in self._contexts:
            context.__exit__(None, None, None)


def coordinate(fleet: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "watchdog", "coordinate", "--prometheus", fleet.prometheus,
                           "--out", str(fleet.tmp / "jobs"), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def investigate(fleet: Fleet, job: str, *args: str) -> dict[str, Any]:
    done = coordinate(fleet, "--job", job, "--json", "--node-token-file", str(fleet.token), *args)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stdout, done.stderr
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def as_alice(method: str, url: str, token: str | None = None, body: bytes | None = None) -> tuple[int, str]:
    """An HTTP request made by another local user (uid 1001): its status and body."""
    script = textwrap.dedent('''
        import sys, urllib.request, urllib.error
        method, url, token, body = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].encode() or None
        request = urllib.request.Request(url, data=body, method=method)
        if token:
            request.add_header("Authorization", "Bearer " + token)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                print(response.status, response.read().decode())
        except urllib.error.HTTPError as exc:
            print(exc.code, exc.read().decode())
        except OSError as exc:  # not serving yet
            print(0, exc)
    ''')
    done = subprocess.run([SYSTEM_PYTHON, "-c", script, method, url, token or "", (body or b"").decode()],
                          user=ALICE, group=ALICE, extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=30)
    status, _, text = done.stdout.partition(" ")
    assert status.isdigit(), done.stderr
    return int(status), text


# Case 1: a confused deputy.

def test_holding_the_node_token_it_wants_its_callers_credentials_on_loopback_too(fleet: Fleet) -> None:
    port = free_port()
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "watchdog", "coordinate", "--prometheus", fleet.prometheus, "--out",
         str(fleet.tmp / "jobs-open"), "--listen", f"127.0.0.1:{port}", "--node-token-file", str(fleet.token)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        refused = coordinator.wait(timeout=30)
    except subprocess.TimeoutExpired:
        # It serves: any local user has it dump another user's job and reads the stacks back.
        base = f"http://127.0.0.1:{port}"
        posted = as_alice("POST", base + "/v1/alerts", body=b'{"training_job": "run:y"}')
        time.sleep(5)
        read = as_alice("GET", base + "/v1/jobs")
        coordinator.kill()
        coordinator.wait()
        pytest.fail(f"it served with the node token and no callers' credentials: alice POSTed {posted[0]}, "
                    f"then read {read[0]} with {'all_reduce' in read[1] and 'stack frames' or 'nothing'} of run:y")
    stderr = coordinator.stderr.read() if coordinator.stderr else ""
    assert refused == 2 and "Traceback" not in stderr, stderr
    assert "--node-token-file" in stderr and "--token-file" in stderr and "--basic-auth-user" in stderr, stderr
    assert "loopback" in stderr, stderr


def test_with_credentials_another_user_gets_nothing_and_alertmanager_gets_the_verdict(fleet: Fleet) -> None:
    port = free_port()
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "watchdog", "coordinate", "--prometheus", fleet.prometheus, "--out",
         str(fleet.tmp / "jobs-closed"), "--listen", f"127.0.0.1:{port}", "--node-token-file", str(fleet.token),
         "--token-file", str(fleet.callers)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        until(lambda: as_alice("GET", base + "/healthz")[0] == 200, 30, "the coordinator to serve")
        assert as_alice("POST", base + "/v1/alerts", body=b'{"training_job": "run:y"}')[0] == 401
        assert as_alice("GET", base + "/v1/jobs")[0] == 401
        assert as_alice("POST", base + "/v1/alerts", NODE_TOKEN, b'{"training_job": "run:y"}')[0] == 401
        assert all(not d.seen for d in DAEMONS.values())  # nobody was asked on alice's word
        assert as_alice("POST", base + "/v1/alerts", CALLERS_TOKEN, b'{"training_job": "run:y"}')[0] == 202

        def verdict() -> object:
            status, text = as_alice("GET", base + "/v1/jobs", CALLERS_TOKEN)
            return status == 200 and json.loads(text).get("run:y")
        assert until(verdict, 60, "the job verdict")
    finally:
        coordinator.terminate()
        coordinator.wait(timeout=15)


# Case 2: the node token sent to any exporter.

def test_the_node_token_goes_only_to_the_daemons_scrape_job(fleet: Fleet) -> None:
    fleet.exporter_log.unlink(missing_ok=True)
    result = investigate(fleet, "run:x")
    asked = fleet.exporter_log.read_text() if fleet.exporter_log.exists() else ""
    assert asked == "", f"alice's exporter ({fleet.exporter}, scrape job alice-app) was asked: {asked}"
    assert DAEMONS["x"].seen == [f"Bearer {NODE_TOKEN}"]
    assert [n["instance"] for n in result["nodes"]] == [DAEMONS["x"].instance]
    assert result["nodes_answered"] == 1

    # The daemons under a scrape job of another name: --scrape-job says which.
    other = investigate(fleet, "run:x", "--scrape-job", "stall-watchdog-gpu")
    assert other["nodes"] == [] and "stall-watchdog-gpu" in other["problem"]


def test_the_node_token_goes_only_to_the_allowed_nodes(fleet: Fleet) -> None:
    outside = investigate(fleet, "run:x", "--allow-node", "10.0.0.0/8", "--allow-node", "node-x.example:9944")
    assert DAEMONS["x"].seen == []
    (node,) = outside["nodes"]
    assert node["instance"] == DAEMONS["x"].instance and node["status"] is None
    assert "--allow-node" in node["error"] and "not asked" in node["error"]
    assert outside["verdict"]["kind"] == "unknown"
    inside = investigate(fleet, "run:x", "--allow-node", "127.0.0.0/8")
    assert DAEMONS["x"].seen == [f"Bearer {NODE_TOKEN}"] and inside["nodes_answered"] == 1
    exact = investigate(fleet, "run:x", "--allow-node", DAEMONS["x"].instance)
    assert exact["nodes_answered"] == 1
    refused = coordinate(fleet, "--job", "run:x", "--allow-node", "http://10.0.0.1/")
    assert refused.returncode == 2 and "--allow-node" in refused.stderr and "Traceback" not in refused.stderr


# Case 3: a node's answer speaks for another node.

def test_an_answer_speaks_only_for_its_own_instance(fleet: Fleet) -> None:
    result = investigate(fleet, "run:y")
    b, m, m2 = (DAEMONS[n].instance for n in ("b", "m", "m2"))
    assert result["nodes_answered"] == 4
    (odd,) = result["odd_ranks"]
    # rank 3 is b's, stuck in its data loader; m2's word that it is in all_reduce is not taken
    assert (odd["member"], odd["instance"], odd["pid"]) == ("rank 3", b, 1003), odd
    assert odd["node"].startswith("node-b") and b in odd["node"]  # two answers say node-b: each by its instance
    assert "rank 2" not in result["outliers"]
    text = result["verdict"]["sentence"]
    assert f"{m} answered for rank 2, which Prometheus places on {b}" in text, text
    assert f"{m2} answered for rank 3, which Prometheus places on {b}" in text, text
    rows = {(r["rank"], r["instance"]) for r in result["ranks"]}
    assert (2, m) not in rows and (9, m) in rows and (2, b) in rows and (10, m2) in rows
    named = {r["instance"]: r["node"] for r in result["ranks"]}
    assert named[m] != "node-b" and m in named[m] and named[DAEMONS["a"].instance] == "node-a"


def test_a_rank_two_placed_instances_answer_for_is_believed_of_neither(fleet: Fleet) -> None:
    result = investigate(fleet, "run:w")
    p, q = sorted((DAEMONS["p"].instance, DAEMONS["q"].instance))
    assert result["nodes_answered"] == 2 and result["odd_ranks"] == [] and "rank 0" not in result["outliers"]
    assert f"rank 0 was answered for by 2 instances ({p}, {q}): believed of neither" in result["verdict"]["sentence"]
    assert {r["rank"] for r in result["ranks"]} == {1, 2}


# Case 4: one malformed answer sinks the whole job verdict.

def test_a_malformed_answer_costs_that_node_never_the_verdict(fleet: Fleet) -> None:
    result = investigate(fleet, "run:z")
    c, e, f = (DAEMONS[n].instance for n in ("c", "e", "f"))
    assert [o["member"] for o in result["odd_ranks"]] == ["rank 1"] and result["odd_ranks"][0]["instance"] == c
    assert result["nodes_answered"] == 1 and sorted(result["nodes_silent"]) == sorted([e, f])
    errors = {n["instance"]: n["error"] for n in result["nodes"]}
    assert "malformed" in errors[e] and "pid" in errors[e], errors
    assert "malformed" in errors[f] and "culprits" in errors[f], errors
    assert "2 nodes answered what cannot be read" in result["verdict"]["sentence"]
    # The job bundle is evidence `analyze` reads back: the same verdict, no traceback.
    bundle = Path(result["bundle"])
    again = subprocess.run([sys.executable, "-m", "watchdog", "analyze", str(bundle), "--json"], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr
    assert json.loads(again.stdout.splitlines()[0])["outliers"] == ["rank 1"]
    # and a bundle whose node files were tampered with (an answer that is a list, a status that is text)
    for path in (bundle / "nodes").iterdir():
        path.chmod(0o600)
        node = json.loads(path.read_text())
        if node["instance"] == e:
            path.write_text(json.dumps({**node, "status": "200", "answer": [1, 2]}))
        elif node["instance"] == f:
            path.write_text(json.dumps({**node, "instance": {"x": 1}, "answer": {"jobs": {"a": 1}}}))
    again = subprocess.run([sys.executable, "-m", "watchdog", "analyze", str(bundle), "--json"], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr
    assert json.loads(again.stdout.splitlines()[0])["outliers"] == ["rank 1"]



# Case 5: where Prometheus places the ranks, a rank-less process or a rank placed nowhere outvotes the others.

def test_rankless_processes_do_not_outvote_the_placed_ranks(fleet: Fleet) -> None:
    result = investigate(fleet, "run:v")
    m = DAEMONS["m"].instance
    # Before: "13 of 17 ranks wait in broadcast", ranks 0-3 on node-a and node-b named as the odd, stuck ones.
    assert result["odd_ranks"] == [] and result["outliers"] == [], result["odd_ranks"]
    assert result["verdict"]["kind"] == "hang"  # every placed rank answered: the culprit is not said to be elsewhere
    assert {r["rank"] for r in result["ranks"]} == {0, 1, 2, 3, 9}
    text = result["verdict"]["headline"] + result["verdict"]["sentence"]
    assert "rank 0" not in result["verdict"]["headline"] and "broadcast" not in result["verdict"]["headline"], text
    assert f"{m} answered for 12 processes Prometheus places on no instance (pid 7000 (no rank), " in text, text
    assert ": not believed" in text


def test_a_rank_placed_nowhere_is_not_believed(fleet: Fleet) -> None:
    result = investigate(fleet, "run:u")
    b, m = DAEMONS["b"].instance, DAEMONS["m"].instance
    # Before: rank 99 (m's invention) named beside rank 3, or the 20 invented ranks outvoting the job.
    assert [(o["member"], o["instance"]) for o in result["odd_ranks"]] == [("rank 3", b)], result["odd_ranks"]
    assert {r["rank"] for r in result["ranks"]} == {0, 1, 2, 3, 9}
    text = result["verdict"]["sentence"]
    assert f"{m} answered for 21 processes Prometheus places on no instance (rank 99, rank 100, " in text, text


def test_where_placement_is_unknown_every_answer_still_counts() -> None:
    """A Prometheus that gives no `rank` label (the scale bench's stand-in) places no rank: each answer is
    then believed for what it says, rank-less processes included, as before."""
    answered = [NodeAnswer("a:1", 200, {"node": "node-a", "jobs": [picture("J", [rank_row(0, "all_reduce"),
                                                                                  rank_row(1, "all_reduce")])]}),
                NodeAnswer("b:1", 200, {"node": "node-b", "jobs": [picture("J", [rank_row(2, "all_reduce"),
                                                                                  rankless(4242, "loader")])]})]
    result = merge("J", answered, Placement(["a:1", "b:1"]))
    assert [(o["member"], o["node"]) for o in result.odd] == [("pid 4242", "node-b")]
    assert "not believed" not in result.verdict.sentence
    placed = merge("J", answered, Placement(["a:1", "b:1"], {0: frozenset({"a:1"}), 1: frozenset({"a:1"}),
                                                             2: frozenset({"b:1"})}))
    assert placed.odd == [] and "b:1 answered for pid 4242 (no rank), which Prometheus places on no instance" \
        in placed.verdict.sentence


# Case 5b: a job's name is any user's claim.

def test_another_users_claimed_rank_is_never_the_jobs_culprit(fleet: Fleet) -> None:
    """Another user's job on node-k2 claims run:k and a rank 4 stuck in its data loader. Before, the coordinator
    asked node-k2 and named its "rank 4" the job's culprit; the job's own ranks (uid 1000) are all it speaks for."""
    result = investigate(fleet, "run:k")
    assert result["odd_ranks"] == [] and "rank 4" not in result["verdict"]["headline"], result["verdict"]
    assert {r["rank"] for r in result["ranks"]} == {0, 1, 2, 3}
    assert not DAEMONS["k2"].seen  # not asked: it was never given the node token for this job
    assert "1 rank claiming this job runs as another user (uid 2000" in result["verdict"]["sentence"]


# Case 6: a node's names reach the terminal raw.

def test_what_a_node_names_reaches_the_terminal_escaped(fleet: Fleet) -> None:
    done = subprocess.run([sys.executable, "-m", "watchdog", "coordinate", "--prometheus", fleet.prometheus, "--out",
                           str(fleet.tmp / "jobs"), "--job", "run:t", "--node-token-file", str(fleet.token)],
                          cwd=REPO, capture_output=True, timeout=120)  # bytes: text mode would turn CR into LF
    out = done.stdout.decode()
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr
    for control in ("\x1b", "\x07", "\r", "\x9b"):
        assert control not in out, f"{control!r} reached the terminal: {out!r}"
    lines = out.splitlines()
    assert [line for line in lines if line.startswith("  odd:")] == [lines[-1]], lines  # one odd rank, one line
    assert lines[-1].startswith("  odd: rank 2 on node-t") and "\\x1b[2J" in lines[-1], lines
    assert not any(line.startswith(("FORGED", "  odd: rank 0")) for line in lines), lines


# Case 7: what a node sends beside its evidence is kept whole in every kept verdict.

def test_a_bundle_path_and_a_ras_finding_are_kept_bounded(fleet: Fleet) -> None:
    result = investigate(fleet, "run:r")
    r1, r2, r3 = (DAEMONS[n].instance for n in ("r1", "r2", "r3"))
    nodes = {n["instance"]: n for n in result["nodes"]}
    # Before: the 1 MiB path and the whole RAS dict (1 MiB of unknown keys) in the verdict kept and served.
    assert len(json.dumps(result)) < 64 * 1024, {k: len(json.dumps(v)) for k, v in result.items()}
    assert nodes[r1]["bundle"] is None and "bundle" in nodes[r1]["error"] and "malformed" in nodes[r1]["error"]
    assert nodes[r2]["bundle"] == "/var/lib/stall-watchdog/b1" and nodes[r2]["error"] is None
    assert "summary" in nodes[r3]["error"] and "malformed" in nodes[r3]["error"]
    ras = result["nccl_ras"]
    assert set(ras) <= {"stuck", "conclusive", "queries", "nccl_version", "summary", "culprits", "moving"}, set(ras)
    assert ras["summary"] == RAS["summary"] and ras["stuck"] is True
    assert [o["member"] for o in result["odd_ranks"]] == []  # r2's rank 1 alone is read: nothing to compare
