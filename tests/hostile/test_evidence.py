"""`analyze` on hostile evidence: every file is read capped and ends in a picture or a one-line error, never
a traceback, a wait on a FIFO or an endless read."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest

from watchdog.cli import main

DEEP = "[" * 200_000 + "]" * 200_000
HOSTILE: dict[str, str | bytes] = {
    "huge-int.json": '[{"pid": 1, "thread_id": ' + "9" * 5000 + ', "frames": []}]',
    "nan.json": '[{"pid": NaN, "thread_id": Infinity, "frames": [{"name": NaN, "filename": 1, "line": -1e999}]}]',
    "lists-for-strings.json": '[{"pid": [1], "thread_name": ["x"], "frames": [{"name": ["f"], "filename": {}}]}]',
    "frames-not-list.json": '[{"pid": 1, "frames": "abc"}, 1, "x", null]',
    "deep.json": DEEP,
    "deep-object.json": '{"processes": ' + DEEP + "}",
    "processes-odd.json": '{"processes": [1, {"pid": "x", "threads": [{"frames": 5}, 7]}, {"threads": "t"}]}',
    "capture-odd.json": '{"threads": {"a": 1}, "rank": [2], "gpus": "01"}',
    "capture-huge-rank.json": '{"threads": [], "rank": ' + "1" * 5000 + ', "gpus": [1e999]}',
    "job-bundle-ish.json": '{"odd_ranks": [1], "training_job": ["x"]}',
    "ras.json": '{"communicators": [{"size": "abc"}]}',
    "ras-deep.json": '{"communicators": ' + DEEP + "}",
    "ras-count.json": '{"communicators": [{"ranks": [{"rank": 0, "collective_counts": {"A": 1e999}}]}]}',
    "ras.txt": "Job summary\nCommunicators\n#0-1 (ab) MISMATCH\n    Rank " + "9" * 5000 + " has launched up to "
               "operation 1 -- [process information not found]\n",
    "text.txt": "Process " + "9" * 5000 + ":\nThread 0x" + "f" * 5000 + " (idle): \"MainThread\"\n    f (a.py:1)\n",
    "binary.bin": bytes(range(256)) * 100,
    "empty.txt": "",
    "fr-json-rank7": '{"entries": [{"collective_seq_id": 1e999, "process_group": [1, 2, 3]}], "pg_config": ' + DEEP
                     + "}",
    "fr-json-rank8": '{"entries": ' + DEEP + "}",
    "fr-json-rank9": '{"entries": [' + ",".join(['{"collective_seq_id": ' + "9" * 5000 + "}"]) + "]}",
}


def pickles() -> dict[str, bytes]:
    return {
        "fr-pickle-rank1": pickle.dumps({"entries": [{"collective_seq_id": 2**300, "profiling_name": b"x"}]}, 2),
        "fr-pickle-rank2": pickle.dumps({"entries": [1, "x", None, {"state": ["completed"]}], "pg_config": [1]}, 2),
        "fr-pickle-rank3": pickle.dumps({"entries": [{"collective_seq_id": float("nan")}], "pg_status": {1: 2}}, 2),
        "fr-pickle-rank4": pickle.dumps({"entries": [{"process_group": ("0", "default_pg"), "collective_seq_id": 1,
                                                      "profiling_name": "nccl:all_reduce", "state": "scheduled"}],
                                         "pg_config": {"0": {"ranks": "[" + "7," * 200_000 + "]"}}}, 2),
        "fr-pickle-rank5": b"\x80\x02" + b"(" * 100_000 + b"." ,
    }


@pytest.mark.parametrize("name", sorted([*HOSTILE, *pickles()]))
def test_hostile_evidence_is_a_picture_or_an_error(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                   ) -> None:
    content = {**HOSTILE, **pickles()}[name]
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    code = main(["analyze", "--json", str(path)])
    out, err = capsys.readouterr()
    assert code in (0, 1, 2) and "Traceback" not in err, err[-2000:]
    if code == 0:
        json.loads(out.splitlines()[0])
    else:
        assert err.strip() and len(err.splitlines()) <= 3, err


def test_a_fifo_and_a_device_are_errors_not_waits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.mkfifo(tmp_path / "pipe")
    for path in (str(tmp_path / "pipe"), "/dev/zero"):
        assert main(["analyze", path]) != 0
        assert "not a regular file" in capsys.readouterr().err


def test_processes_that_each_claim_a_program_of_their_own_stay_bounded(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A text dump whose processes name 300 programs, one with a terminal escape and one a 100 KB command: each
    gets its picture, the note on stderr stays one short line, and no escape or long name reaches the output."""
    lines = []
    for pid in range(300):
        command = {0: "\x1b]0;pwned\x07evil.py", 1: "x" * 100_000 + ".py"}.get(pid, f"prog{pid}.py")
        lines.append(f'Process {1000 + pid}: python {command}\nThread {1000 + pid} (idle): "MainThread"\n'
                     "    get (queue.py:171)\n")
    (tmp_path / "many.txt").write_text("".join(lines))
    assert main(["analyze", "--json", str(tmp_path / "many.txt")]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 300 and "\x1b" not in out and "\x1b" not in err
    assert all(len(json.loads(line)["job"]) < 260 for line in out.splitlines())
    (note,) = err.splitlines()
    assert "300 different jobs or programs" in note and "and 292 more" in note and len(note) < 2000
