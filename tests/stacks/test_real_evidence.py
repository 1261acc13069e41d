"""`analyze` on the evidence real jobs leave, as people paste it (bench/evidence: public repositories and NCCL's and
PyTorch's documentation, each item's source in bench/evidence/SOURCES.md): hard-wrapped timeout logs, dump-signal
lines, process-group prefixes, RAS reports of several NCCL versions and excerpts of them, the Flight Recorder
analyzer's text, stacks pasted without py-spy's headers. Unreadable is never healthy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from watchdog.cli import main
from watchdog.stacks import fr_text, nccl_timeouts, ras_report
from watchdog.stacks.fr_dumps import RankTrace
from watchdog.stacks.fr_matching import analyze
from watchdog.stacks.paste import pasted

ITEMS = Path(__file__).resolve().parents[2] / "bench" / "evidence" / "items"


def verdict_of(path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert main(["analyze", "--json", str(path)]) == 0
    pictures = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return pictures[-1]


# -- timeout logs -------------------------------------------------------------------------------------
def test_ranks_told_of_a_timeout_they_never_enqueued_are_named() -> None:
    found = nccl_timeouts.parse((ITEMS / "timeout/torchinferno-tp8-rank7-never-enqueued.txt").read_text())
    assert found.culprits == (7,) and "rank 7 never enqueued work #59958 (its last enqueued is #59957" in found.summary
    found = nccl_timeouts.parse((ITEMS / "timeout/coordexp-w8-ranks0-4-never-enqueued-78.txt").read_text())
    assert found.culprits == (0, 4)


@pytest.mark.parametrize("name", ["concept-encoder-hardwrapped-trimmed.txt", "mu-diff-hardwrapped-one-rank.txt",
                                  "nemo-rl-gb200-hardwrapped-one-rank.txt", "gogpt-faq-hardwrapped-cut-broadcast.txt"])
def test_a_hard_wrapped_paste_is_read_and_one_rank_is_not_every_rank(
        name: str, capsys: pytest.CaptureFixture[str]) -> None:
    found = nccl_timeouts.parse((ITEMS / "timeout" / name).read_text())
    assert len(found.events) == 1 and found.events[0].seq > 0 and found.events[0].op
    picture = verdict_of(ITEMS / "timeout" / name, capsys)
    verdict = picture["verdict"]
    assert verdict["kind"] == "hang" and "the others' logs are not here" in verdict["headline"]  # type: ignore[index]
    assert "every rank" not in json.dumps(verdict)


def test_a_group_rank_is_said_as_such_and_the_global_rank_comes_from_the_prefix() -> None:
    found = nccl_timeouts.parse((ITEMS / "timeout/nemo-rl-megatron-ray-tp-ep-groups-global9-local1.txt").read_text())
    event = next(e for e in found.events if e.seq == 49387)
    assert (event.rank, event.group_rank, event.global_known) == (9, 1, True)
    assert "of process group 5 (GUID 37, TENSOR_MODEL_PARALLEL_GROUP)" in found.summary
    alone = nccl_timeouts.parse("[PG ID 3 PG GUID 3 Rank 1]  failure detected by watchdog at work sequence id: 7 PG "
                                "status: last enqueued work: 7, last completed work: 6\n")
    assert "rank 1 of process group 3" in alone.summary and alone.culprits == ()


def test_a_collective_mismatch_at_one_sequence_number_is_noticed() -> None:
    lines = "".join(f"[rank{r}]:[E ProcessGroupNCCL.cpp:632] [Rank {r}] Watchdog caught collective operation timeout: "
                    f"WorkNCCL(SeqNum=42, OpType={'BROADCAST' if r == 7 else 'ALLREDUCE'}, NumelIn=8, NumelOut=8, "
                    "Timeout(ms)=600000) ran for 600010 milliseconds before timing out.\n" for r in range(8))
    found = nccl_timeouts.parse(lines)
    assert found.culprits == (7,) and "BROADCAST #42 while the others are in ALLREDUCE #42" in found.summary


def test_a_stuck_watchdog_alone_is_a_hang_and_an_unreadable_log_is_unknown(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    picture = verdict_of(ITEMS / "timeout/alcf-polaris-heartbeat-quoted-blockquote.txt", capsys)
    assert picture["verdict"]["kind"] == "hang"  # type: ignore[index]
    cut = tmp_path / "cut.log"
    cut.write_text("[rank0]:[E ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation timeout: Wo\n")
    verdict = verdict_of(cut, capsys)["verdict"]
    assert verdict["kind"] == "unknown" and "could not be read" in verdict["sentence"]  # type: ignore[index]


# -- NCCL RAS -----------------------------------------------------------------------------------------
def _ras(name: str) -> ras_report.RasFinding:
    reports = ras_report.parse_all((ITEMS / "ras" / name).read_text())
    return ras_report.judge(reports[0], reports[-1] if len(reports) > 1 else None)


def test_ras_reports_of_every_layout_name_the_rank() -> None:
    assert _ras("nccl-example-2.30.7-incomplete-rank7.txt").culprits == (7,)  # 2.26+: "Rank 7 -- GPU 3 managed by"
    assert _ras("nccl-docs-ras-incomplete-rank21-rstindented.txt").culprits == (21,)  # indented, "The missing rank:"
    mismatch = _ras("nccl-docs-ras-mismatch-warnings-noheader.txt")  # an excerpt with no header, 6 behind
    assert mismatch.culprits == (0, 2, 3, 4, 5, 7)
    assert "one report: a stuck rank and a slow one look the same" in mismatch.summary
    assert "still moving" not in mismatch.summary
    both = _ras("nccl-example-2.30.7-two-reports-incomplete-then-dead.txt")  # two reports in one file
    assert both.queries == 2 and 7 in both.culprits and both.dead


def test_ranks_ahead_of_the_many_are_the_odd_ones() -> None:
    text = ("#0-0 (27a079b828ff1a75) MISMATCH\n  Communicator ranks have different AllReduce operation counts\n"
            "  30 ranks have launched up to operation 5\n  2 ranks have launched up to operation 6\n"
            "  Rank 3 -- GPU 3 managed by process 11 on node a\n  Rank 9 -- GPU 1 managed by process 12 on node b\n")
    found = ras_report.judge(ras_report.parse(text), None)
    assert found.culprits == (3, 9) and all(b.ahead for b in found.behind)
    assert "rank 3 on a is 1 AllReduce ahead of the other 30" in found.summary


def test_the_ras_monitor_event_is_a_dead_process(capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("nccl-docs-ras-monitor-json-peer-dead.json", "nccl-docs-ras-monitor-peer-dead-line.txt"):
        picture = verdict_of(ITEMS / "ras" / name, capsys)
        assert picture["verdict"]["kind"] == "hang", name  # type: ignore[index]
        assert "process 1524345 on 172.16.64.245 (GPU 1) is dead" in picture["verdict"]["sentence"]  # type: ignore[index]


def test_a_log_followed_by_a_ras_report_reads_both(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    both = tmp_path / "both.txt"
    both.write_text((ITEMS / "timeout/mu-diff-hardwrapped-one-rank.txt").read_text() + "\n" +
                    (ITEMS / "ras/nccl-example-2.30.7-incomplete-rank7.txt").read_text())
    picture = verdict_of(both, capsys)
    assert "nccl_timeouts" in picture and picture["nccl_ras"]["culprits"] == [7]  # type: ignore[index]


# -- the Flight Recorder ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["pytorch-tutorial-torchfrtrace-rank1-missing.txt",
                                  "torchcomms-fr-cli-not-all-ranks-seq4.txt", "torchcomms-fr-cli-side-by-side-j.txt"])
def test_the_analyzers_text_names_the_missing_rank(name: str) -> None:
    assert fr_text.parse((ITEMS / "frtrace" / name).read_text()).culprits == (1,)


def _trace(rank: int, state: str) -> RankTrace:
    entry = {"collective_seq_id": 6, "profiling_name": "nccl:all_reduce", "state": state,
             "process_group": ["0", "default_pg"], "pg_id": 0}
    return RankTrace(rank, "2.10", (entry,), {"0": (0, 1, 2, 3)}, {})


def test_a_rank_whose_dump_never_came_is_named_not_read_as_health() -> None:
    found = analyze([_trace(0, "started"), _trace(1, "started"), _trace(3, "started")])
    assert found.stuck and found.culprits == (2,) and "no dump from rank 2" in found.summary


# -- stacks -------------------------------------------------------------------------------------------
def test_processes_waiting_in_sockets_and_sleeps_are_not_healthy(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    text = "".join(f'Process {100 + n}: python serve.py\n\nThread {100 + n} (idle): "MainThread"\n    {frame}\n'
                   "    main (serve.py:10)\n\n"
                   for n, frame in enumerate(["recv (socket.py:700)", "recv (socket.py:700)", "sleep (time.py:1)"]))
    (tmp_path / "three.txt").write_text(text)
    verdict = verdict_of(tmp_path / "three.txt", capsys)["verdict"]
    assert verdict["kind"] == "unknown"  # type: ignore[index]


def test_stacks_pasted_without_headers_are_read(capsys: pytest.CaptureFixture[str]) -> None:
    picture = verdict_of(ITEMS / "pyspy/xccl-ddp-straggler-vs-waiter-fragments.txt", capsys)
    assert picture["verdict"]["kind"] == "hang" and picture["outliers"]  # type: ignore[index]


def test_both_verbs_read_a_stacks_dump_out_folder_of_several_jobs(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    for job in ("run_a", "run_b"):
        folder = tmp_path / job
        folder.mkdir()
        for rank, frame in enumerate(["all_reduce", "all_reduce", "get"]):
            threads = [{"pid": 10 + rank, "thread_id": 10 + rank, "thread_name": "MainThread", "frames": [
                {"name": frame, "filename": "torch/distributed/distributed_c10d.py" if frame != "get" else
                 "queue.py", "line": 1}, {"name": "step", "filename": "train.py", "line": 2}]}]
            (folder / f"rank-{rank}-pid-{10 + rank}.json").write_text(json.dumps(
                {"pid": 10 + rank, "rank": rank, "gpus": [rank], "training_job": job, "threads": threads}))
    assert main(["analyze", "--json", str(tmp_path)]) == 0
    first = capsys.readouterr().out
    assert main(["stacks", "analyze", "--json", str(tmp_path)]) == 0
    second = capsys.readouterr().out
    assert first == second and len(first.splitlines()) == 2
    assert all(json.loads(line)["outliers"] == ["rank 2"] for line in first.splitlines())


def test_a_paste_is_taken_back_to_what_it_was() -> None:
    """A cut at 80 columns mid-word, a Markdown quote, CR line ends: undone before any reader; a report whose
    lines merely share a length is left alone."""
    log = (ITEMS / "timeout/torchinferno-tp8-rank7-never-enqueued.txt").read_text()
    cut = "\n".join(line[i:i + 80] for line in log.splitlines() for i in range(0, max(len(line), 1), 80))
    assert pasted(cut) == log.rstrip("\n")
    assert nccl_timeouts.parse(pasted(cut)).culprits == (7,)
    quoted = "".join(f"> {line}\r\n" for line in log.splitlines())
    assert nccl_timeouts.parse(pasted(quoted)).culprits == (7,)
    ras = (ITEMS / "ras/nccl-docs-ras-mismatch-warnings-noheader.txt").read_text()
    assert pasted(ras) == ras


def test_ranks_that_dumped_for_their_own_timeout_are_said() -> None:
    found = nccl_timeouts.parse((ITEMS / "timeout/torchinferno-tp8-rank7-never-enqueued.txt").read_text())
    assert found.own_timeouts and 7 not in found.own_timeouts and "dumped for a timeout of their own" in found.summary


@pytest.mark.parametrize(("report", "culprits"), [
    # PyTorch's retrieveDesyncReport (torch/csrc/distributed/c10d/TraceUtils.h), its three sentences
    ("   - [47] joined but didn't finish collective #41207 (count from 1)\n"
     "     [0, 1, 2, 3] finished collective #41207, but didn't join collective #41208 (count from 1)\n", (47,)),
    ("   - [0, 1, 2] joined but didn't finish collective #9 (count from 1)\n"
     "     [3] finished collective #9, but didn't join collective #10 (count from 1)\n", (3,)),
    ("   - [0,1,2,3] joined but didn't finish collective #9 (count from 1)\n", ()),
    (" - To our best knowledge, ranks [5] are the lagging ranks that caused this timeout. They never joined any "
     "collectives\n", (5,)),
])
def test_every_desync_report_sentence_names_the_fewer(report: str, culprits: tuple[int, ...]) -> None:
    head = ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=8, OpType=ALLREDUCE, NumelIn=4, "
            "NumelOut=4, Timeout(ms)=600000) ran for 600010 milliseconds before timing out.\n"
            " - To our best knowledge, the lagging/dead/mismatched ranks that caused the desync are:\n")
    assert nccl_timeouts.parse(head + report).culprits == culprits


# -- what a hostile review of the first version found ----------------------------------------------
def _caught(rank: int, seq: int) -> str:
    return (f"[rank{rank}]:[E ProcessGroupNCCL.cpp:632] [Rank {rank}] Watchdog caught collective operation timeout: "
            f"WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, NumelIn=4, NumelOut=4, Timeout(ms)=600000) ran for 600010 "
            "milliseconds before timing out.")


def test_lines_of_one_length_from_grep_are_not_a_wrapped_paste(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    grep = "\n".join(_caught(r, 998 if r == 5 else 999) for r in range(8)) + "\n"
    assert len({len(line) for line in grep.splitlines()}) == 1
    assert pasted(grep) == grep
    (tmp_path / "grep.txt").write_text(grep)
    picture = verdict_of(tmp_path / "grep.txt", capsys)
    assert picture["nccl_timeouts"]["culprits"] == [5]  # type: ignore[index]
    summary = picture["nccl_timeouts"]["summary"]  # type: ignore[index]
    assert "rank 5 timed out after 600 s in ALLREDUCE #998; ranks 0, 1, 2, 3, 4, 6, 7 timed out" in summary


def test_steps_that_rose_before_trouble_are_no_all_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    steps = "".join(f"[2024-04-23 13:4{n}:00][INFO] step={n} loss=2.{n}\n" for n in range(1, 5))
    (tmp_path / "clean.log").write_text(steps)
    assert verdict_of(tmp_path / "clean.log", capsys)["verdict"]["kind"] == "no_stall"  # type: ignore[index]
    (tmp_path / "hung.log").write_text(steps + "[2024-04-23 14:29:46][WARNING] no step logged for 40 minutes\n")
    assert verdict_of(tmp_path / "hung.log", capsys)["verdict"]["kind"] == "unknown"  # type: ignore[index]
    (tmp_path / "cut.log").write_text(steps + "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=<x>\n")
    assert verdict_of(tmp_path / "cut.log", capsys)["verdict"]["kind"] == "unknown"  # type: ignore[index]


def test_one_bad_file_among_many_costs_nothing_but_itself(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "rank.log"
    good.write_text("\n".join(_caught(r, 7 if r == 2 else 8) for r in range(4)) + "\n")
    (tmp_path / "junk.bin").write_bytes(bytes(range(256)) * 64)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "link.log").symlink_to(good)
    assert main(["analyze", "--json", str(good), str(tmp_path / "junk.bin"), str(tmp_path / "empty.txt"),
                 str(tmp_path / "missing.log"), str(tmp_path / "folder")]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out.splitlines()[-1])["nccl_timeouts"]["culprits"] == [2]
    for name, why in (("junk.bin", "binary data"), ("empty.txt", "none of the formats"),
                      ("missing.log", "no such file"), ("link.log", "a symbolic link, not followed")):
        assert f"{name}: {why}" in err, name


def test_one_ras_report_given_twice_is_not_two_queries(capsys: pytest.CaptureFixture[str]) -> None:
    report = ITEMS / "ras/nccl-example-2.30.7-mismatch-straggler-rank7.txt"
    assert main(["analyze", "--json", str(report), str(report)]) == 0
    out, err = capsys.readouterr()
    verdict = json.loads(out.splitlines()[-1])["verdict"]
    assert verdict["kind"] == "waiting" and "counted once" in err


def test_a_crafted_flight_recorder_dump_is_read_not_crashed_on(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    entry = {"collective_seq_id": 5, "profiling_name": ["nccl:all_reduce"], "state": {"x": 1},
             "process_group": ["0", "default_pg"], "pg_id": 0}
    (tmp_path / "nccl_trace_rank_0").write_text(json.dumps({"entries": [entry], "pg_config": {}, "version": "2.10"}))
    assert main(["analyze", "--json", str(tmp_path / "nccl_trace_rank_0")]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["verdict"]["kind"] in ("hang", "unknown")


def test_escape_sequences_in_evidence_never_reach_the_terminal(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    evil = tmp_path / "evil\x1b]0;pwned\x07.txt"
    evil.write_text('Thread 1 (idle): "MainThread"\n    \x1b[2Jstep (train\x1b[8m.py:1)\n    main (train.py:2)\n')
    main(["analyze", str(evil), str(tmp_path / "none\x1b[2J.txt")])
    out, err = capsys.readouterr()
    assert "\x1b" not in out and "\x1b" not in err and "\x07" not in err and "\\x1b" in out + err
