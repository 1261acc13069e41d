"""POST /v1/dump on a real endpoint, against real gloo ranks (real py-spy, real Flight Recorder dumps) and
a loopback NCCL RAS service: the answer names the odd rank, shares one capture among concurrent
requests, rate limits, reads Alertmanager payloads, and is never open off loopback without auth."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, gloo_job
from tests.fakes.daemon import daemon_config
from tests.fakes.nccl_ras import FakeRank, json_report
from tests.integration.test_prometheus import free_port
from watchdog.export.metrics import EpisodeView
from watchdog.sample.ranks import RankDiscovery
from watchdog.service import Service, build
from watchdog.vocabulary.model import Severity, Signature


def post(url: str, body: object, headers: dict[str, str] | None = None, timeout: float = 60
         ) -> tuple[int, dict[str, Any], dict[str, str]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}"), dict(exc.headers)


def alertmanager_payload(job: str) -> dict[str, object]:
    """What Alertmanager 0.2x posts to a webhook receiver (version 4)."""
    return {"version": "4", "groupKey": "{}:{training_job=" + json.dumps(job) + "}", "truncatedAlerts": 0,
            "status": "firing",
            "receiver": "stall-watchdog-dump", "groupLabels": {"training_job": job},
            "commonLabels": {"alertname": "StallWatchdogJobCulpritNode", "training_job": job},
            "commonAnnotations": {}, "externalURL": "http://am:9093",
            "alerts": [{"status": "firing", "labels": {"alertname": "StallWatchdogJobCulpritNode",
                                                       "training_job": job, "instance": "node-a:9944"},
                        "annotations": {}, "startsAt": "2026-11-22T10:00:00Z", "endsAt": "0001-01-01T00:00:00Z",
                        "generatorURL": "", "fingerprint": "f00"}]}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("dump")
    report = tmp / "ras-report.json"  # rank 0 stands in for NCCL's RAS service, answering with this file
    with gloo_job("dataloader", tmp, flight_recorder=True,
                  env={"NCCL_RAS_ADDR": f"127.0.0.1:{free_port()}", "RAS_STAND_IN_REPORT": str(report)},
                  rank_env={0: {"RAS_STAND_IN_LISTEN": "1"}}) as processes:
        report.write_text(json_report([FakeRank(r, "node-a", p.pid, r, {"AllReduce": 4 if r != 2 else 3})
                                       for r, p in enumerate(processes)]))
        key = RankDiscovery().describe(processes[0].pid).job_key  # type: ignore[union-attr]
        yield {"tmp": tmp, "processes": processes, "key": key}


def start(tmp: Path, processes: list[Any], export: dict[str, Any] | None = None, stacks: dict[str, Any] | None = None,
          **sections: Any) -> tuple[Any, Service]:
    config = daemon_config(tmp, source={"kind": "sim", "scenario": "spin_hang", "start_offset_seconds": 285,
                                        "pids": {g: [p.pid] for g, p in enumerate(processes)}},
                           stacks={"observe_seconds": 0.2, "nccl_ras_gap_seconds": 0.5,
                                   "flight_recorder_wait_seconds": 30, **(stacks or {})},
                           export={"listen_address": "127.0.0.1:0", **(export or {})},
                           alerts={"node": "node-a"}, **sections)
    service = build(config)
    daemon = service.daemon
    daemon.tick()  # one sample: the GPUs' processes are known
    service.endpoint.start()
    return daemon, service


def test_dump_names_the_odd_rank_with_flight_recorder_and_ras(job: dict[str, Any], tmp_path: Path) -> None:
    daemon, service = start(tmp_path, job["processes"])
    try:
        status, answer, _ = post(service.endpoint.base_url + "/v1/dump", {"training_job": job["key"]})
    finally:
        service.close()
    assert status == 200, answer
    assert answer["node"] == "node-a" and answer["shared"] is False
    (picture,) = answer["jobs"]
    assert picture["training_job"] == job["key"] and picture["outliers"] == ["rank 2"]
    ranks = {r["rank"]: r for r in picture["ranks"]}
    assert ranks[2]["activity"] == "data_loading" and "FakeLoader.__next__" in ranks[2]["where"]
    assert {ranks[r]["activity"] for r in (0, 1, 3)} == {"collective"}
    assert all(r["capture"] == "ok" and r["threads"] for r in ranks.values())
    assert ranks[2]["pid"] == job["processes"][2].pid and ranks[2]["gpus"] == [2]
    assert picture["flight_recorder"]["culprits"] == [2]
    assert picture["nccl_ras"]["stuck"] and picture["nccl_ras"]["culprits"] == [2]
    assert "rank 2 on node-a is 1 AllReduce behind the other 3" in picture["verdict"]["sentence"]
    bundle = Path(answer["bundle_path"])
    assert bundle.is_dir() and (bundle / ".stall-watchdog-bundle").is_file()
    assert json.loads((bundle / "summary.json").read_text())["jobs"][0]["outliers"] == ["rank 2"]
    assert sorted(p.name for p in (bundle / "flight_recorder").iterdir()) == [f"rank-{r}.json" for r in range(4)]
    assert (bundle / "report.html").is_file() and len(list((bundle / "stacks").iterdir())) == 4
    again = subprocess.run([sys.executable, "-m", "watchdog", "analyze", str(bundle), "--json"], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0, again.stderr
    picture = json.loads(again.stdout)
    assert picture["outliers"] == ["rank 2"] and picture["flight_recorder_analysis"]["culprits"] == [2]


def test_the_answer_says_each_ranks_pace_as_the_node_measured_it(job: dict[str, Any], tmp_path: Path) -> None:
    """A rank's wait share (where compared) and a straggler's slowdown (an episode past suspicion) ride on its
    row, for the coordinator to put beside a hang's verdict; a suspected straggler is not said."""
    daemon, service = start(tmp_path, job["processes"], stacks={"nccl_ras": False})
    daemon.published = dataclasses.replace(
        daemon.published, waits=((0, 0.31), (1, 0.3), (2, 0.06)),
        episodes=(EpisodeView(Signature.STRAGGLER, Severity.WARNING, (2,), (), 0.0, 1.2134),
                  EpisodeView(Signature.STRAGGLER, None, (3,), (), 0.0, 1.5)))
    try:
        status, answer, _ = post(service.endpoint.base_url + "/v1/dump", {"training_job": job["key"]})
    finally:
        service.close()
    assert status == 200, answer
    ranks = {r["rank"]: r for r in answer["jobs"][0]["ranks"]}
    assert ranks[2]["wait_ratio"] == 0.06 and ranks[2]["straggler_slowdown"] == 1.213
    assert ranks[0]["wait_ratio"] == 0.31 and "straggler_slowdown" not in ranks[0]
    assert "wait_ratio" not in ranks[3] and "straggler_slowdown" not in ranks[3]


def test_concurrent_requests_share_one_capture_then_cooldown(job: dict[str, Any], tmp_path: Path) -> None:
    daemon, service = start(tmp_path, job["processes"], stacks={"nccl_ras": False, "observe_seconds": 0.5})
    answers: list[tuple[int, dict[str, Any], dict[str, str]]] = []
    try:
        url = service.endpoint.base_url + "/v1/dump"
        threads = [threading.Thread(target=lambda: answers.append(post(url, alertmanager_payload(job["key"]))))
                   for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        later = post(url, {"training_job": job["key"]})
    finally:
        service.close()
    assert [a[0] for a in answers] == [200] * 4
    assert sorted(a[1]["shared"] for a in answers) == [False, True, True, True]
    assert len({a[1]["bundle"] for a in answers}) == 1
    assert later[0] == 200 and later[1]["shared"] is True and later[1]["bundle"] == answers[0][1]["bundle"]
    assert len([p for p in (tmp_path / "incidents").iterdir() if "-dump-" in p.name]) == 1


def test_rate_limit_answers_429_with_retry_after(job: dict[str, Any], tmp_path: Path) -> None:
    daemon, service = start(tmp_path, job["processes"], stacks={"nccl_ras": False, "flight_recorder": False},
                             dump={"max_per_minute": 1, "cooldown_seconds": 0})
    try:
        first = post(service.endpoint.base_url + "/v1/dump", {})
        second = post(service.endpoint.base_url + "/v1/dump", {})
    finally:
        service.close()
    assert first[0] == 200 and first[1]["jobs"][0]["training_job"] == job["key"]  # no job: every job here
    assert second[0] == 429 and int(second[2]["Retry-After"]) > 0 and "max_per_minute" in second[1]["error"]


@pytest.mark.parametrize("body,why", [
    (b"not json", "not JSON"), ([1, 2], "expected a JSON object"), ({"job": "x"}, "unknown field 'job'"),
    ({"training_job": ""}, "training_job: expected"), ({"version": "4", "alerts": []}, "names no training_job"),
    ({"version": "3", "alerts": []}, "only version 4"), ({"slurm_job_id": "12; rm"}, "expected a Slurm job id"),
    ({"slurm_job_id": 12}, "expected a Slurm job id"), ({"slurm_job_id": "1", "training_job": "a"}, "not both")])
def test_bad_payloads_get_400_with_the_reason(job: dict[str, Any], tmp_path: Path, body: object, why: str) -> None:
    daemon, service = start(tmp_path, job["processes"])
    try:
        status, answer, _ = post(service.endpoint.base_url + "/v1/dump", body)
    finally:
        service.close()
    assert status == 400 and why in answer["error"]


def test_a_job_not_on_this_node_is_404(job: dict[str, Any], tmp_path: Path) -> None:
    daemon, service = start(tmp_path, job["processes"])
    try:
        status, answer, _ = post(service.endpoint.base_url + "/v1/dump", {"training_job": "run:elsewhere"})
    finally:
        service.close()
    assert status == 404 and "run:elsewhere" in answer["error"] and job["key"] in answer["error"]


def test_a_dump_done_before_its_callback_is_attached_still_answers(job: dict[str, Any], tmp_path: Path) -> None:
    """A 404 can be done before handle() attaches its completion callback, which then runs at once in the
    request's thread: it must not wait for a lock that thread holds. Made certain here with a pool that
    runs the dump as it is submitted."""
    class Immediate:
        def submit(self, function: Any, *args: Any) -> Future[Any]:
            future: Future[Any] = Future()
            future.set_result(function(*args))
            return future

        def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
            pass

    daemon, service = start(tmp_path, job["processes"])
    daemon.dumps.pool = Immediate()
    try:
        status, answer, _ = post(service.endpoint.base_url + "/v1/dump", {"training_job": "run:elsewhere"}, timeout=10)
        again = post(service.endpoint.base_url + "/v1/dump", {"training_job": "run:elsewhere"}, timeout=10)
    finally:
        service.close()
    assert status == 404 and "run:elsewhere" in answer["error"]
    # The callback ran: a dump that found nothing gave its place in the rate budget back and was not kept.
    assert again[0] == 404 and "shared" not in again[1] and len(daemon.dumps._started) == 0


def test_off_loopback_dumps_need_auth(job: dict[str, Any], tmp_path: Path) -> None:
    daemon, service = start(tmp_path, job["processes"], export={"listen_address": "0.0.0.0:0"})
    try:
        port = service.endpoint.server.server_address[1]
        refused = post(f"http://127.0.0.1:{port}/v1/dump", {})
    finally:
        service.close()
    assert refused[0] == 403 and "dump.token_file" in refused[1]["error"]

    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    daemon, service = start(tmp_path, job["processes"], export={"listen_address": "0.0.0.0:0"},
                             dump={"token_file": str(token)}, stacks={"nccl_ras": False, "flight_recorder": False})
    try:
        url = f"http://127.0.0.1:{service.endpoint.server.server_address[1]}/v1/dump"
        missing = post(url, {})
        wrong = post(url, {}, {"Authorization": "Bearer nope"})
        right = post(url, {}, {"Authorization": "Bearer s3cret-token"})
        metrics = urllib.request.urlopen(url.replace("/v1/dump", "/metrics"), timeout=5).read().decode()
    finally:
        service.close()
    assert (missing[0], wrong[0], right[0]) == (401, 401, 200)
    assert "s3cret" not in json.dumps(right[1])
    assert 'stall_watchdog_dumps_total{result="written"} 1.0' in metrics


def test_a_post_without_a_body_dumps_every_job(job: dict[str, Any], tmp_path: Path) -> None:
    """`curl -X POST URL` sends neither Content-Length nor a body: every training job on the node."""
    import http.client

    daemon, service = start(tmp_path, job["processes"], stacks={"nccl_ras": False, "flight_recorder": False})
    try:
        host, port = service.endpoint.server.server_address[:2]
        connection = http.client.HTTPConnection(str(host), int(port), timeout=60)
        connection.putrequest("POST", "/v1/dump")
        connection.endheaders()
        response = connection.getresponse()
        status, answer = response.status, json.loads(response.read())
        connection.close()
    finally:
        service.close()
    assert status == 200 and [j["training_job"] for j in answer["jobs"]] == [job["key"]]


def test_oversized_body_is_413(job: dict[str, Any], tmp_path: Path) -> None:
    daemon, service = start(tmp_path, job["processes"], dump={"max_body_bytes": 1024})
    try:
        status, answer, _ = post(service.endpoint.base_url + "/v1/dump", b"{" + b" " * 5000 + b"}")
    finally:
        service.close()
    assert status == 413 and "max_body_bytes" in answer["error"]
