"""The coordinator's fan-out on real sockets: thousands of nodes asked at once (none waits for a round), and
answers that all arrive at once are not all held at once."""

from __future__ import annotations

import contextlib
import json
import resource
import selectors
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import need_tool
from tests.export.test_server import serve
from watchdog.boundary import http_client
from watchdog.coordinate import nodes


class Gathering:
    """One loopback port that answers no request until `expected` requests have all arrived whole, then answers
    each at once (`answer`, or {"node": "node-<n>"} to the n-th to arrive): a client that asked in rounds would
    wait for its first round forever."""

    def __init__(self, expected: int, answer: bytes | None = None, pause_after: int | None = None,
                 pause_seconds: float = 0.0):
        self.expected, self.body = expected, answer
        self.pause_after, self.pause_seconds = pause_after, pause_seconds  # each answer's first bytes, then a pause
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=4096)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.arrived = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="gathering", daemon=True)

    def _serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.listener, selectors.EVENT_READ, None)
        heard: dict[socket.socket, bytearray] = {}
        whole: list[socket.socket] = []
        while not self.stop.is_set() and len(whole) < self.expected:
            for key, _ in selector.select(0.1):
                if key.data is None:
                    with_peer = self.listener.accept()[0]
                    with_peer.setblocking(False)
                    heard[with_peer] = bytearray()
                    selector.register(with_peer, selectors.EVENT_READ, True)
                    continue
                peer = key.fileobj
                assert isinstance(peer, socket.socket)
                chunk = peer.recv(65536)
                heard[peer] += chunk
                head, _, body = bytes(heard[peer]).partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                if (_ and len(body) >= length) or not chunk:
                    selector.unregister(peer)
                    whole.append(peer)
        self.arrived = len(whole)
        answers = [self.body if self.body is not None else json.dumps({"node": f"node-{n}"}).encode()
                   for n in range(len(whole))]
        replies = [b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                   b"Connection: close\r\n\r\n%s" % (len(body), body) for body in answers]
        cut = self.pause_after if self.pause_after is not None else None
        senders = [threading.Thread(target=self._send, args=(peer, reply[:cut] if cut else reply),
                                    name="gathering-send", daemon=True)
                   for peer, reply in zip(whole, replies)]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(60)
        if cut:
            self.stop.wait(self.pause_seconds)
            senders = [threading.Thread(target=self._send, args=(peer, reply[cut:]), name="gathering-send", daemon=True)
                       for peer, reply in zip(whole, replies)]
            for sender in senders:
                sender.start()
            for sender in senders:
                sender.join(60)
        for peer in whole:
            peer.close()
        selector.close()

    @staticmethod
    def _send(peer: socket.socket, data: bytes) -> None:
        peer.setblocking(True)
        with contextlib.suppress(OSError):
            peer.sendall(data)

    @contextmanager
    def running(self) -> Iterator[Gathering]:
        self.thread.start()
        try:
            yield self
        finally:
            self.stop.set()
            self.thread.join(30)
            self.listener.close()


def test_a_job_of_more_nodes_than_the_old_rounds_is_asked_all_at_once() -> None:
    """1,100 nodes (rounds of 1,024 were the rule before): every one is asked before any answers, and every
    answer is read, on the caller's thread alone."""
    nodes.raise_fd_limit()
    wide = 1100
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= 2 * wide + 200, "the test needs file descriptors"
    before = set(threading.enumerate())
    others: set[str] = set()

    def read(answer: nodes.NodeAnswer) -> nodes.NodeAnswer:
        others.update(t.name for t in set(threading.enumerate()) - before if not t.name.startswith("gathering"))
        return answer

    with Gathering(wide).running() as node:
        instance = f"127.0.0.1:{node.port}"
        asked = nodes.NodeClient(timeout_seconds=30).ask_all([instance] * wide, "run:big", read)
    assert node.arrived == wide
    assert [a.status for a in asked] == [200] * wide, {a.error for a in asked}
    assert sorted(a.body["node"] for a in asked) == sorted(f"node-{n}" for n in range(wide))
    assert others == set()  # no thread of the client's own, let alone one a node


def test_answers_arriving_at_once_are_held_within_the_budget() -> None:
    """48 answers of 1 MiB whose heads and first bytes all come at once, the rest 2 s later, with 1.5 MiB allowed
    held: once two are begun (each counted at its full length) the others wait in their sockets, unread, until
    what is held is handed over; every answer arrives whole."""
    size, count, budget = 2**20, 48, 3 * 2**19
    payload = json.dumps({"filler": "x" * (size - 20)}).encode()
    got: dict[int, int] = {}
    with Gathering(count, payload, pause_after=1024, pause_seconds=2.0).running() as node:
        calls = [http_client.Call("POST", http_client.split(f"http://127.0.0.1:{node.port}/v1/dump"), b"{}")
                 for _ in range(count)]

        def answered(index: int, result: http_client.Response | http_client.HttpError) -> None:
            assert isinstance(result, http_client.Response), result
            got[index] = len(result.body)

        fanned = http_client.request_each(calls, answered, timeout=60, max_bytes=2 * size, held_bytes=budget)
    assert got == {n: len(payload) for n in range(count)}
    assert fanned.parked > 0
    assert fanned.peak_held <= budget + len(payload) + 1024, fanned  # one answer begun just under the budget


def test_a_node_asked_over_tls_is_read_only_under_the_ca_given(tmp_path: Path) -> None:
    """The daemon's own TLS endpoint, asked many times at once with its CA: every answer read; with a CA that
    did not sign its certificate, none is, and the failure says why."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    other = tmp_path / "other.pem"
    for out, keyfile in ((cert, key), (other, tmp_path / "other.key")):
        subprocess.run([need_tool("openssl"), "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                        str(keyfile), "-out", str(out), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext",
                        "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    daemon, endpoint = serve(tmp_path, tls_cert_file=str(cert), tls_key_file=str(key))
    daemon.tick()
    try:
        calls = [http_client.Call("GET", http_client.split(endpoint.url)) for _ in range(20)]
        trusted: list[http_client.Response | http_client.HttpError] = []
        http_client.request_each(calls, lambda _, r: trusted.append(r), timeout=30, ca_file=str(cert))
        untrusted: list[http_client.Response | http_client.HttpError] = []
        http_client.request_each(calls, lambda _, r: untrusted.append(r), timeout=30, ca_file=str(other))
    finally:
        endpoint.stop()
    assert all(isinstance(r, http_client.Response) and r.status == 200 and b"stall_watchdog_build_info" in r.body
               for r in trusted), trusted[:2]
    assert len(untrusted) == 20 and all(isinstance(r, http_client.HttpError) and "CERTIFICATE_VERIFY_FAILED"
                                        in r.reason for r in untrusted), untrusted[:2]


def test_a_chunked_answer_is_whole_at_its_last_chunk_though_the_server_keeps_the_connection() -> None:
    """A server that ignores `Connection: close` after a chunked answer: the answer is read at its last chunk,
    not cut at the deadline; one that keeps it open after half an answer is cut there, and says so."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    held: list[socket.socket] = []

    def serve() -> None:
        for reply in (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nhello \r\n5\r\nworld\r\n0\r\n\r\n",
                      b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nhello \r\n"):
            peer = listener.accept()[0]
            peer.recv(65536)
            peer.sendall(reply)
            held.append(peer)  # and never closed until the test ends

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        whole = http_client.request("GET", f"http://127.0.0.1:{port}/", timeout=20)
        with pytest.raises(http_client.HttpError) as cut:
            http_client.request("GET", f"http://127.0.0.1:{port}/", timeout=1)
    finally:
        server.join(10)
        for peer in held:
            peer.close()
        listener.close()
    assert whole.status == 200 and whole.body == b"hello world"
    assert cut.value.timed_out and "no answer within 1 s" in str(cut.value)


def _one_answer(reply: Callable[[socket.socket], None]) -> int:
    """A loopback port whose one connection reads the request and then runs `reply` on the socket."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with listener:
            peer = listener.accept()[0]
            with peer, contextlib.suppress(OSError):
                peer.recv(65536)
                reply(peer)
                time.sleep(5)

    threading.Thread(target=serve, daemon=True).start()
    return int(listener.getsockname()[1])


@pytest.mark.parametrize(("answer", "expected"), [
    (b"HTTP/1.1 200 OK\r\n" + b"X: a\r\n" * 101 + b"Content-Length: 2\r\n\r\n{}", "got more than 100 headers"),
    (b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000 + b"\r\nContent-Length: 2\r\n\r\n{}", "when reading header line"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", "not hexadecimal"),
    (b"HTTP/1.1 100 Continue\r\n\r\n" * 17 + b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", "interim"),
])
def test_a_head_or_body_the_client_refuses_costs_that_exchange_alone(answer: bytes, expected: str) -> None:
    """One node's answer that cannot be read is its own failure, said in our words: the other nodes of the
    same call are answered."""
    bad = _one_answer(lambda peer: peer.sendall(answer))
    good = _one_answer(lambda peer: peer.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\n{\"node\":\"good\"}"))
    asked = nodes.NodeClient(timeout_seconds=20).ask_all([f"127.0.0.1:{good}", f"127.0.0.1:{bad}"], "run:x")
    assert asked[0].status == 200 and asked[0].body == {"node": "good"}, asked[0]
    assert asked[1].status is None and expected in (asked[1].error or ""), asked[1]


@pytest.mark.parametrize(("answer", "status", "body"), [
    (b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", 200, b"{}"),
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", 200, b"{}"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-Trailer: 1\r\n\r\n", 200, b"{}"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabc", None, b""),  # cut short, then closed
])
def test_interim_answers_trailers_and_short_bodies(answer: bytes, status: int | None, body: bytes) -> None:
    """Interim (1xx) answers are skipped to the final one, a chunked answer with trailers is whole at its end
    though the server keeps the connection, and a body shorter than its Content-Length is no answer."""
    def reply(peer: socket.socket) -> None:
        peer.sendall(answer)
        if status is None:
            peer.shutdown(socket.SHUT_RDWR)

    port = _one_answer(reply)
    if status is None:
        with pytest.raises(http_client.HttpError, match="IncompleteRead"):
            http_client.request("GET", f"http://127.0.0.1:{port}/", timeout=20)
        return
    answered = http_client.request("GET", f"http://127.0.0.1:{port}/", timeout=20)
    assert (answered.status, answered.body) == (status, body)


def test_a_node_streaming_chunk_ends_does_not_hold_the_others() -> None:
    """A node whose chunked body keeps seeming to end (`0\\r\\n\\r\\n` inside its chunks), sent as fast as the
    socket takes it, up to the 16 MiB a node may send: each byte is walked once and the loop turns to the
    other sockets, so the node that answered is read and this one is cut at its cap."""
    unit = b"b\r\naaaaaa0\r\n\r\n\r\n"

    def flood(peer: socket.socket) -> None:
        peer.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:
            peer.sendall(unit * 4096)

    bad = _one_answer(flood)
    good = _one_answer(lambda peer: peer.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\n{\"node\":\"good\"}"))
    asked = nodes.NodeClient(timeout_seconds=20).ask_all([f"127.0.0.1:{good}", f"127.0.0.1:{bad}"], "run:x",
                                                        max_bytes=16 << 20)
    assert asked[0].body == {"node": "good"}, asked[0]
    assert "over 16777216 bytes" in (asked[1].error or ""), asked[1]
