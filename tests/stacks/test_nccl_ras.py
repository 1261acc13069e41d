"""NCCL RAS: the wire protocol against a loopback service, both report formats, NCCL 2.28.9's invalid
JSON, and the rule that a rank behind is stuck only when two queries agree."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from tests.fakes.nccl_ras import FakeRasService, job, json_report, text_report
from watchdog.stacks import ras_report
from watchdog.stacks.nccl_ras import address, ask_twice, query
from watchdog.stacks.ras_report import RasError, judge, parse


def test_json_report_names_the_rank_behind_with_host_pid_and_gpu() -> None:
    status = parse(json_report(job(behind={13: 1})))
    finding = judge(status, status)
    assert finding.stuck and finding.culprits == (13,)
    (lag,) = finding.behind
    assert (lag.rank.rank, lag.rank.host, lag.rank.pid, lag.rank.gpu) == (13, "10.0.0.2", 4013, 5)
    assert lag.sentence() == "rank 13 on 10.0.0.2 is 1 AllReduce behind the other 63 (pid 4013, GPU 5)"


def test_nccl_2_28_9_missing_rank_json_is_invalid_and_still_read() -> None:
    report = json_report(job(world=16, missing=(3,), dead=(9,)), version="2.28.9")
    with pytest.raises(json.JSONDecodeError):
        json.loads(report)  # what NCCL 2.28.9 writes really is invalid
    finding = judge(parse(report), None)
    assert [r.rank for r in finding.missing] == [3] and [r.rank for r in finding.dead] == [9]
    assert finding.culprits == (3, 9) and not finding.stuck  # one query: nothing is called stuck
    assert "rank 9 on 10.0.0.2 is dead" in finding.summary


def test_text_report_names_outliers_with_the_majority_count() -> None:
    text = text_report(job(behind={13: 1, 21: 1}))
    status = parse(text)
    assert status.format == "text"
    finding = judge(status, status)
    assert [b.rank.rank for b in finding.behind] == [13, 21]
    assert {b.others for b in finding.behind} == {62} and {b.by for b in finding.behind} == {1}
    assert finding.behind[0].rank.pid == 4013 and finding.behind[0].rank.host == "10.0.0.2"


def test_text_report_dead_process_and_missing_rank() -> None:
    finding = judge(parse(text_report(job(world=8, dead=(5,)))), None)
    assert any(r.pid == 4005 and r.dead for r in finding.dead)
    assert 5 in finding.culprits


def test_a_job_still_moving_between_queries_is_not_stuck() -> None:
    launches = iter(range(100, 200, 7))

    def moving() -> list:
        base = next(launches)
        return job(world=8, behind={2: 1}, base=base)

    with FakeRasService(moving).running() as service:
        finding = ask_twice("127.0.0.1", service.port, gap_seconds=0.1, binary="")
    assert finding.queries == 2 and service.queries == 2
    assert finding.behind and not finding.stuck
    assert "not stuck" in finding.summary


def test_a_frozen_job_is_stuck_over_the_socket_protocol_in_json() -> None:
    frozen = job(world=32, behind={13: 2})
    with FakeRasService(lambda: frozen).running() as service:
        text = query("127.0.0.1", service.port, 2.0, binary="")
        finding = ask_twice("127.0.0.1", service.port, gap_seconds=0.1, binary="")
    assert text.lstrip().startswith("{")
    assert finding.stuck and finding.culprits == (13,)
    assert finding.summary == ("NCCL RAS: rank 13 on 10.0.0.2 is 2 AllReduce behind the other 31 (pid 4013, GPU 5)")


def test_a_service_before_2_28_7_answers_in_text() -> None:
    frozen = job(world=16, behind={4: 1})
    with FakeRasService(lambda: frozen, version="2.26.2", json_supported=False).running() as service:
        status = parse(query("127.0.0.1", service.port, 2.0, binary=""))
    assert status.format == "text" and [b.rank.rank for b in ras_report.behind(status)] == [4]


def test_nothing_listening_is_a_finding_with_its_problem() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening
    finding = ask_twice("127.0.0.1", port, gap_seconds=0, timeout_seconds=1, binary="")
    assert finding.queries == 0 and "nothing answers" in (finding.problem or "")
    with pytest.raises(RasError):
        query("127.0.0.1", port, 1, binary="")


def test_the_official_client_is_used_where_installed(tmp_path: Path) -> None:
    """`ncclras` on PATH is run with -h/-p/-t/-v/-f json; this one forwards to the loopback service."""
    client = tmp_path / "ncclras"
    client.write_text(f"""#!{sys.executable}
import socket, sys
args = sys.argv[1:]
opts = dict(zip(args[::2], args[1::2]))
assert "-v" in args and opts["-t"].isdigit(), args
s = socket.create_connection((opts["-h"], int(opts["-p"])))
f = s.makefile("rwb")
for line in ("CLIENT PROTOCOL 2", "TIMEOUT " + opts["-t"], "SET FORMAT " + opts.get("-f", "text")):
    f.write((line + "\\n").encode()); f.flush(); f.readline()
f.write(b"VERBOSE STATUS\\n"); f.flush()
sys.stdout.write(f.read().decode())
""")
    client.chmod(client.stat().st_mode | stat.S_IXUSR)
    frozen = job(world=8, behind={6: 3})
    with FakeRasService(lambda: frozen).running() as service:
        finding = ask_twice("127.0.0.1", service.port, gap_seconds=0.1, binary=str(client))
    assert finding.stuck and finding.culprits == (6,) and service.queries == 2


def test_address_follows_nccl_ras_addr_and_enable() -> None:
    assert address({}) == ("localhost", 28028)
    assert address({"NCCL_RAS_ADDR": "127.0.0.2:29000"}) == ("127.0.0.2", 29000)
    assert address({"NCCL_RAS_ADDR": "[::1]:29001"}) == ("::1", 29001)
    assert address({"NCCL_RAS_ENABLE": "0"}) is None


def test_a_rank_cannot_point_the_daemon_at_another_host() -> None:
    """NCCL_RAS_ADDR comes from a rank: an address that is not this node's, a name, a port out of range
    fall back to the default rather than make root connect there (a port-scan oracle)."""
    for given in ("10.255.1.2:29000", "example.com:28028", "127.0.0.1:65536", "127.0.0.1:0", "127.0.0.1:²",
                  "127.0.0.1:99999999999999999999", "[::1]:-1"):
        assert address({"NCCL_RAS_ADDR": given}) == ("localhost", 28028), given


@pytest.mark.parametrize("garbage", ["", "hello\n", "{\"communicators\": 3}", "{not json"])
def test_garbage_is_a_clear_error(garbage: str) -> None:
    with pytest.raises(RasError):
        parse(garbage)


def test_env_is_not_consulted_for_the_binary_when_given_empty(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """binary='' means: speak the protocol here even if an ncclras is on PATH."""
    fake = tmp_path / "ncclras"
    fake.write_text("#!/bin/sh\nexit 7\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    frozen = job(world=4, behind={1: 1})
    with FakeRasService(lambda: frozen).running() as service:
        assert parse(query("127.0.0.1", service.port, 1.0, binary="")).communicators
        with pytest.raises(RasError, match="exited 7"):
            query("127.0.0.1", service.port, 1.0)
