"""The coordinator's edges: a node that does not answer, Prometheus down, bad payloads, repeats, and
`analyze` on ncclras reports and garbage."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO
from tests.fakes.nccl_ras import job, json_report, text_report
from watchdog.coordinate.job_verdict import merge
from watchdog.coordinate.nodes import NodeAnswer, NodeClient, promql_string
from watchdog.coordinate.service import Coordinator


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "watchdog", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_promql_strings_are_escaped() -> None:
    assert promql_string('master:"a"\\b') == '"master:\\"a\\"\\\\b"'


def test_a_node_that_does_not_answer_is_named_and_the_verdict_stays_open() -> None:
    port = closed_port()
    answers = NodeClient(timeout_seconds=2).ask_all([f"127.0.0.1:{port}"], "run:x")
    (silent,) = answers
    assert silent.status is None and "Connection refused" in (silent.error or "")
    result = merge("run:x", answers + [NodeAnswer("10.0.0.2:9944", 404, {"error": "no local rank"}, "no local rank")])
    assert result.to_json()["nodes_silent"] == [f"127.0.0.1:{port}", "10.0.0.2:9944"]
    assert "2 nodes did not answer" in result.verdict.sentence and result.odd == []


def test_prometheus_down_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    done = cli("coordinate", "--prometheus", f"http://127.0.0.1:{closed_port()}", "--job", "run:x", "--json",
               "--out", str(tmp_path / "jobs"))
    assert done.returncode == 1 and "Traceback" not in done.stderr and "Connection refused" in done.stderr
    answer = json.loads(done.stdout)
    assert "Connection refused" in answer["problem"] and answer["nodes"] == []
    assert answer["verdict"]["kind"] == "unknown" and "no evidence" in answer["verdict"]["sentence"]  # not no_stall
    assert Path(answer["bundle"]).is_dir()


def test_bad_payloads_and_repeats(tmp_path: Path) -> None:
    coordinator = Coordinator(f"http://127.0.0.1:{closed_port()}", tmp_path, NodeClient(timeout_seconds=1),
                              cooldown_seconds=600)
    assert coordinator.accept(b"{}")[0] == 400
    assert coordinator.accept(b"[")[0] == 400
    status, refused = coordinator.accept(b'{"slurm_job_id": "42"}')  # a node's /v1/dump reads it; not the coordinator
    assert status == 400 and "unknown field 'slurm_job_id'" in refused["error"]
    status, first = coordinator.accept(b'{"training_job": "run:x"}')
    assert status == 202 and first == {"accepted": ["run:x"], "skipped": []}
    assert coordinator.accept(b'{"training_job": "run:x"}')[1] == {"accepted": [], "skipped": ["run:x"]}
    coordinator.pool.shutdown(wait=True)
    assert "run:x" in coordinator.latest


def test_analyze_reads_ncclras_reports(tmp_path: Path) -> None:
    frozen = job(world=16, behind={13: 1})
    one, two, text = tmp_path / "ras-1.json", tmp_path / "ras-2.json", tmp_path / "ras.txt"
    one.write_text(json_report(frozen))
    two.write_text(json_report(frozen, version="2.28.9"))
    text.write_text(text_report(frozen))
    single = cli("analyze", str(one), "--json")
    assert single.returncode == 0, single.stderr
    picture = json.loads(single.stdout)
    assert picture["outliers"] == ["rank 13"] and picture["verdict"]["kind"] == "waiting"
    pair = json.loads(cli("analyze", str(one), str(two), "--json").stdout)
    assert pair["verdict"]["kind"] == "hang" and pair["nccl_ras"]["stuck"]
    assert "rank 13 on 10.0.0.2 is 1 AllReduce behind the other 15" in pair["summary"]
    readable = cli("analyze", str(text), str(text))
    assert readable.returncode == 0 and "rank 13" in readable.stdout


def test_analyze_garbage_is_a_clear_error(tmp_path: Path) -> None:
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x80\x04junk")
    done = cli("analyze", str(junk))
    assert done.returncode == 1 and "Traceback" not in done.stderr and str(junk) in done.stderr
    missing = cli("analyze", str(tmp_path / "nope"))
    assert missing.returncode == 1 and "no such file" in missing.stderr


def test_job_bundles_rotate_only_their_own(tmp_path: Path) -> None:
    from watchdog.coordinate import job_bundle

    foreign = tmp_path / "20200101T000000Z-job-not-ours"
    foreign.mkdir()
    written = [job_bundle.write(tmp_path, merge(f"run:{n}", []), keep=2) for n in range(4)]
    kept = sorted(p for p in tmp_path.iterdir() if p != foreign)
    assert kept == sorted(written[-2:]) and foreign.is_dir()
