"""The coordinator against hostile neighbours, for real: `stall-watchdog coordinate` as its own process, a
real Prometheus scraping fake daemons (the `stall-watchdog` scrape job) and a user's own exporter (another
scrape job, run as another uid) that publish `stall_watchdog_rank_info`, and another user calling it.

- holding the node token, it does not serve without its callers' credentials, loopback included: any
  local user could otherwise have it dump another user's job and read the stacks back (a confused deputy);
- the node token goes only to instances of the daemons' scrape job and of the allow-list;
- an answer speaks only for its own instance: not for another node's name, nor for a rank Prometheus places
  on another instance; a rank two instances answer for is believed of neither;
- a malformed answer costs that node, said as such, never the job verdict, and `analyze` reads the bundle.
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

NODE_TOKEN = "node-token-of-the-fleet"
CALLERS_TOKEN = "alertmanagers-token"
STACKS = {"all_reduce": [("all_reduce", "torch/distributed/distributed_c10d.py"), ("train", "train.py")],
          "loader": [("get", "queue.py"), ("__next__", "torch/utils/data/dataloader.py"), ("train", "train.py")]}


def rank_row(rank: int, where: str, pid: object = None) -> dict[str, object]:
    """One rank as a daemon's /v1/dump answers it: its py-spy threads, in all_reduce or its data loader."""
    pid = 1000 + rank if pid is None else pid
    return {"rank": rank, "pid": pid, "gpus": [rank % 8], "capture": "ok",
            "threads": [{"pid": pid, "thread_id": 1, "thread_name": "MainThread", "active": where != "all_reduce",
                         "frames": [{"name": f, "filename": p, "line": 1} for f, p in STACKS[where]]}]}


@dataclass
class FakeDaemon:
    """A node's daemon as the coordinator and Prometheus see it: /metrics with rank_info series for the
    ranks it publishes, POST /v1/dump answering `answers[training_job]`; every POST's Authorization kept."""

    node: str
    published: dict[str, list[int]]  # training_job -> ranks in rank_info
    answers: dict[str, object] = field(default_factory=dict)  # training_job -> the whole answer body
    seen: list[str | None] = field(default_factory=list)
    instance: str = ""

    def handler(self) -> type[Quiet]:
        daemon = self

        class Handler(Quiet):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                lines = ["# TYPE stall_watchdog_rank_info gauge"] + [
                    f'stall_watchdog_rank_info{{gpu="{r % 8}",pid="{1000 + r}",rank="{r}",training_job="{job}"}} 1'
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


# run:x: one daemon, and alice's own exporter publishing a series for the same job (case 2).
# run:y: a, b honest (rank 3 on b stuck in its data loader); m answers as "node-b" for b's rank 2 (placed on
#        b) in a data loader, and for its own rank 9; m2 answers for b's rank 3 in all_reduce (hiding it).
# run:w: p and q both publish rank 0 and answer for it, in its data loader and in all_reduce.
# run:z: c honest (rank 1 in its data loader); e's answer gives a pid as an object; f's RAS culprits a number.
DAEMONS = {
    "x": FakeDaemon("node-x", {"run:x": [0]}, {"run:x": {"node": "node-x", "jobs": [
        picture("run:x", [rank_row(0, "all_reduce")])]}}),
    "a": FakeDaemon("node-a", {"run:y": [0, 1]}, {"run:y": {"node": "node-a", "jobs": [
        picture("run:y", [rank_row(0, "all_reduce"), rank_row(1, "all_reduce")])]}}),
    "b": FakeDaemon("node-b", {"run:y": [2, 3]}, {"run:y": {"node": "node-b", "jobs": [
        picture("run:y", [rank_row(2, "all_reduce"), rank_row(3, "loader")])]}}),
    "m": FakeDaemon("node-m", {"run:y": [9]}, {"run:y": {"node": "node-b", "jobs": [
        picture("run:y", [rank_row(2, "loader"), rank_row(9, "all_reduce")])]}}),
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
}

EXPORTER = textwrap.dedent('''
    """A user's own exporter: publishes rank_info for run:x, and notes every POST's Authorization."""
    import http.server, sys
    port, log = int(sys.argv[1]), sys.argv[2]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            data = b'stall_watchdog_rank_info{gpu="0",pid="7",rank="0",training_job="run:x"} 1\\n'
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

