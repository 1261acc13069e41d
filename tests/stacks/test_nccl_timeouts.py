"""NCCL watchdog timeout logs: the lines PyTorch prints, rebuilt from the facts of real issue threads
(../shared/realdata/nccl_logs keeps the values, not the logs), and a real TORCH_NCCL_DESYNC_DEBUG report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import realdata
from watchdog.cli import main
from watchdog.stacks import nccl_timeouts


def log_lines(facts: dict[str, object]) -> str:
    """The watchdog's two lines per rank, as PyTorch 2.x prints them, with a fact file's values."""
    lines = []
    for e in facts["events"]:  # type: ignore[attr-defined]
        tag = f"[{e['pg']} Rank {e['rank']}]" if e["pg"] else f"[Rank {e['rank']}]"
        if e["op_type"] and e["seq_num"] is not None:
            sizes = "".join(f", {name}={e[key]}" for name, key in (("NumelIn", "numel_in"), ("NumelOut", "numel_out"))
                            if e[key] is not None)
            limit = f", Timeout(ms)={e['timeout_ms']}" if e["timeout_ms"] else ""
            ran = f" ran for {e['ran_for_ms']} milliseconds before timing out." if e["ran_for_ms"] else ""
            lines.append(f"[rank{e['rank']}]:[E ProcessGroupNCCL.cpp:632] {tag} Watchdog caught collective operation "
                         f"timeout: WorkNCCL(SeqNum={e['seq_num']}, OpType={e['op_type']}{sizes}{limit}){ran}")
        if e["last_enqueued"] is not None and e["last_completed"] is not None:
            lines.append(f"{tag} Exception (either an error or timeout) detected by watchdog at work: {e['seq_num']}, "
                         f"last enqueued NCCL work: {e['last_enqueued']}, last completed NCCL work: "
                         f"{e['last_completed']}.")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(("stem", "phrase"), [
    ("BasicSR-737-1", "ranks 0, 1, 2 timed out after 600 s in ALLREDUCE #808; all 3 ranks that logged are at the "
                      "same work: none is behind"),
    ("LlamaFactory-7396-1", "timed out after 600 s in ALLREDUCE #1580 of process group 1; none is behind another; "
                            "no line from ranks 1"),
    ("LlamaFactory-6269-1", "no line from ranks 1, 2 here"),
    ("open-r1-620-1", "ranks 1, 2, 3, 4, 5, 6 timed out after 1800 s in BROADCAST #4; none is behind another; no line "
                      "from rank 0 here"),
    ("pytorch-118369-1", "in BROADCAST #880; none is behind another; no line from ranks 0, 1, 5 here"),
])
def test_real_timeouts_name_the_suspects(stem: str, phrase: str) -> None:
    facts = json.loads(realdata("nccl_logs", f"{stem}.json").read_text())
    found = nccl_timeouts.parse(log_lines(facts))
    assert phrase in found.summary, found.summary


def test_the_real_desync_report_names_the_lagging_rank() -> None:
    found = nccl_timeouts.parse(realdata("nccl_logs", "ml-engineering-debug-pytorch-desync-report.txt").read_text())
    assert found.culprits == (1,) and "rank 1 finished collective #2, but didn't join collective #3" in found.summary
    assert found.summary.startswith("NCCL timeout log: rank 0 timed out after 8 s")


def test_a_rank_behind_by_sequence_number_is_the_suspect() -> None:
    text = "".join(f"[Rank {r}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={s}, OpType=ALLREDUCE, "
                   f"NumelIn=4, NumelOut=4, Timeout(ms)=600000) ran for 600100 milliseconds before timing out.\n"
                   for r, s in ((0, 41), (1, 41), (2, 40), (3, 41)))
    found = nccl_timeouts.parse(text)
    assert found.culprits == (2,) and "rank 2 timed out in #40 while others were at #41" in found.summary


def test_analyze_reads_a_folder_of_timeout_logs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    facts = json.loads(realdata("nccl_logs", "open-r1-620-1.json").read_text())
    lines = log_lines(facts).splitlines()
    for n, line in enumerate(lines):  # one log file per rank, as a launcher leaves them
        (tmp_path / f"rank{n}.log").write_text(line + "\n")
    (tmp_path / "notes.md").write_text("nothing here\n")
    assert main(["analyze", "--json", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    picture = json.loads(out.splitlines()[0])
    assert picture["nccl_timeouts"]["silent"] == [0] and picture["verdict"]["kind"] == "hang"
    assert "notes.md" in err and "skipped" in err


def test_the_headline_of_timeout_logs_names_the_rank_behind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = "".join(f"[Rank {r}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={s}, OpType=ALLREDUCE, "
                   f"NumelIn=4, NumelOut=4, Timeout(ms)=600000) ran for 600100 milliseconds before timing out.\n"
                   for r, s in ((0, 41), (1, 41), (2, 40), (3, 41)))
    (tmp_path / "train.log").write_text(text)
    assert main(["analyze", "--json", str(tmp_path / "train.log")]) == 0
    verdict = json.loads(capsys.readouterr().out.splitlines()[0])["verdict"]
    assert verdict["headline"] == "the job waits on rank 2 (NCCL timeout logs)"


def test_analyze_reads_a_folder_of_py_spy_text_dumps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Text dumps pasted from issues, one per file, and a file that is no evidence: read, and named."""
    real = realdata("hang_stacks", "bigscience-tr11-176B-chronicles-2022-04-30-node48.txt").read_text()
    (tmp_path / "node48.txt").write_text(real)
    (tmp_path / "README").write_text("how we collected these\n")
    assert main(["analyze", "--json", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    picture = json.loads(out.splitlines()[0])
    assert picture["groups"] and "skipped" in err and "README" in err


def _spy(pid: int, command: str, frames: list[str]) -> str:
    body = "\n".join(f"    {frame}" for frame in frames)
    return (f"Process {pid}: {command}\nPython v3.10.12 (/usr/bin/python3.10)\n\n"
            f'Thread {pid} (idle): "MainThread"\n{body}\n')


def test_analyze_never_merges_unrelated_processes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Four ranks of a training job, one of them elsewhere, and two processes of an unrelated server that
    idle in a queue: two verdicts, each over its own processes, and the split said on stderr."""
    collective = ["all_reduce (torch/distributed/distributed_c10d.py:2501)", "step (train.py:59)"]
    for rank in range(3):
        (tmp_path / f"rank{rank}.txt").write_text(_spy(100 + rank, f"/usr/bin/python3 -u train.py --local-rank={rank}",
                                                       collective))
    (tmp_path / "rank3.txt").write_text(_spy(103, "/usr/bin/python3 -u train.py --local-rank=3",
                                             ["get (queue.py:171)", "__next__ (loader.py:12)", "step (train.py:52)"]))
    for worker in range(2):
        (tmp_path / f"server{worker}.txt").write_text(_spy(200 + worker, "python -m vllm.entrypoints.api_server",
                                                           ["get (queue.py:171)", "serve (server.py:9)"]))
    assert main(["analyze", "--json", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    pictures = [json.loads(line) for line in out.splitlines()]
    assert "2 different jobs or programs (-m vllm.entrypoints.api_server, train.py)" in err
    by_name = {p["job"].rsplit(": ", 1)[-1]: p for p in pictures}
    assert set(by_name) == {"train.py", "-m vllm.entrypoints.api_server"}
    train = by_name["train.py"]
    assert train["outliers"] == ["pid 103"] and "pid 200" not in json.dumps(train)
    assert "pid 103" not in json.dumps(by_name["-m vllm.entrypoints.api_server"])


def _caught(rank: int, pg: str, seq: int, op: str = "ALLREDUCE") -> str:
    return (f"[rank{rank}]:[E1101 10:00:00.000000000 ProcessGroupNCCL.cpp:632] [{pg} Rank {rank}] Watchdog caught "
            f"collective operation timeout: WorkNCCL(SeqNum={seq}, OpType={op}, NumelIn=1, NumelOut=1, "
            "Timeout(ms)=600000) ran for 600010 milliseconds before timing out.\n")


def test_two_groups_that_share_a_pg_id_are_told_apart_by_their_guid() -> None:
    """Each rank numbers the groups it is in, so PG ID 11 on one rank and PG ID 11 on another can be two groups;
    their GUIDs tell. Counters 50,000 apart in two groups are not one rank behind the other."""
    found = nccl_timeouts.parse(_caught(0, "PG ID 11 PG GUID 11", 100) + _caught(1, "PG ID 11 PG GUID 35", 50100))
    assert found.culprits == (), found.summary
    same = nccl_timeouts.parse(_caught(0, "PG ID 11 PG GUID 35(dp)", 100) + _caught(1, "PG ID 11 PG GUID 35(dp)", 101))
    assert same.culprits == (0,), same.summary


def test_in_a_job_of_two_ranks_the_silent_one_is_the_peer_that_never_arrived() -> None:
    one = _caught(0, "PG ID 0 PG GUID 0(default_pg)", 7)
    assert nccl_timeouts.parse(one).culprits == ()  # the size unknown: the others' logs hold the answer
    found = nccl_timeouts.parse("[rank0]: world_size=2\n" + one)
    assert found.culprits == (1,) and "the peer that never arrived" in found.behind[1], found.summary
    both = found = nccl_timeouts.parse("NCCL INFO comm 0x55 rank 0 nranks 2 cudaDev 0\n" + one +
                                       _caught(1, "PG ID 0 PG GUID 0(default_pg)", 7))
    assert both.culprits == () and both.same_work  # both timed out at the same work: neither is named
    wider = nccl_timeouts.parse("WORLD_SIZE=4\n" + one + _caught(1, "PG ID 0 PG GUID 0(default_pg)", 7))
    assert wider.culprits == () and wider.silent == (2, 3), wider.summary  # ranks above the highest that logged


def test_one_rank_on_each_side_of_a_mismatch_blames_neither() -> None:
    pg = "PG ID 0 PG GUID 0(default_pg)"
    two = nccl_timeouts.parse(_caught(0, pg, 9, "ALLREDUCE") + _caught(1, pg, 9, "BROADCAST"))
    assert two.culprits == (), two.summary
    three = nccl_timeouts.parse(_caught(0, pg, 9, "ALLREDUCE") + _caught(1, pg, 9, "BROADCAST") +
                                _caught(2, pg, 9, "ALLREDUCE"))
    assert three.culprits == (1,), three.summary


def test_the_size_torchrun_was_launched_with_is_the_world() -> None:
    one = _caught(1, "PG ID 0 PG GUID 0(default_pg)", 7)
    found = nccl_timeouts.parse("+ torchrun --nnodes=1 --nproc_per_node=2 train.py\n" + one)
    assert found.culprits == (0,), found.summary
    elastic = nccl_timeouts.parse("+ torchrun --nnodes=1:4 --nproc_per_node=2 train.py\n" + one)
    assert elastic.culprits == ()  # a range of nodes says no size
