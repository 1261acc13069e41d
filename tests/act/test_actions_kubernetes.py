"""The `kubernetes` action's requests, against a local HTTP server that answers as the API server does and
checks each request's method, path, headers and body as the API defines them (there is no cluster here):
a pod delete is a DELETE of the pod with DeleteOptions whose preconditions carry the UID of the pod the ranks
run in (a pod of that name with another UID is not deleted: 409); a taint is a GET of the node, then a JSON merge
patch carrying its resourceVersion (a concurrent change gets 409, not lost) that keeps the other taints."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.daemon import daemon_config
from tests.fakes.loopback import Quiet, Served
from watchdog.act.actions import DONE, FAILED, SKIPPED, Actions, Target
from watchdog.vocabulary.model import Workload

TOKEN = "k8s-token-for-tests"
POD_UID = "0f8a3c2e-1b2d-4e5f-8a9b-0c1d2e3f4a5b"


class ApiServer(Served):
    """Pods and one node, held as the API server holds them."""

    def __init__(self) -> None:
        self.pods = {("training", "llm-worker-0")}
        self.uids = {("training", "llm-worker-0"): POD_UID}
        self.node: dict[str, Any] = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-7",
                                     "resourceVersion": "41"},
                                     "spec": {"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]}}
        self.seen: list[tuple[str, str, dict[str, str], Any]] = []
        self.problems: list[str] = []
        outer = self

        class Handler(Quiet):
            def _body(self) -> Any:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                return json.loads(raw) if raw else None

            def _check(self, method: str) -> Any:
                body = self._body()
                outer.seen.append((method, self.path, dict(self.headers), body))
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    outer.problems.append(f"{method} {self.path} without the token")
                return body

            def do_DELETE(self) -> None:  # noqa: N802
                body = self._check("DELETE")
                parts = self.path.split("/")  # /api/v1/namespaces/NS/pods/NAME
                if parts[:4] != ["", "api", "v1", "namespaces"] or len(parts) != 7 or parts[5] != "pods":
                    outer.problems.append(f"DELETE of {self.path}")
                    return self.answer_json(404, {"kind": "Status", "code": 404})
                if not (body and body.get("kind") == "DeleteOptions" and body.get("apiVersion") == "v1"
                        and isinstance(body.get("gracePeriodSeconds"), int)):
                    outer.problems.append(f"DELETE body {body}")
                    return self.answer_json(400, {"kind": "Status", "code": 400})
                if (parts[4], parts[6]) not in outer.pods:
                    return self.answer_json(404, {"kind": "Status", "code": 404})
                wanted = (body.get("preconditions") or {}).get("uid")
                if wanted is not None and wanted != outer.uids.get((parts[4], parts[6])):
                    return self.answer_json(409, {"kind": "Status", "code": 409, "reason": "Conflict",
                                                  "message": f"Precondition failed: UID in precondition: {wanted}"})
                outer.pods.discard((parts[4], parts[6]))
                return self.answer_json(200, {"kind": "Pod", "metadata": {"name": parts[6], "namespace": parts[4]}})

            def do_GET(self) -> None:  # noqa: N802
                self._check("GET")
                if self.path != "/api/v1/nodes/gpu-node-7":
                    return self.answer_json(404, {"kind": "Status", "code": 404})
                return self.answer_json(200, outer.node)

            def do_PATCH(self) -> None:  # noqa: N802
                body = self._check("PATCH")
                if self.headers.get("Content-Type") != "application/merge-patch+json":
                    outer.problems.append(f"PATCH as {self.headers.get('Content-Type')}")
                    return self.answer_json(415, {"kind": "Status", "code": 415})
                if body["metadata"].get("resourceVersion") != outer.node["metadata"]["resourceVersion"]:
                    return self.answer_json(409, {"kind": "Status", "code": 409, "reason": "Conflict"})
                outer.node["spec"]["taints"] = body["spec"]["taints"]
                outer.node["metadata"]["resourceVersion"] = str(int(outer.node["metadata"]["resourceVersion"]) + 1)
                return self.answer_json(200, outer.node)

        self.handler = Handler


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with ApiServer().running() as server:
        yield server  # type: ignore[misc]


def actions(tmp: Path, api: ApiServer, **kubernetes: Any) -> Actions:
    token = tmp / "token"
    token.write_text(TOKEN + "\n")
    config = daemon_config(tmp, bundles={"capture_stacks": True}, actions={
        "mode": "act", "do": ["kubernetes"],
        "kubernetes": {"api_url": api.url, "token_file": str(token), "ca_file": None, **kubernetes}})
    return Actions(config.actions)


def target(workload: Workload, pod_uid: str | None = POD_UID) -> Target:
    return Target("run:llm", (), workload, {}, None, "gpu-node-7", pod_uid)


def test_the_pod_is_deleted_and_the_node_tainted_as_the_api_defines(tmp_path: Path, api: ApiServer,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_NAME", "gpu-node-7")
    [step] = actions(tmp_path, api, taint=True).run(target(Workload(namespace="training", pod="llm-worker-0")),
                                                    dry=False)
    assert step.result == DONE, step.detail
    assert api.problems == []
    assert api.pods == set()
    delete = next(s for s in api.seen if s[0] == "DELETE")
    assert delete[1] == "/api/v1/namespaces/training/pods/llm-worker-0" and delete[3]["gracePeriodSeconds"] == 30
    assert delete[3]["preconditions"] == {"uid": POD_UID}
    taints = api.node["spec"]["taints"]
    assert {"key": "nvidia.com/gpu", "effect": "NoSchedule"} in taints  # the others' taints are kept
    assert [t["effect"] for t in taints if t["key"] == "stall-watchdog.io/hang"] == ["NoSchedule"]
    assert "deleted pod training/llm-worker-0" in step.detail and "tainted node gpu-node-7" in step.detail


def test_a_taint_that_races_a_change_fails_rather_than_lose_it(tmp_path: Path, api: ApiServer,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_NAME", "gpu-node-7")
    run = actions(tmp_path, api, delete_pods=False, taint=True)
    original = api.node
    api.node = {**original, "metadata": {**original["metadata"]}}

    def stale_get(_: Any) -> None:  # someone patches the node between our GET and our PATCH
        api.node["metadata"]["resourceVersion"] = "42"

    monkeypatch.setattr(run, "_api", _racing(run._api, stale_get))
    [step] = run.run(target(Workload(namespace="training", pod="llm-worker-0")), dry=False)
    assert step.result == FAILED and "HTTP 409" in step.detail
    assert all(t["key"] != "stall-watchdog.io/hang" for t in api.node["spec"]["taints"])


def _racing(call: Any, between: Any) -> Any:
    def wrapped(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        answer = call(method, path, *args, **kwargs)
        if method == "GET":
            between(answer)
        return answer
    return wrapped


def test_a_pod_only_a_rank_claims_is_never_deleted(tmp_path: Path, api: ApiServer) -> None:
    claimed = Workload(namespace="training", pod="llm-worker-0", claimed=("namespace", "pod"))
    [step] = actions(tmp_path, api).run(target(claimed), dry=False)
    assert step.result == SKIPPED and api.seen == [] and api.pods == {("training", "llm-worker-0")}


def test_a_pod_is_deleted_only_while_it_is_the_one_the_ranks_run_in(tmp_path: Path, api: ApiServer) -> None:
    """No pod UID from the ranks' own cgroup (a process outside any pod on a GPU the kubelet gave to a pod):
    nothing is asked. A pod of the same name recreated meanwhile (another UID): the API server refuses."""
    held = Workload(namespace="training", pod="llm-worker-0")
    [step] = actions(tmp_path, api).run(target(held, pod_uid=None), dry=False)
    assert step.result == SKIPPED and "no pod proven" in step.detail and api.seen == []
    api.uids[("training", "llm-worker-0")] = "11111111-2222-3333-4444-555555555555"
    [step] = actions(tmp_path, api).run(target(held), dry=False)
    assert step.result == FAILED and "HTTP 409" in step.detail
    assert api.pods == {("training", "llm-worker-0")}


def test_dry_run_sends_nothing_and_says_what_it_would_do(tmp_path: Path, api: ApiServer) -> None:
    [step] = actions(tmp_path, api).run(target(Workload(namespace="training", pod="llm-worker-0")), dry=True)
    assert step.result == "dry_run" and step.detail == "would delete pod training/llm-worker-0"
    assert api.seen == []


def test_an_unreadable_token_is_a_failed_action_without_a_request(tmp_path: Path, api: ApiServer) -> None:
    run = actions(tmp_path, api)
    (tmp_path / "token").unlink()
    [step] = run.run(target(Workload(namespace="training", pod="llm-worker-0")), dry=False)
    assert step.result == FAILED and "token_file" in step.detail and api.seen == []
