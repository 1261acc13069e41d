"""The coordinator's edges: a node that does not answer, Prometheus down, bad payloads, repeats, and
`analyze` on ncclras reports and garbage."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import threading
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.fakes.loopback import Quiet, serving
from tests.fakes.nccl_ras import job, json_report, text_report
from watchdog.coordinate import job_bundle
from watchdog.coordinate.job_verdict import JobEvidence, merge
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
    status, refused = coordinator.accept(b'{"slurm_job_id": "42"}')  # a node's /v1/dump reads it; the coordinator
    assert status == 400 and "name the training job" in refused["error"]  # wants the job, with it where known
    status, first = coordinator.accept(b'{"training_job": "run:x"}')
    assert status == 202 and first == {"accepted": ["run:x"], "skipped": []}
    assert coordinator.accept(b'{"training_job": "run:x"}')[1] == {"accepted": [], "skipped": ["run:x"]}
    coordinator.pool.shutdown(wait=True)
    assert "run:x" in coordinator.latest


def test_a_stop_drops_the_investigations_queued_and_waits_only_for_those_under_way(tmp_path: Path) -> None:
    """A coordinator told to stop with a dozen investigations behind a Prometheus that never answers: the ones
    queued are dropped at once (they ran after the stop, 4 at a time, 10 s each: 30 s to exit), the 4 under way
    finish within their own timeout."""
    with socket.socket() as blackhole:  # accepts, never answers
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(64)
        coordinator = Coordinator(f"http://127.0.0.1:{blackhole.getsockname()[1]}", tmp_path,
                                  NodeClient(timeout_seconds=1), max_per_minute=100)
        for n in range(12):
            assert coordinator.accept(json.dumps({"training_job": f"run:{n}"}).encode())[0] == 202
        running, dropped = coordinator.stop()
        assert running + dropped == 12 and dropped >= 8
        coordinator.pool.shutdown(wait=True)
    assert len(coordinator.latest) == running  # only those under way at the stop were judged


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


class TogetherNode(Quiet):
    """A node's daemon whose dump answers only once every node of the job has been asked (a real one watches its
    ranks for seconds, so nodes asked in rounds wait on each other's dumps): asked in rounds of 64, the first 64
    would never see the other 6 arrive, and answer that they waited alone."""

    expected = 70
    arrived = 0
    lock = threading.Lock()
    everyone = threading.Event()

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with TogetherNode.lock:
            TogetherNode.arrived += 1
            if TogetherNode.arrived >= TogetherNode.expected:
                TogetherNode.everyone.set()
        if not TogetherNode.everyone.wait(8.0):  # under the client's 10 s: the answer says it waited alone
            self.answer_json(200, {"node": "alone", "jobs": [], "asked_alone": True})
            return
        if self.server.server_address[1] % 2:  # type: ignore[index]
            self.answer_json(200, {"node": f"n{self.server.server_address[1]}", "jobs": []})
            return
        data = b'{"node": "n", "jobs": [], "seconds": NaN}'  # not JSON: the bundle keeps answers as they came
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_every_node_is_asked_at_once() -> None:
    """70 nodes are asked together, not in rounds: each node answers only once all 70 requests are in flight."""
    with ExitStack() as stack:
        instances = [stack.enter_context(serving(TogetherNode)).removeprefix("http://") for _ in range(70)]
        answers = NodeClient(timeout_seconds=10).ask_all(instances, "run:x")
    assert [a.instance for a in answers] == instances
    assert TogetherNode.everyone.is_set() and TogetherNode.arrived == 70
    for answer in answers:
        port = int(answer.instance.rsplit(":", 1)[1])
        assert (answer.error is None and answer.raw is not None and answer.size == len(answer.raw)
                and b"asked_alone" not in answer.raw) if port % 2 \
            else (answer.error == "the answer is not JSON" and answer.raw is None), answer


def _answer(node: int, odd: int, ranks: int = 4) -> NodeAnswer:
    """A node's /v1/dump answer as it comes: its ranks' py-spy threads (rank `odd` in its data loader, the
    rest in all_reduce) and Flight Recorder traces."""
    rows, traces = [], []
    for rank in range(node * ranks, (node + 1) * ranks):
        frames = ([("get", "queue.py"), ("__next__", "torch/utils/data/dataloader.py"), ("train", "train.py")]
                  if rank == odd else [("all_reduce", "torch/distributed/distributed_c10d.py"), ("train", "train.py")])
        rows.append({"rank": rank, "pid": 100 + rank, "gpus": [rank % ranks], "capture": "ok",
                     "threads": [{"pid": 100 + rank, "thread_id": 1, "thread_name": "MainThread", "active": rank != odd,
                                  "frames": [{"name": f, "filename": p, "line": 1} for f, p in frames]}]})
        done = {"pg_id": 0, "process_group": ["0", "default_pg"], "profiling_name": "nccl:all_reduce",
                "state": "completed", "retired": True, "is_p2p": False, "collective_seq_id": 7}
        entries = [done] + ([] if rank == odd else [{**done, "collective_seq_id": 8, "state": "started",
                                                    "retired": False}])
        traces.append({"rank": rank, "entries": entries, "groups": {"0": list(range(4 * ranks))}})
    body = {"node": f"node-{node}", "bundle": f"dump-{node}",
            "jobs": [{"training_job": "run:x", "ranks": rows, "flight_recorder_traces": traces}]}
    raw = json.dumps(body).encode()
    return NodeAnswer(f"10.0.0.{node}:9944", 200, body, None, 0.5, raw, len(raw))


def test_answers_are_read_as_they_come_and_kept_within_the_bundle_budget(tmp_path: Path) -> None:
    """What the coordinator does with each answer as it arrives: read into the verdict's evidence, the
    parsed answer dropped, its bytes kept for the bundle while the budget lasts. In whatever order they
    come, the verdict is merge's."""
    answers = [_answer(node, odd=9) for node in range(4)]
    evidence = JobEvidence("run:x", keep_bytes=2 * answers[0].size + 100)
    came = random.Random(4).sample(range(4), 4)
    kept = {n: evidence.keep(answers[n]) for n in came}
    result = evidence.verdict([kept[n] for n in range(4)])
    assert result.to_json() == merge("run:x", answers).to_json()
    assert [o["member"] for o in result.odd] == ["rank 9"] and result.odd[0]["node"] == "node-2"
    assert result.fr is not None and result.fr.culprits == (9,)
    assert all("jobs" not in k.body and k.body["node"] for k in kept.values())
    assert [n for n in came if kept[n].raw is not None] == came[:2]
    bundle = job_bundle.write(tmp_path, result)
    for n in range(4):
        written = json.loads((bundle / "nodes" / job_bundle.node_file_name(answers[n].instance)).read_text())
        if n in came[:2]:
            assert written["answer"] == answers[n].body and written["status"] == 200
        else:
            assert written["omitted"] == f"the answer ({answers[n].size} bytes) would pass the job bundle's budget"


def test_nodes_asked_at_once_stay_within_the_descriptor_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    from watchdog.coordinate import nodes

    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 4096))
    assert nodes.parallel() == 1024 - 128
    monkeypatch.setattr(resource, "getrlimit", lambda which: (100, 4096))
    assert nodes.parallel() == 1
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert nodes.parallel() == nodes.MAX_PARALLEL


def _with_pace(answer: NodeAnswer, pace: dict[int, dict[str, object]]) -> NodeAnswer:
    """The answer with what its node said of its ranks' pace (by rank: wait_ratio, straggler_slowdown)."""
    body = json.loads(json.dumps(answer.body))
    for row in body["jobs"][0]["ranks"]:
        row.update(pace.get(row["rank"], {}))
    raw = json.dumps(body).encode()
    return NodeAnswer(answer.instance, 200, body, None, 0.5, raw, len(raw))


def test_a_straggler_a_node_named_before_the_hang_is_in_the_job_verdict() -> None:
    answers = [_with_pace(_answer(0, odd=9), {1: {"wait_ratio": 0.31}}),
               _with_pace(_answer(1, odd=9), {5: {"wait_ratio": 0.06, "straggler_slowdown": 1.21}}),
               _with_pace(_answer(2, odd=9), {9: {"wait_ratio": 0.12, "straggler_slowdown": 1.05}}),
               _answer(3, odd=9)]
    result = merge("run:x", answers)
    assert result.verdict.sentence.endswith("a straggler before it, as its node measured (the job ran this much "
                                            "slower for it): rank 5 on node-1 (1.21x), rank 9 on node-2 (1.05x)")
    rows = {r["rank"]: r for r in result.ranks}
    assert rows[1]["wait_ratio"] == 0.31 and "straggler_slowdown" not in rows[1]
    assert rows[5]["straggler_slowdown"] == 1.21
    assert "straggler" not in merge("run:x", [_answer(n, odd=9) for n in range(4)]).verdict.sentence


@pytest.mark.parametrize("bad", [{"wait_ratio": 1.5}, {"wait_ratio": "0.1"}, {"straggler_slowdown": 0.5},
                                 {"straggler_slowdown": True}, {"straggler_slowdown": 1e9}])
def test_a_pace_out_of_bounds_makes_the_answer_malformed(bad: dict[str, object]) -> None:
    result = merge("run:x", [_with_pace(_answer(0, odd=1), {2: bad}), _answer(1, odd=1)])
    (problem,) = [a.error for a in result.answers if a.error]
    assert "malformed" in str(problem) and ".ranks[2]." in str(problem)
    assert "straggler before it" not in result.verdict.sentence


def test_the_coordinators_settings_come_from_its_section_and_its_flags(tmp_path: Path) -> None:
    """--config reads the `coordinator:` section; a flag overrides its key; both are held to the section's
    bounds, and a wrong value names its key and its flag."""
    from watchdog.cli.coordinate import settings
    from watchdog.cli.parser import build_parser
    from watchdog.config import ConfigError
    config = tmp_path / "c.yaml"
    config.write_text("coordinator:\n  prometheus_url: http://prom:9090\n  max_per_minute: 7\n"
                      "  allow_nodes: [10.0.0.0/8]\n")
    parse = build_parser().parse_args
    cfg = settings(parse(["coordinate", "--config", str(config), "--max-per-minute", "9"]))
    assert (cfg.prometheus_url, cfg.max_per_minute, cfg.allow_nodes, cfg.timeout_seconds) == (
        "http://prom:9090", 9, ["10.0.0.0/8"], 60.0)
    with pytest.raises(ConfigError, match=r"coordinator.cooldown_seconds: .* \(--cooldown-seconds\)"):
        settings(parse(["coordinate", "--config", str(config), "--cooldown-seconds", "1e9"]))
    config.write_text("coordinator:\n  scrape_job: ''\n")
    with pytest.raises(ConfigError, match="coordinator.scrape_job"):
        settings(parse(["coordinate", "--config", str(config)]))
    done = cli("coordinate", "--config", str(config), "--job", "run:x")
    assert done.returncode == 2 and "coordinator.scrape_job" in done.stderr and "Traceback" not in done.stderr
    done = cli("coordinate", "--job", "run:x")
    assert done.returncode == 2 and "nothing to ask where a job runs" in done.stderr


def test_check_config_checks_what_coordinate_would_refuse(tmp_path: Path) -> None:
    """What `coordinate --config` would refuse, `check-config` refuses first: a listen address, a node list, a
    secret file; a Prometheus URL with a password (never sent, and shown in logs) is refused without showing it;
    an empty --job or --json without one is a usage error, never a server started."""
    config = tmp_path / "c.yaml"
    for body, said in (("listen_address: '127.0.0.1:99999'", "coordinator.listen_address: expected host:port"),
                       ("allow_nodes: ['not a host!!']", "coordinator.allow_nodes (--allow-node)"),
                       ("node_token_file: /nonexistent/token", "coordinator.node_token_file (--node-token-file)"),
                       ("prometheus_url: 'http://admin:s3cret@prom:9090'", "without a user or password")):
        config.write_text(f"coordinator:\n  {body}\n")
        done = cli("check-config", str(config))
        assert done.returncode == 2 and said in done.stderr, (body, done.stderr)
        assert "s3cret" not in done.stderr and "Traceback" not in done.stderr
    for args in (["--job", ""], ["--json"]):
        done = cli("coordinate", "--prometheus", f"http://127.0.0.1:{closed_port()}", *args)
        assert done.returncode == 2 and ("--job" in done.stderr or "--json" in done.stderr), done.stderr


def test_a_bundle_of_many_nodes_keeps_room_for_every_nodes_note(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Answers that fill the bundle's budget leave room for the note of every node after them: the bundle of a
    job of thousands of nodes is written, each node's file there (its answer, or why it was left out)."""
    answers = [_answer(node, odd=9) for node in range(4)]
    many = answers + [NodeAnswer(f"10.0.1.{n}:9944", None, error="cannot reach it: " + "\u202e\x1b" * 2500)
                      for n in range(200)]  # an error JSON writes six bytes a character
    result = merge("run:x", many)
    job = len(json.dumps(result.to_json(), indent=1, default=str)) + len(job_bundle.render(result).encode()) + 4096
    # room for the job's own files, two answers and every node's note (1 KiB), and not for more answers
    monkeypatch.setattr(job_bundle, "MAX_BUNDLE_BYTES", job + 2 * answers[0].size + len(many) * 1024)
    bundle = job_bundle.write(tmp_path, result)
    written = [json.loads((bundle / "nodes" / job_bundle.node_file_name(a.instance)).read_text()) for a in many]
    assert len(written) == 204 and sum("answer" in w for w in written) >= 1
    assert all("omitted" in w or "answer" in w or w["error"] for w in written)


def test_a_100000_rank_job_is_placed_from_prometheus() -> None:
    """Prometheus's answer for a 12,500-node job of 8 ranks a node is about 12 MB: read whole, every node kept."""
    from watchdog.coordinate.nodes import placement_of

    rows = [{"metric": {"instance": f"gpu-node-{n // 8:05d}.cluster.example:9944", "rank": str(n), "uid": "1001"},
             "value": [1.9e9, "1"]} for n in range(100_000)]
    body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": rows}}).encode()

    class Prometheus(Quiet):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    with serving(Prometheus) as url:
        placement = placement_of(url, "run:big", "stall-watchdog")
    assert len(body) > 8 * 2**20 and len(placement.instances) == 12_500 and len(placement.ranks) == 100_000
