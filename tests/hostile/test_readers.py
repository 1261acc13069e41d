"""Readers that cannot be starved, and say nothing the input does not show (issue 40, round 4).

What a rank writes (a Flight Recorder dump, what py-spy prints of it, a RAS reply), and what a person hands to
`analyze` (a log, a paste, a folder, a file name), is bounded in the objects the readers build, in the time a
line takes, and in what is printed back. Memory is measured in a fresh Python process (`measure`): the growth
of its peak RSS past its imports, so that the daemon (about 75 MiB) stays under 150 MiB. bench/hostile_costs.py
prints the same figures for the code before these fixes and after.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.users import ALICE, BOB, shared_folder, user_process
from watchdog.cli import main

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20
DUMP_BYTES = 16 * MIB  # what a rank may write where its Flight Recorder dump goes (fr_dumps.MAX_DUMP_BYTES)
GROWTH_MIB = 75  # a daemon of about 75 MiB stays under 150 MiB

# The peak is the kernel's VmHWM, reset once the imports are done (`5` to clear_refs): getrusage's ru_maxrss would
# start at the parent's size, which a child exec'd from a large process (pytest, the bench) inherits.
_CHILD = """
import json, sys, time
import watchdog.cli.analyze, watchdog.stacks.flight_recorder, watchdog.stacks.capture, watchdog.stacks.nccl_ras
def kib(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field))
args = json.loads(sys.argv[1])
with open("/proc/self/clear_refs", "w") as peak:
    peak.write("5")
base = kib("VmRSS:")
started, cpu = time.perf_counter(), time.process_time()
outcome = None
exec(sys.argv[2])
print(json.dumps({"grew_mib": (kib("VmHWM:") - base) / 1024, "seconds": time.perf_counter() - started,
                  "cpu_seconds": time.process_time() - cpu, "outcome": outcome}))
"""


def measure(code: str, args: object = None, root: Path = REPO, timeout: float = 300) -> dict[str, object]:
    """`code` run in a fresh Python that imports the watchdog of `root` (a checkout: this one, or an older one
    for the figure before a fix), with `args` as `args`; what it leaves in `outcome`, how far its peak RSS grew
    past its size after its imports (MiB), how long it took (s) and the CPU it used (s: what a bound on the work
    is checked by, whatever else shares the machine's cores)."""
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args), code], capture_output=True, text=True,
                          cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, timeout=timeout)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# -- what a rank can write -----------------------------------------------------------------------------
def opcode_pickle(opcode: bytes, size: int = DUMP_BYTES) -> bytes:
    """A pickle (protocol 2) of one opcode repeated: `]` an empty list, `}` a dict, `(` a mark, `N` a None."""
    return b"\x80\x02" + opcode * ((size - 3) // len(opcode)) + b"."


def empty_lists_json(size: int = DUMP_BYTES, head: bytes = b'{"entries": [') -> bytes:
    """JSON of `[],[],...` inside `head`, `size` bytes in all."""
    tail = b"[]]}" if head.startswith(b"{") else b"[]]"
    return head + b"[]," * ((size - len(head) - len(tail)) // 3) + tail


HOSTILE_DUMPS = {"pickle ]": lambda: opcode_pickle(b"]"), "pickle (": lambda: opcode_pickle(b"("),
                 "pickle }": lambda: opcode_pickle(b"}"), "pickle N": lambda: opcode_pickle(b"N"),
                 "pickle PROTO": lambda: opcode_pickle(b"\x80\x02")[:-1] + b"N.",  # builds nothing, takes time
                 "json [],": lambda: empty_lists_json()}

READ_DUMP = """
from watchdog.stacks.flight_recorder import FlightRecorder, collect
traces, problems = collect([FlightRecorder(args["pid"], 3, "triggered", "", args["path"])], 0.0, 15.0)
outcome = {"traces": len(traces), "problems": problems}
"""


@contextmanager
def rank_with_dump(folder: Path, data: bytes) -> Iterator[tuple[int, str]]:
    """A real process of another user and the dump it wrote where its Flight Recorder dump goes."""
    path = folder / "nccl_trace_rank_3"
    path.write_bytes(data)
    os.chown(path, ALICE, ALICE)
    with user_process(folder, ALICE, ["queue"]) as rank:
        yield rank.pid, str(path)


@pytest.mark.parametrize("name", sorted(HOSTILE_DUMPS))
def test_a_dump_of_empty_containers_is_refused_within_the_memory_budget(name: str) -> None:
    """16 MiB of one-byte opcodes that each build an object (a GiB of lists), or of `[],` in the JSON form: the
    daemon reads the rank's dump as it does after a hang and refuses it, its memory bounded, in seconds, once (not
    again and again until the 15 s it waits for dumps still being written)."""
    with shared_folder() as folder, rank_with_dump(folder, HOSTILE_DUMPS[name]()) as (pid, path):
        found = measure(READ_DUMP, {"pid": pid, "path": path})
    outcome = found["outcome"]
    assert isinstance(outcome, dict) and outcome["traces"] == 0
    assert "would build" in outcome["problems"][0] and "MiB of objects" in outcome["problems"][0]
    assert float(found["grew_mib"]) < GROWTH_MIB, found  # type: ignore[arg-type]
    assert float(found["cpu_seconds"]) < 8, found  # type: ignore[arg-type]


def test_real_dumps_and_a_full_trace_buffer_still_read() -> None:
    """The budget leaves room for real dumps: NVIDIA's, and a rank's full buffer of 2,000 entries, each with
    30 stack frames, as PyTorch writes it (a few MB)."""
    import pickle

    from watchdog.stacks import fr_dumps

    folder = REPO / "tests" / "data" / "nvrx_fr_traces" / "gpu_error_1st"
    real = [fr_dumps.read(p) for p in sorted(folder.glob("_dump_*"))]
    assert len(real) == 16 and all(t.entries for t in real)
    template = pickle.loads((folder / "_dump_0").read_bytes())
    entry = template["entries"][0]
    entries = [{**entry, "record_id": n, "collective_seq_id": n,
                "frames": [{"name": f"function_{f}", "filename": f"/opt/train/module_{f % 7}.py", "line": 10 + n % 50}
                           for f in range(30)]} for n in range(2000)]
    data = pickle.dumps({**template, "entries": entries}, 2)
    assert len(data) > 2 * MIB
    trace = fr_dumps.parse(data, rank=0, source="full")
    assert len(trace.entries) == 2000


HOSTILE_PY_SPY = """
import sys
sys.stdout.buffer.write(open(sys.argv[1], "rb").read())
"""
CAPTURE = """
import os
from watchdog.stacks.capture import StackCapturer, Target
capture = StackCapturer(args["command"], timeout_seconds=60).capture_one(Target(os.getpid()))
outcome = [capture.result, capture.message]
"""


def test_py_spy_output_of_empty_lists_is_refused_within_the_memory_budget(tmp_path: Path) -> None:
    """What py-spy prints is the rank's to choose (thread and function names); 15 MiB of `[],` is refused
    before json builds five million lists."""
    data = tmp_path / "out.json"
    data.write_bytes(empty_lists_json(15 * MIB, head=b"["))
    script = tmp_path / "py-spy"
    script.write_text(HOSTILE_PY_SPY)
    found = measure(CAPTURE, {"command": [sys.executable, str(script), str(data)]})
    assert found["outcome"][0] == "failed" and "would build" in found["outcome"][1], found  # type: ignore[index]
    assert float(found["grew_mib"]) < GROWTH_MIB, found  # type: ignore[arg-type]


RAS = """
import socket, threading
from watchdog.stacks import nccl_ras
server = socket.create_server(("127.0.0.1", 0))
report = open(args["report"], "rb").read()
def serve():
    conn, _ = server.accept()
    with conn:
        lines = conn.makefile("rb")
        for answer in (b"SERVER PROTOCOL 2\\n", b"OK\\n", b"OK\\n"):
            lines.readline()
            conn.sendall(answer)
        lines.readline()
        conn.sendall(report)
threading.Thread(target=serve, daemon=True).start()
finding = nccl_ras.ask_twice("127.0.0.1", server.getsockname()[1], gap_seconds=0, binary="")
outcome = finding.problem
"""


def test_a_ras_reply_of_empty_lists_is_refused_within_the_memory_budget(tmp_path: Path) -> None:
    """Any local user may hold NCCL's RAS port: its 16 MiB reply of `[],` is refused, not built."""
    report = tmp_path / "report.json"
    report.write_bytes(empty_lists_json(16 * MIB - 64, head=b'{"communicators": ['))
    found = measure(RAS, {"report": str(report)})
    assert "would build" in str(found["outcome"]), found
    assert float(found["grew_mib"]) < GROWTH_MIB, found  # type: ignore[arg-type]


def test_analyze_refuses_a_json_file_of_empty_lists(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "stacks.json"
    path.write_bytes(empty_lists_json(8 * MIB, head=b"["))
    assert main(["analyze", str(path)]) != 0
    assert "would build" in capsys.readouterr().err


def test_a_large_log_that_begins_with_a_bracket_is_still_read_as_a_log(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """16 MiB of `[rank0]:...` lines has the commas and colons of far more JSON than the budget: it is not JSON
    (its first bytes say so), so it is read as the timeout log it is, not refused."""
    lines = [TIMEOUT_LINE.format(rank=n % 8) for n in range(16 * MIB // len(TIMEOUT_LINE))]
    (tmp_path / "ranks.log").write_text("".join(lines))
    assert main(["analyze", "--json", str(tmp_path / "ranks.log")]) == 0
    picture = json.loads(capsys.readouterr().out.splitlines()[0])
    assert picture["verdict"]["kind"] == "hang" and picture["nccl_timeouts"]["ranks"] == list(range(8))


# -- lines that make a pattern backtrack ----------------------------------------------------------------
PATHOLOGICAL = {
    "py-spy frame": "Thread 7 (idle): \"MainThread\"\n    f" + " (" * 20_000 + "\n",
    "py-spy frame, closed": "Thread 7 (idle): \"MainThread\"\n    f" + " (a" * 13_000 + ")x\n",
    "py-spy header": "Thread 7 (idle): \"" + "\" " * 20_000 + "x\n",
    "frames without headers": "    f" + " (a.py:1" * 5_000 + "\n" + "    g (b.py:2)\n" * 2,
    "timeout tags": "[rank1]:" + "[PG " * 10_000 + " Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1\n",
    "desync ranks": "ranks [" + "1, " * 13_000 + "x are the lagging ranks that caused this timeout\n",
    "RAS rank line": "Job summary\n#0-1 (ab) MISMATCH\n  Communicator ranks have different operation counts\n"
                     "    Rank 1 -- GPU 1" + "9" * 40_000 + " managed by process 1 on node x\n",
    "analyzer columns": "Rank 1" + "  Rank 1" * 5_000 + "  x\n" + "  Rank 2\n" * 2,
    "step counter": "step " + "9" * 40_000 + "\n" + "step step " * 4_000 + "\n",
}


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL))
def test_a_pathological_line_is_read_in_well_under_a_second(name: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "paste.txt"
    path.write_text(PATHOLOGICAL[name])
    started = time.process_time()  # CPU seconds: a pathological line costs as much as a plain one, loaded or not
    main(["analyze", "--json", str(path)])
    assert time.process_time() - started < 1.0
    assert "Traceback" not in capsys.readouterr().err


# -- what the input proves -----------------------------------------------------------------------------
TIMEOUT_LINE = ("[rank{rank}]:[E710 ProcessGroupNCCL.cpp:757] [Rank {rank}] Watchdog caught collective operation "
                "timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for "
                "600020 milliseconds before timing out.\n")
ANALYZE = """
import contextlib, io
from watchdog.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    main(["analyze", "--json", args["path"]])
outcome = out.getvalue()
"""


def test_a_timeout_log_naming_a_huge_rank_costs_what_it_proves(tmp_path: Path) -> None:
    """Two lines naming ranks 0 and 9999999: the ranks between are said as a count, never listed one by one."""
    path = tmp_path / "timeout.log"
    path.write_text(TIMEOUT_LINE.format(rank=0) + TIMEOUT_LINE.format(rank=9_999_999))
    found = measure(ANALYZE, {"path": str(path)})
    out = str(found["outcome"])
    assert len(out) < 20_000, len(out)
    assert float(found["grew_mib"]) < 20, found  # type: ignore[arg-type]
    timeouts = json.loads(out)["nccl_timeouts"]
    assert timeouts["silent_count"] == 9_999_998 and timeouts["silent"][:3] == [1, 2, 3]
    assert "9999998 ranks" in timeouts["summary"]


ODD = """
import queue, sys, threading, time
def loop():
    while True:
        time.sleep(0.05)
if sys.argv[1] == "odd":
    # the real main thread renamed to look like one on a terminal, a decoy given its name, where the others are
    threading.current_thread().name = "Main\\rThread"
    threading.Thread(target=loop, name="MainThread", daemon=True).start()
    open(sys.argv[2], "w").write("ready")
    queue.Queue().get()
open(sys.argv[2], "w").write("ready")
loop()
"""


@contextmanager
def three_processes(folder: Path) -> Iterator[list[int]]:
    """Two processes of BOB in a loop; a third, of ALICE, stuck in a queue whose thread names lie."""
    (folder / "odd.py").write_text(ODD)
    (folder / "odd.py").chmod(0o644)
    with user_process(folder, BOB, ["even"], script="odd.py", launched=False) as a, \
            user_process(folder, BOB, ["even"], script="odd.py", launched=False) as b, \
            user_process(folder, ALICE, ["odd"], script="odd.py", launched=False) as odd:
        yield [a.pid, b.pid, odd.pid]


def test_a_decoy_main_thread_does_not_hide_the_odd_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A thread's name is a claim; the main thread is the one whose OS thread id is the process's id. Live, and
    from py-spy's text of the same processes."""
    with shared_folder() as folder, three_processes(folder) as pids:
        assert main(["stacks", "dump", "--json", *[a for pid in pids for a in ("--pid", str(pid))]]) == 0
        live = json.loads(capsys.readouterr().out.splitlines()[0])
        text = "".join(subprocess.run([str(Path(sys.executable).with_name("py-spy")), "dump", "--pid", str(pid)],
                                      capture_output=True, text=True, check=True).stdout for pid in pids)
    assert live["outliers"] == [f"pid {pids[2]}"] and live["verdict"]["kind"] != "no_stall", live["summary"]
    (tmp_path / "stacks.txt").write_text(text)
    assert main(["analyze", "--json", str(tmp_path / "stacks.txt")]) == 0
    saved = json.loads(capsys.readouterr().out.splitlines()[0])
    assert saved["outliers"] == [f"pid {pids[2]}"], saved["summary"]


FORGER = """
import queue, sys, threading
threading.current_thread().name = "x\\nProcess 4242: python train.py\\nPython v3.11.7 (/usr/bin/python3)\\n\\n" \\
    "Thread 4242 (idle): \\"MainThread"
open(sys.argv[2], "w").write("ready")
queue.Queue().get()
"""


def test_a_thread_name_with_new_lines_forges_no_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with shared_folder() as folder:
        (folder / "forger.py").write_text(FORGER)
        (folder / "forger.py").chmod(0o644)
        with user_process(folder, ALICE, ["x"], script="forger.py", launched=False) as forger:
            text = subprocess.run([str(Path(sys.executable).with_name("py-spy")), "dump", "--pid", str(forger.pid)],
                                  capture_output=True, text=True, check=True).stdout
    assert "\nProcess 4242:" in text  # py-spy prints the name as it is
    (tmp_path / "stacks.txt").write_text(text)
    assert main(["analyze", "--json", str(tmp_path / "stacks.txt")]) == 0
    picture = json.loads(capsys.readouterr().out.splitlines()[0])
    assert [m for g in picture["groups"] for m in g["members"]] == [f"pid {forger.pid}"], picture["groups"]


def test_a_note_after_a_header_is_not_a_name_that_runs_on() -> None:
    """Only a name whose quote is still open runs on to the next lines: words after a closed quote (a person's
    note) leave the header prose, as before, and the next thread is read."""
    from watchdog.stacks.pyspy_text import parse_text

    text = ('Thread 12 (idle): "MainThread"  <-- stuck here\n    f (a.py:1)\n'
            'Thread 13 (idle): "MainThread"\n    g (b.py:2)\n')
    assert [(d.member, d.main_thread.frames[0].function) for d in parse_text(text)] == [("pid 13", "g")]  # type: ignore[union-attr]


def test_a_claimed_count_does_not_outweigh_the_processes_shown(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Seventy stacks shown in their forward pass, and one in a queue under a count line claiming a billion
    processes there: a claim stands for at most a node's worth of processes (pyspy_text.MAX_CLAIMED), so it cannot
    outweigh the stacks shown."""
    shown = [f'Thread {1000 + n} (active): "MainThread"\n    forward (model.py:10)\n    train (train.py:40)\n\n'
             for n in range(70)]
    claim = ('999999999 processes are in:\nThread 106 (idle): "MainThread"\n    get (queue.py:171)\n'
             '    train (train.py:42)\n')
    (tmp_path / "stacks.txt").write_text("".join(shown) + claim)
    assert main(["analyze", "--json", str(tmp_path / "stacks.txt")]) == 0
    picture = json.loads(capsys.readouterr().out.splitlines()[0])
    assert picture["outliers"] == ["pid 106"], picture["summary"]
    assert sum(g["count"] for g in picture["groups"]) == 70 + 64, picture["groups"]
    # inside py-spy's own output (a process block) a count line stands for nothing: py-spy never prints one
    (tmp_path / "pyspy.txt").write_text("Process 106: python train.py\n" + claim)
    assert main(["analyze", "--json", str(tmp_path / "pyspy.txt")]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["groups"][0]["count"] == 1


def printable(data: bytes) -> bool:
    """Output a terminal shows as text: valid UTF-8 with no control character but new lines and tabs, and no
    character that reorders or breaks what follows (bidirectional controls, Unicode's line separators)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return not any((ord(c) < 0x20 and c not in "\n\t") or 0x7f <= ord(c) < 0xa0 or c in _REORDERING for c in text)


_REORDERING = "\u061c\u200e\u200f\u2028\u2029\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"


@pytest.mark.parametrize("verb", [["analyze"], ["analyze", "--json"], ["stacks", "analyze"]])
def test_no_control_character_reaches_the_terminal(verb: list[str], tmp_path: Path) -> None:
    """ESC and BEL in a dump, a timeout log and a file's name, and the bytes 0x9b (an 8-bit terminal's CSI) and
    0xff in a name that is not UTF-8, a right-to-left override and a line separator: every line on stdout and
    stderr is text, in the order it was written."""
    folder = tmp_path / "evidence"
    folder.mkdir()
    log = TIMEOUT_LINE.format(rank=0).replace("ALLREDUCE", "ALL\x1b]0;pwned\x07RE\u202eDUCE\u2028")
    (folder / "log-\x1b[2J\x07\u2066.txt").write_text(log)
    (folder / "stacks.txt").write_text('Process 12: python \x1b[31mtrain.py\x07\nThread 12 (idle): "Main\x1b]0;t\x07"\n'
                                       "    get\x1b[1m (queue.py:171)\n")
    with open(os.path.join(os.fsencode(folder), b"binary-\x9b2J-\xff"), "wb") as binary:
        binary.write(b"\x00\x01\x02")
    named = os.path.join(os.fsencode(tmp_path), b"\x9b31m-\xff\xe2\x80\xae.log")  # ... and U+202E
    with open(named, "wb") as file:
        file.write(log.encode())
    runs = [subprocess.run([sys.executable, "-m", "watchdog", *verb, *given], capture_output=True, cwd=REPO,
                           timeout=120) for given in ([os.fsencode(folder), named], [named])]  # alone: its title
    assert b"skipped" in runs[0].stderr
    for done in runs:
        assert done.returncode == 0, done.stderr[-2000:]
        assert printable(done.stdout) and printable(done.stderr), (done.stdout[-400:], done.stderr[-400:])


def test_random_bytes_are_refused_not_analysed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Random bytes with no NUL and no invalid UTF-8 (what a 60 MB binary looks like once decoded with
    replacement); and random bytes, plain. Neither is a picture: refused with why."""
    rng = random.Random(40)
    plain = rng.randbytes(8 * MIB)
    text = bytes(rng.choice(b"ab cdefghij(0123456789):\n\"'_.-/[]{}") for _ in range(2 * MIB))
    for name, data in (("random.bin", plain), ("random.txt", text)):
        (tmp_path / name).write_bytes(data)
        code = main(["analyze", "--json", str(tmp_path / name)])
        out, err = capsys.readouterr()
        assert code != 0 and not out and "skipped" in err, (name, out[:500])


def test_one_run_reads_a_bounded_total_and_says_what_it_left_out(tmp_path: Path) -> None:
    """A folder of 12 logs of 16 MiB: one run reads at most its total cap, says on stderr which files it left
    out, and its memory stays bounded (of a log, what the timeout reader can use is kept, not its text)."""
    folder = tmp_path / "logs"
    folder.mkdir()
    line = "2026-11-26 22:00:00 INFO iteration 10 / 1000 | loss 2.31 | lr 1e-4 | grad norm 0.5 | tokens 4096\n"
    body = (line * (16 * MIB // len(line))).encode()
    for n in range(12):
        (folder / f"rank{n:02d}.log").write_bytes(body + TIMEOUT_LINE.format(rank=n).encode())
    found = measure("""
import contextlib, io
from watchdog.cli import main
err = io.StringIO()
with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    main(["analyze", args["path"]])
outcome = err.getvalue()
""", {"path": str(folder)})
    err = str(found["outcome"])
    assert "left out" in err and "rank11.log" in err, err[-2000:]
    assert float(found["grew_mib"]) < 200, found  # type: ignore[arg-type]  # the logs' timeout lines kept, not their text


_NESTED = b")" + b"2\x86" * 80  # EMPTY_TUPLE, then (t, t) 80 times: DUP, TUPLE2
_HASHED = {  # the ways a pickle puts a value where it is hashed
    "SETITEM": b"}" + _NESTED + b"N" + b"s.",
    "SETITEMS": b"}" + b"(" + _NESTED + b"N" + b"u.",
    "DICT": b"(" + _NESTED + b"N" + b"d.",
    "ADDITEMS": b"\x8f" + b"(" + _NESTED + b"\x90.",
    "FROZENSET": b"(" + _NESTED + b"\x91.",
}


@pytest.mark.parametrize("way", sorted(_HASHED))
def test_a_tiny_pickle_whose_key_takes_for_ever_to_hash_is_read_at_once(tmp_path: Path, way: str) -> None:
    """A tuple of tuples that share themselves through the memo, 80 levels deep, is 170 bytes and 2^80 steps
    to hash, with the interpreter's lock held (every thread of the daemon stopped); a million nested tuples
    overflow the C stack when hashed (the daemon dies). Such a key is never hashed: it stands as a key of its
    own, which readers drop, by `analyze` as by the daemon's reader (the same one)."""
    for name, nested in (("shared", _NESTED), ("deep", b")" + b"\x85" * 300_000)):
        dump = tmp_path / f"{name}-{way}" / "rank0.pkl"
        dump.parent.mkdir()
        dump.write_bytes(b"\x80\x04" + _HASHED[way].replace(_NESTED, nested))
        try:
            done = subprocess.run([sys.executable, "-c", "import sys;"
                                   " from watchdog.boundary.untrusted_data import loads_pickle;"
                                   " print(type(loads_pickle(open(sys.argv[1], 'rb').read())).__name__)", str(dump)],
                                  capture_output=True, text=True, timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name}, {way}: still hashing after 20 s")
        assert done.returncode == 0, (name, way, done.returncode, done.stderr[-300:])
        assert done.stdout.strip() in ("dict", "set", "frozenset"), done.stdout
        analysed = subprocess.run([sys.executable, "-m", "watchdog", "analyze", str(dump)], capture_output=True,
                                  text=True, timeout=20)
        assert analysed.returncode in (0, 1, 3) and "Traceback" not in analysed.stderr, analysed.stderr[-300:]


def test_a_job_bundle_is_read_within_the_runs_total(tmp_path: Path) -> None:
    """A job bundle's node files count against the run's total like any file: 20 names of one 20 MiB node file
    (hard links cost no disk) are not all read and held at once."""
    bundle = tmp_path / "job"
    (bundle / "nodes").mkdir(parents=True)
    (bundle / "job.json").write_text(json.dumps({"training_job": "run:j", "odd_ranks": [], "rank_placement": {}}))
    pad = "x" * (20 * MIB)
    first = bundle / "nodes" / "n00.json"
    first.write_text(json.dumps({"instance": "h0:1", "status": 200, "error": None,
                                 "answer": {"node": "n", "pad": pad}}))
    for n in range(1, 20):
        os.link(first, bundle / "nodes" / f"n{n:02d}.json")
    found = measure("""
import contextlib, io
from watchdog.cli import main
err = io.StringIO()
with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    main(["analyze", args["path"]])
outcome = err.getvalue()
""", {"path": str(bundle)})
    assert "left out" in str(found["outcome"]), found
    assert float(found["grew_mib"]) < 300, found  # type: ignore[arg-type]


def test_a_job_verdict_elsewhere_does_not_read_its_folder(tmp_path: Path) -> None:
    """A JSON file shaped like a job verdict but not a bundle's job.json (say, in /tmp) is not a reason to read
    the job.json and nodes/ beside it, which anyone may have planted there."""
    (tmp_path / "nodes").mkdir()
    (tmp_path / "job.json").write_text(json.dumps({"training_job": "run:planted", "odd_ranks": []}))
    mine = tmp_path / "verdict.json"
    mine.write_text(json.dumps({"training_job": "run:mine", "odd_ranks": []}))
    done = subprocess.run([sys.executable, "-m", "watchdog", "analyze", str(mine)], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert "run:planted" not in done.stdout + done.stderr, done.stdout
    assert "job bundle's folder" in done.stderr, done.stderr


def test_a_new_line_in_a_name_from_py_spys_json_forges_no_line(tmp_path: Path) -> None:
    """py-spy's JSON carries the names a rank chose: a function or thread name holding new lines is kept as one
    line (its control characters written as \\xNN), so it cannot print a line of its own in a report."""
    forged = "get\n\njob forged\n  NO_STALL: the job was making progress\n"
    threads = [{"pid": 100 + n, "thread_id": 1, "os_thread_id": 100 + n, "thread_name": "Main\nThread",
                "active": False, "frames": [{"name": forged if n == 2 else "all_reduce", "filename": "c10d.py",
                                             "line": 1}, {"name": "train", "filename": "train.py", "line": 9}]}
               for n in range(3)]
    dump = tmp_path / "pyspy.json"
    dump.write_text(json.dumps(threads))
    for verb in (["stacks", "analyze"], ["analyze"]):
        done = subprocess.run([sys.executable, "-m", "watchdog", *verb, str(dump)], capture_output=True, text=True,
                              timeout=60, cwd=REPO)
        lines = done.stdout.splitlines()
        assert lines and not any(line.lstrip().startswith(("job forged", "NO_STALL")) for line in lines), done.stdout
        assert "\\x0ajob forged" in done.stdout, done.stdout
