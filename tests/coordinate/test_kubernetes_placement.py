"""The coordinator's way to a job's nodes through the Kubernetes API (coordinate/scheduler.py), against a local
HTTP server that answers as the API server does (there is no cluster here): a pod's labels, then the pods of
its job and the daemons' pods, listed in pages (`limit`, `continue`) with the service account's token."""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.loopback import Quiet, Served, free_port
from watchdog.boundary.webhook import SchedulerIds
from watchdog.coordinate.nodes import NodeClient
from watchdog.coordinate.scheduler import KubernetesNodes, SchedulerError
from watchdog.coordinate.service import Coordinator

TOKEN = "k8s-token-for-tests"
JOB = "batch.kubernetes.io/job-name"


def pod(name: str, node: str | None, labels: dict[str, str], ip: str = "", phase: str = "Running") -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels}, "spec": {"nodeName": node} if node else {},
            "status": {"phase": phase, "podIP": ip}}


class ApiServer(Served):
    """Pods by namespace, listed `page` at a time."""

    def __init__(self, pods: dict[str, list[dict[str, Any]]], page: int = 2):
        self.pods, self.page = pods, page
        self.seen: list[str] = []
        self.problems: list[str] = []
        outer = self

        class Handler(Quiet):
            def do_GET(self) -> None:  # noqa: N802
                outer.seen.append(self.path)
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self.answer_json(401, {"kind": "Status", "code": 401, "message": "Unauthorized"})
                url = urllib.parse.urlsplit(self.path)
                parts, query = url.path.split("/"), dict(urllib.parse.parse_qsl(url.query))
                if parts[:4] != ["", "api", "v1", "namespaces"] or parts[5:6] != ["pods"]:
                    return self.answer_json(404, {"kind": "Status", "code": 404})
                listed = outer.pods.get(parts[4], [])
                if len(parts) == 7:
                    found = [p for p in listed if p["metadata"]["name"] == parts[6]]
                    return self.answer_json(200, found[0]) if found else self.answer_json(
                        404, {"kind": "Status", "code": 404, "message": f'pods "{parts[6]}" not found'})
                key, _, value = query.get("labelSelector", "").partition("=")
                if int(query.get("limit", "0")) <= 0:
                    outer.problems.append(f"a list without a limit: {self.path}")
                matching = [p for p in listed if p["metadata"]["labels"].get(key) == value]
                start = int(query.get("continue") or 0)
                end = start + outer.page
                more = {"continue": str(end)} if end < len(matching) else {}
                return self.answer_json(200, {"kind": "PodList", "metadata": more, "items": matching[start:end]})

        self.handler = Handler


def daemons(nodes: dict[str, str]) -> list[dict[str, Any]]:
    return [pod(f"stall-watchdog-{n}", node, {"app.kubernetes.io/name": "stall-watchdog"}, ip)
            for n, (node, ip) in enumerate(nodes.items())]


def token_file(folder: Path, token: str = TOKEN) -> str:
    path = folder / "sa-token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return str(path)


def test_a_pods_job_is_placed_on_its_pods_nodes_at_their_daemons(tmp_path: Path) -> None:
    job = [pod(f"llm-{n}", f"gpu-{n // 2}", {JOB: "llm", "role": "worker"}) for n in range(6)]  # 3 nodes
    other = [pod("other-0", "gpu-9", {JOB: "other"}), pod("pending", None, {JOB: "llm"}, phase="Pending")]
    api = ApiServer({"training": job + other,
                     "stall-watchdog": daemons({"gpu-0": "10.0.0.10", "gpu-1": "fd00::11", "gpu-9": "10.0.0.19"})})
    with api.running():
        placement = KubernetesNodes(api.url, token_file(tmp_path)).placement("training", "llm-3")
    assert placement.source == "kubernetes" and api.problems == []
    assert placement.instances == ["10.0.0.10:9944", "[fd00::11]:9944"]  # gpu-9 is another job's node
    assert placement.note == "1 nodes of the job run no daemon with an IP address (gpu-2); not asked"
    assert sum("continue=" in path for path in api.seen) >= 2  # read page by page


@pytest.mark.parametrize(("pods", "token", "said"), [
    ({"training": [pod("llm-0", "gpu-0", {"app": "llm"})]}, TOKEN, "carries none of the job labels"),
    ({"training": [pod("llm-0", None, {JOB: "llm"})]}, TOKEN, "no pod of training with batch.kubernetes.io/job-name="
                                                             "llm is on a node"),
    ({"training": [pod("llm-0", "gpu-0", {JOB: "llm"})]}, TOKEN, "no daemon runs on the 1 nodes"),
    ({}, TOKEN, 'HTTP 404 for /api/v1/namespaces/training/pods/llm-0: pods "llm-0" not found'),
    ({}, "wrong", "HTTP 401 for /api/v1/namespaces/training/pods/llm-0: Unauthorized"),
])
def test_what_kubernetes_cannot_place_is_said(pods: dict[str, list[dict[str, Any]]], token: str, said: str,
                                              tmp_path: Path) -> None:
    api = ApiServer(pods)
    with api.running(), pytest.raises(SchedulerError, match=said):
        KubernetesNodes(api.url, token_file(tmp_path, token)).placement("training", "llm-0")
    with pytest.raises(SchedulerError, match="not a Kubernetes namespace and pod"):
        KubernetesNodes("http://127.0.0.1:9", token_file(tmp_path)).placement("training", "../nodes/x")


class DumpNode(Quiet):
    asked: list[str] = []

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        DumpNode.asked.append(self.server.server_address[0])  # type: ignore[index]
        self.answer_json(200, {"node": f"node-{self.server.server_address[0]}", "jobs": []})  # type: ignore[index]


@contextmanager
def dump_nodes(*addresses: str) -> Iterator[int]:
    port = free_port()
    servers = [ThreadingHTTPServer((address, port), DumpNode) for address in addresses]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield port
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def test_a_page_naming_a_pod_dumps_its_jobs_nodes_with_prometheus_down(tmp_path: Any) -> None:
    api = ApiServer({"training": [pod(f"llm-{n}", f"gpu-{n}", {JOB: "llm"}) for n in range(2)],
                     "stall-watchdog": daemons({"gpu-0": "127.0.0.1", "gpu-1": "127.0.0.2"})})
    DumpNode.asked = []
    with api.running(), dump_nodes("127.0.0.1", "127.0.0.2") as port:
        coordinator = Coordinator("http://127.0.0.1:9", tmp_path, NodeClient(timeout_seconds=5),
                                  kubernetes=KubernetesNodes(api.url, token_file(tmp_path), daemon_port=port))
        status, accepted = coordinator.accept(json.dumps({"training_job": "run:llm", "namespace": "training",
                                                          "pod": "llm-1"}).encode())
        coordinator.pool.shutdown(wait=True)
        without = coordinator.investigate("run:other", SchedulerIds(namespace="training", pod="gone"))
    assert status == 202 and accepted["accepted"] == ["run:llm"]
    verdict = coordinator.latest["run:llm"]
    assert verdict["placed_by"] == "kubernetes" and verdict["problem"] is None and verdict["nodes_answered"] == 2
    assert sorted(DumpNode.asked) == ["127.0.0.1", "127.0.0.2"]
    # the API cannot place it, and Prometheus is down: both said
    assert without.problem is not None and 'pods "gone" not found' in without.problem
    assert "127.0.0.1:9" in without.problem and without.placement.instances == []


def test_coordinate_asks_kubernetes_for_a_pods_job(tmp_path: Any) -> None:
    """`coordinate --kubernetes-api URL --job J --pod NS/POD`, the rest of the section from --config; without
    a readable service account token it says which key, before asking anything."""
    import subprocess
    import sys

    from tests.conftest import REPO
    api = ApiServer({"training": [pod("llm-0", "gpu-0", {JOB: "llm"})],
                     "stall-watchdog": daemons({"gpu-0": "127.0.0.1"})})
    token = tmp_path / "sa-token"
    token.write_text(TOKEN + "\n")
    DumpNode.asked = []
    with api.running(), dump_nodes("127.0.0.1") as port:
        config = tmp_path / "c.yaml"
        config.write_text(f"coordinator:\n  kubernetes:\n    token_file: {token}\n    ca_file: null\n"
                          f"    daemon_port: {port}\n")
        done = subprocess.run([sys.executable, "-m", "watchdog", "coordinate", "--config", str(config),
                               "--kubernetes-api", api.url, "--job", "run:llm", "--pod", "training/llm-0", "--json",
                               "--out", str(tmp_path / "jobs")], cwd=REPO, capture_output=True, text=True, timeout=120)
    answer = json.loads(done.stdout)
    assert done.returncode == 0 and answer["placed_by"] == "kubernetes" and answer["nodes_answered"] == 1, done.stderr
    assert DumpNode.asked == ["127.0.0.1"]
    refused = subprocess.run([sys.executable, "-m", "watchdog", "coordinate", "--kubernetes-api", "https://k8s:6443",
                              "--job", "run:llm", "--pod", "training/llm-0"], cwd=REPO, capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 2 and "coordinator.kubernetes.token_file" in refused.stderr
    assert "Traceback" not in refused.stderr


class Hostile(Served):
    """An API server whose lists never end (the same continue token, or a new one each page, with no items),
    whose daemon pods name their node as a list or give host names for addresses, or that redirects."""

    def __init__(self, mode: str):
        self.mode, self.gets = mode, 0
        outer = self

        class Handler(Quiet):
            def do_GET(self) -> None:  # noqa: N802
                outer.gets += 1
                if outer.mode == "redirect":
                    self.send_response(302)
                    self.send_header("Location", "http://127.0.0.1:9/")
                    self.end_headers()
                    return None
                path = urllib.parse.urlsplit(self.path).path
                if path.endswith("/pods/llm-0"):
                    return self.answer_json(200, pod("llm-0", "gpu-0", {JOB: "llm"}))
                if outer.mode in ("same", "new"):
                    token = "same" if outer.mode == "same" else str(outer.gets)
                    return self.answer_json(200, {"items": [], "metadata": {"continue": token}})
                if "/training/" in path:
                    return self.answer_json(200, {"items": [pod(f"llm-{n}", f"gpu-{n}", {JOB: "llm"})
                                                            for n in range(4)]})
                daemons = [{"spec": {"nodeName": ["gpu-0"]}, "status": {"phase": "Running", "podIP": "10.0.0.1"}},
                           pod("d1", "gpu-1", {}, "localhost"), pod("d2", "gpu-2", {}, "0.0.0.0"),
                           pod("d3", "gpu-3", {}, "10.0.0.3")]
                return self.answer_json(200, {"items": daemons})

        self.handler = Handler


@pytest.mark.parametrize(("mode", "said"), [("same", "gave a continue token it gave before"),
                                             ("new", "went past .* pages"),
                                             ("redirect", "HTTP 302 .* redirects are not followed")])
def test_an_api_server_that_never_ends_a_list_or_redirects_is_left(mode: str, said: str, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from watchdog.coordinate import scheduler
    monkeypatch.setattr(scheduler, "MAX_PAGES", 50)
    api = Hostile(mode)
    with api.running(), pytest.raises(SchedulerError, match=said):
        KubernetesNodes(api.url, token_file(tmp_path)).placement("training", "llm-0")
    assert api.gets <= 52


def test_daemon_pods_of_the_wrong_shape_or_without_an_ip_address_are_not_asked(tmp_path: Path) -> None:
    api = Hostile("shapes")
    with api.running():
        placement = KubernetesNodes(api.url, token_file(tmp_path)).placement("training", "llm-0")
    assert placement.instances == ["10.0.0.3:9944"]
    assert placement.note == "3 nodes of the job run no daemon with an IP address (gpu-0, gpu-1, gpu-2); not asked"


def test_the_service_account_token_is_read_at_each_placement(tmp_path: Path) -> None:
    """A projected token is renewed in its file: the next placement sends the new one."""
    api = ApiServer({"training": [pod("llm-0", "gpu-0", {JOB: "llm"})],
                     "stall-watchdog": daemons({"gpu-0": "10.0.0.1"})})
    with api.running():
        nodes = KubernetesNodes(api.url, token_file(tmp_path, "expired-token"))
        with pytest.raises(SchedulerError, match="HTTP 401"):
            nodes.placement("training", "llm-0")
        token_file(tmp_path)
        assert nodes.placement("training", "llm-0").instances == ["10.0.0.1:9944"]


@pytest.mark.parametrize(("section", "said"), [
    ({"slurm_instance": "user@{node}:9944"}, "expected host:port, {node} in the host"),
    ({"slurm_instance": "http://{node}:9944"}, "expected host:port, {node} in the host"),
    ({"slurm_instance": "{node}/x:9944"}, "expected host:port, {node} in the host"),
    ({"kubernetes": {"api_url": "http://admin:hunter2@k8s:6443"}}, "without a user or password"),
    ({"kubernetes": {"api_url": "https://k8s:6443/?x=1"}}, "without a query"),
    ({"kubernetes": {"daemon_namespace": "../../x?y="}}, "a Kubernetes namespace name"),
    ({"kubernetes": {"job_labels": ["", "x y"]}}, "is not a Kubernetes label key"),
])
def test_check_config_refuses_what_the_coordinator_could_not_use(section: dict[str, Any], said: str) -> None:
    from watchdog.config import ConfigError, parse_config
    with pytest.raises(ConfigError, match=said) as caught:
        parse_config({"coordinator": section})
    assert "hunter2" not in str(caught.value)


def test_ids_a_coordinator_cannot_ask_with_are_a_usage_error(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.conftest import REPO
    prometheus = ["--prometheus", "http://127.0.0.1:9", "--job", "x"]
    for args, said in (([*prometheus, "--slurm-job-id", "42"], "--slurm-instance"),
                       ([*prometheus, "--pod", "ml/w-0"], "--kubernetes-api"),
                       (["--slurm-instance", "{node}:9944", "--job", "x", "--slurm-job-id", "\u0664\u0662"], "digits"),
                       (["--slurm-instance", "{node}:9944", "--slurm-conf", "/nonexistent", "--job", "x"],
                        "coordinator.slurm_conf (--slurm-conf): /nonexistent is not a file"),
                       (["--kubernetes-api", "https://k8s:6443", "--job", "x"], "coordinator.kubernetes.token_file")):
        done = subprocess.run([sys.executable, "-m", "watchdog", "coordinate", *args, "--out", str(tmp_path)],
                              cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, (args, done.stderr)
