"""Hostile callers and servers of the HTTP services, on loopback: the coordinator without credentials, a
flood of jobs, a node or Prometheus that redirects the node token elsewhere or trickles its answer, a
malformed node answer, and slow or half-open clients that would starve a scrape."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.export.test_server import serve
from tests.fakes.loopback import still_open
from watchdog.boundary import http_client
from watchdog.boundary.http_server import Auth, is_loopback
from watchdog.coordinate import job_bundle
from watchdog.coordinate.job_verdict import merge
from watchdog.coordinate.nodes import NodeAnswer, NodeClient, valid_instance
from watchdog.coordinate.service import MAX_JOBS_PER_REQUEST, Coordinator, CoordinatorError


@contextmanager
def http(handler: type[BaseHTTPRequestHandler], host: str = "127.0.0.1") -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer((host, 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_the_coordinator_does_not_listen_off_loopback_without_credentials(tmp_path: Path) -> None:
    coordinator = Coordinator("http://127.0.0.1:9", tmp_path, NodeClient())
    with pytest.raises(CoordinatorError, match="--token-file"):
        coordinator.serve("0.0.0.0", 0)


def test_the_coordinator_asks_its_callers_for_credentials(tmp_path: Path) -> None:
    coordinator = Coordinator("http://127.0.0.1:9", tmp_path, NodeClient(timeout_seconds=1),
                              auth=Auth(token="callers-token"))
    server = coordinator.serve("127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"

    def call(path: str, token: str | None = None, body: bytes | None = None) -> int:
        request = urllib.request.Request(base + path, data=body, method="POST" if body is not None else "GET")
        if token:
            request.add_header("Authorization", token)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    try:
        assert call("/healthz") == 200
        assert call("/v1/jobs") == 401
        assert call("/v1/alerts", body=b'{"training_job": "x"}') == 401
        assert call("/v1/jobs", "Bearer wrong") == 401
        assert call("/v1/jobs", "bearer callers-token") == 200  # the scheme is case-insensitive
        many = json.dumps({"version": "4", "alerts": [{"labels": {"training_job": f"j{n}"}}
                                                      for n in range(3000)]}).encode()
        started = time.process_time()  # CPU seconds of this process, the service's threads included
        assert call("/v1/alerts", "Bearer callers-token", many) == 400
        assert time.process_time() - started < 5
        assert coordinator._running == set()
    finally:
        server.shutdown()
        server.server_close()


def test_investigations_are_rate_limited_and_state_stays_bounded(tmp_path: Path) -> None:
    coordinator = Coordinator("http://127.0.0.1:9", tmp_path, NodeClient(timeout_seconds=1), cooldown_seconds=0,
                              max_per_minute=3)
    started = [coordinator.accept(json.dumps({"training_job": f"j{n}"}).encode()) for n in range(5)]
    assert [s for s, _ in started] == [202, 202, 202, 429, 429]
    assert len(json.dumps({"version": "4", "alerts": []})) and MAX_JOBS_PER_REQUEST == 16


def test_the_node_token_is_not_sent_through_a_redirect(tmp_path: Path) -> None:
    seen: list[str | None] = []

    class Elsewhere(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            seen.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            return None

    with http(Elsewhere, "127.0.0.2") as other:
        class Redirect(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.send_response(307)
                self.send_header("Location", f"http://127.0.0.2:{other.server_address[1]}/v1/dump")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                return None

        with http(Redirect) as node:
            answer = NodeClient(token="node-token", timeout_seconds=5).ask(f"127.0.0.1:{node.server_address[1]}",
                                                                          "run:x")
    assert seen == [] and answer.status == 307 and "redirect" in (answer.error or "")


def test_a_node_that_trickles_its_answer_is_cut_at_the_deadline() -> None:
    class Trickle(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(1000):  # a byte every 10 ms: 10 s in all, each read quick, the whole over the deadline
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.01)

        def log_message(self, *args: object) -> None:
            return None

    with http(Trickle) as node:
        answer = NodeClient(timeout_seconds=2).ask(f"127.0.0.1:{node.server_address[1]}", "run:x")
        # A deadline per read would have read the whole answer (200); the one deadline for it cut it short.
        assert answer.status is None and "within 2 s" in (answer.error or ""), answer


def test_an_answer_over_its_budget_is_not_kept() -> None:
    class Huge(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            # the request read first: a socket closed with unread data resets the client before the cap is met
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"[" * (3 << 20))

        def log_message(self, *args: object) -> None:
            return None

    with http(Huge) as node:
        answer = NodeClient(timeout_seconds=5).ask(f"127.0.0.1:{node.server_address[1]}", "run:x", 1 << 20)
    assert answer.status is None and "over" in (answer.error or "")


def test_an_answer_of_empty_lists_is_refused_before_it_is_built() -> None:
    """16 MiB of `[],` (within a node's byte cap) would make the parser build 5.6 million lists, some 350 MiB
    in the coordinator: the answer costs that node, refused with what it would build, before it is built."""
    class Lists(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            body = b'{"jobs": [' + b"[]," * (5 << 20) + b"[]]}"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return None

    with http(Lists) as node:
        answer = NodeClient(timeout_seconds=20).ask(f"127.0.0.1:{node.server_address[1]}", "run:x")
    assert answer.status == 200 and not answer.answered and "would build" in (answer.error or ""), answer.error
    assert answer.body == {}


def test_one_malformed_node_answer_does_not_sink_the_job_verdict() -> None:
    deep: object = []
    for _ in range(100_000):
        deep = [deep]
    hostile = [{"jobs": [{"training_job": "run:x", "ranks": [{"rank": float("inf"), "threads": [1, 2]},
                                                             {"rank": 1, "threads": [{"frames": "abc"}]}],
                          "flight_recorder_traces": [{"rank": float("inf")}, {"rank": 1, "groups": [1]}],
                          "nccl_ras": {"summary": ["list"]}}]},
               {"jobs": [{"training_job": "run:x", "ranks": [{"rank": 2, "threads": [{"frames": [
                   {"name": ["x"], "filename": {"a": 1}, "line": "NaN"}], "thread_name": ["y"]}]}]}]},
               {"jobs": [{"training_job": "run:x", "profiling_name": ["x"], "ranks": deep}]}]
    answers = [NodeAnswer(f"10.0.0.{n}:9944", 200, body) for n, body in enumerate(hostile)]
    result = merge("run:x", answers)
    json.dumps(result.to_json(), default=str)


def test_node_files_of_alike_instances_do_not_collide() -> None:
    assert job_bundle.node_file_name("h:1") != job_bundle.node_file_name("h_1")


def test_instance_labels_must_be_host_and_port() -> None:
    assert valid_instance("node-1.cluster:9944") and valid_instance("10.0.0.1:9944") and valid_instance("[::1]:9944")
    for bad in ("evil.com/x?:9944", "user@host:9944", "host:99999", "host", "http://h:1", "h:1/../../x", "h :1"):
        assert not valid_instance(bad), bad


def test_loopback_is_an_address_not_a_prefix() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.8.9.1")
    assert not is_loopback("127.foo") and not is_loopback("127.0.0.1.nip.io") and not is_loopback("0.0.0.0")


def test_the_client_refuses_what_is_not_an_http_url() -> None:
    for bad in ("ftp://h/x", "http://", "h:1", "http://h:x/"):
        with pytest.raises(ValueError):
            http_client.split(bad)


def scrape(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as response:
        return int(response.status)


def test_slow_and_half_open_clients_do_not_starve_a_scrape(tmp_path: Path) -> None:
    daemon, endpoint = serve(tmp_path)
    daemon.tick()
    port = endpoint.server.server_address[1]
    held: list[socket.socket] = []
    try:
        for _ in range(300):  # half-open: a head that never ends
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            held.append(s)
        for _ in range(64):  # slow POST bodies: a complete head, then a byte now and then
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/dump HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            held.append(s)
        time.sleep(0.5)
        holding = [s for s in held if still_open(s)]  # those the server took in (the rest it turned away at once)
        assert scrape(endpoint.url) == 200
        assert scrape(endpoint.url.replace("/metrics", "/healthz")) == 200
        # ... while the slow clients it took in still hold their connections (the scrapes did not wait for their
        # deadlines to free a worker)
        assert holding and all(still_open(s) for s in holding), len(holding)
    finally:
        for s in held:
            s.close()
        endpoint.stop()


def test_dumps_on_loopback_need_credentials_unless_opened(tmp_path: Path) -> None:
    """Any local user reaches loopback: by default a dump needs the token there too."""
    from tests.fakes.daemon import daemon_config
    from watchdog.service import build

    for opened, expected in ((False, 403), (True, 404)):
        config = daemon_config(tmp_path, dump={"open_on_loopback": opened})
        service = build(config)
        endpoint = service.endpoint
        endpoint.start()
        request = urllib.request.Request(endpoint.base_url + "/v1/dump", data=b'{"training_job": "none"}',
                                         method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                status = int(response.status)
        except urllib.error.HTTPError as exc:
            status = int(exc.code)
        finally:
            service.close()
        assert status == expected, (opened, status)


@pytest.mark.parametrize("length", ["+2", "0_2", "2, 2", " ٢"])
def test_odd_content_lengths_are_refused(tmp_path: Path, length: str) -> None:
    _, endpoint = serve(tmp_path)
    port = endpoint.server.server_address[1]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(f"POST /v1/dump HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n{{}}".encode())
            answer = s.recv(200)
    finally:
        endpoint.stop()
    assert answer.split(b" ")[1] in (b"400", b"404"), answer


def test_two_content_lengths_are_refused(tmp_path: Path) -> None:
    _, endpoint = serve(tmp_path, listen_address="127.0.0.1:0")
    port = endpoint.server.server_address[1]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"POST /v1/dump HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 0\r\n\r\n{}")
            answer = s.recv(200)
    finally:
        endpoint.stop()
    assert answer.split(b" ")[1] in (b"400", b"404"), answer


def test_a_deeply_nested_node_answer_cannot_blow_up_the_job_bundle(tmp_path: Path) -> None:
    """Indented, this answer would be hundreds of times its size on disk: it is written compact, and an
    answer past the bundle's budget is left out with a note."""
    nested = json.loads('{"node": "n1", "jobs": ' + "[" * 900 + "0," * 100_000 + "0" + "]" * 900 + "}")
    huge = {"node": "n2", "jobs": [], "pad": "x" * (job_bundle.MAX_BUNDLE_BYTES + 10)}
    result = merge("run:x", [NodeAnswer("10.0.0.1:9944", 200, nested), NodeAnswer("10.0.0.2:9944", 200, huge)])
    bundle = job_bundle.write(tmp_path, result)
    total = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    assert total < 2 * 2**20, total
    left_out = json.loads((bundle / "nodes" / job_bundle.node_file_name("10.0.0.2:9944")).read_text())
    assert "omitted" in left_out


def test_concurrent_job_bundles_are_all_written(tmp_path: Path) -> None:
    failures: list[str] = []

    def write_many() -> None:
        for _ in range(40):
            try:
                job_bundle.write(tmp_path, merge("run:x", []), keep=20)
            except OSError as exc:
                failures.append(type(exc).__name__)

    threads = [threading.Thread(target=write_many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_a_request_body_of_empty_lists_is_refused_before_it_is_built() -> None:
    """The coordinator's and the dump endpoint's body cap is 4 MiB; 4 MiB of `[],` would make json.loads build
    1.4 million lists (about 100 MiB). The body is refused with what it would build, before building it."""
    import tracemalloc

    from watchdog.boundary.webhook import PayloadError, job_requests

    body = b'{"alerts": [' + b"[]," * (4 * 2**20 // 3 - 10) + b"[]]}"
    tracemalloc.start()
    try:
        with pytest.raises(PayloadError, match="would build"):
            job_requests(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, peak
