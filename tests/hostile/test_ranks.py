"""A training rank as an adversary of the root daemon: the files its environment names (a FIFO, `..`, links,
a link swapped between calls, a chroot), the Flight Recorder dump it writes (a memo bomb, nonsense), what
it makes py-spy print, the RAS address and reply it offers, the digits it claims."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import pickletools
import stat
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.users import asleep
from watchdog.boundary import rank_files
from watchdog.plumbing import logfmt
from watchdog.sample.ranks import RankInfo, number
from watchdog.stacks import fr_dumps, fr_matching, nccl_ras, ras_report
from watchdog.stacks.capture import FAILED, OK, StackCapturer, Target
from watchdog.stacks.flight_recorder import collect, trigger


def rank(pid: int, env: dict[str, str]) -> RankInfo:
    return RankInfo(pid, 0.0, (), (0,), {"RANK": "0", "WORLD_SIZE": "2", **env}, None)


def memo_bomb(levels: int) -> bytes:
    """A pickle whose `input_sizes` shares one list ten times per level through the memo."""
    inner: object = [0] * 10
    for _ in range(levels):
        inner = [inner] * 10
    entry = {"pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": 1, "profiling_name":
             "nccl:all_reduce", "state": "scheduled", "input_sizes": inner}
    return pickletools.optimize(pickle.dumps({"version": "2.7", "entries": [entry] * 3, "pg_config": {}}, 2))


def test_a_pickle_memo_bomb_is_kept_bounded() -> None:
    data = memo_bomb(9)  # 10**10 leaves once unfolded
    assert len(data) < 600
    started = time.process_time()  # CPU seconds: what the parse costs, whatever else the machine runs
    trace = fr_dumps.parse(data, rank=0, source="bomb")
    written = json.dumps(trace.to_json())
    assert len(written) < 200_000, len(written)
    assert time.process_time() - started < 5
    assert fr_matching.analyze([trace]).groups  # still a trace that matching reads


@pytest.mark.parametrize("payload", [
    {"entries": [{"collective_seq_id": 2**200, "profiling_name": ["x"] * 5}], "pg_config": {}},
    {"entries": [{"collective_seq_id": float("nan"), "state": b"bytes", "process_group": [[1], {}]}]},
    {"entries": [{"pg_id": 0, "collective_seq_id": 1}], "pg_config": {"0": {"ranks": "9" * 5000}}},
    {"entries": [{"pg_id": 0, "collective_seq_id": 1}], "pg_status": {"0": {"last_completed_collective": 2**70}}},
    {"entries": "not a list"},
])
def test_nonsense_in_a_dump_is_dropped_not_a_traceback(payload: dict[str, object]) -> None:
    data = pickle.dumps(payload, 2)
    try:
        trace = fr_dumps.parse(data, rank=1, source="odd")
    except fr_dumps.FlightRecorderError:
        return
    json.dumps(trace.to_json(), allow_nan=False)
    fr_matching.analyze([trace])


def test_hostile_traces_in_a_node_answer_are_errors() -> None:
    for raw in ({"rank": float("inf")}, {"rank": "1e999"}, {"rank": -3}, {"rank": 2**40},
                {"rank": 1, "groups": [1, 2]}, {"rank": 1, "entries": {"a": 1}}):
        try:
            fr_dumps.RankTrace.from_json(raw)
        except fr_dumps.FlightRecorderError:
            continue


def test_a_fifo_where_the_dump_should_be_never_hangs(tmp_path: Path) -> None:
    fifo = tmp_path / "nccl_trace_rank_0"
    os.mkfifo(fifo)
    asked = trigger_result(str(fifo))
    traces, problems = collect([asked], time.time() - 10, timeout_seconds=1.0)  # returns: a FIFO is never opened
    assert traces == [] and "not a regular file" in problems[0] and "named pipe" in problems[0]


def trigger_result(dump: str):  # type: ignore[no-untyped-def]
    from watchdog.stacks.flight_recorder import FlightRecorder

    return FlightRecorder(os.getpid(), 0, "triggered", "asked", dump)


def test_dotdot_and_links_in_a_rank_path_are_refused(tmp_path: Path) -> None:
    (tmp_path / "real").write_bytes(b"x")
    (tmp_path / "link").symlink_to("/etc/hostname")
    (tmp_path / "dir-link").symlink_to(tmp_path)
    pid = os.getpid()
    for path, why in ((f"{tmp_path}/../{tmp_path.name}/real", "'..'"), (f"{tmp_path}/link", "symbolic link"),
                      (f"{tmp_path}/dir-link/real", "symbolic link")):
        with pytest.raises(rank_files.RankFileError, match=why):
            rank_files.read(pid, path, 1024)
    assert rank_files.read(pid, f"{tmp_path}/real", 1024).data == b"x"
    with pytest.raises(rank_files.RankFileError, match="cap"):
        rank_files.read(pid, f"{tmp_path}/real", 0)


def test_a_link_swapped_under_the_pipe_never_gets_written(tmp_path: Path) -> None:
    """The rank swaps its pipe's name between a FIFO and a link to a file it does not own. Root must never
    write into that file, whichever the name points at when it looks."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"ORIGINAL")
    victim.chmod(0o600)
    fifo = tmp_path / "real.pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # someone listens, as PyTorch's thread does
    name = tmp_path / "pipe0.pipe"
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            for target in (fifo, victim):
                tmp = tmp_path / "next"
                tmp.unlink(missing_ok=True)
                tmp.symlink_to(target)
                os.replace(tmp, name)

    swapper = threading.Thread(target=swap)
    swapper.start()
    try:
        env = {"TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(tmp_path / "pipe"), "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}
        results = {trigger(rank(os.getpid(), env)).result for _ in range(300)}
    finally:
        stop.set()
        swapper.join()
        os.close(reader)
    assert victim.read_bytes() == b"ORIGINAL"
    assert results <= {"failed", "no_pipe"}, results  # a link is never followed, to the pipe or the file


def test_a_real_pipe_is_triggered(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe0.pipe")
    reader = os.open(tmp_path / "pipe0.pipe", os.O_RDONLY | os.O_NONBLOCK)
    try:
        env = {"TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(tmp_path / "pipe"), "TORCH_NCCL_TRACE_BUFFER_SIZE": "20"}
        found = trigger(rank(os.getpid(), env))
        assert found.result == "triggered" and os.read(reader, 10) == b"1\n"
    finally:
        os.close(reader)
    (tmp_path / "file0.pipe").write_bytes(b"")
    env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] = str(tmp_path / "file")
    assert trigger(rank(os.getpid(), env)).result == "failed"


@pytest.mark.skipif(os.geteuid() != 0, reason="a chrooted rank needs root to chroot")
def test_a_chrooted_rank_is_read_in_its_own_root_only(tmp_path: Path) -> None:
    jail = tmp_path / "jail"
    (jail / "tmp").mkdir(parents=True)
    (jail / "tmp" / "nccl_trace_rank_0").write_bytes(b"inside")
    (tmp_path / "outside").write_bytes(b"HOST SECRET")
    child = os.fork()
    if child == 0:  # the rank: chroot and wait
        try:
            os.chroot(jail)
            time.sleep(30)
        finally:
            os._exit(0)
    try:
        time.sleep(0.3)
        assert rank_files.read(child, "/tmp/nccl_trace_rank_0", 100).data == b"inside"
        with pytest.raises(rank_files.RankFileError):
            rank_files.read(child, "/../outside", 100)
        with pytest.raises(rank_files.RankFileError, match="'..'"):
            rank_files.read(child, "/tmp/../../outside", 100)
        (jail / "tmp" / "escape").symlink_to(tmp_path / "outside")
        with pytest.raises(rank_files.RankFileError, match="symbolic link"):
            rank_files.read(child, "/tmp/escape", 100)
        with pytest.raises(rank_files.RankFileError, match="No such file"):
            rank_files.read(child, str(tmp_path / "outside"), 100)  # a host path does not exist in the jail
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)


def fake_py_spy(tmp: Path, body: str) -> list[str]:
    script = tmp / "py-spy"
    script.write_text(f"import sys, json, os\n{body}\n")
    return [sys.executable, str(script)]


def test_py_spy_that_prints_without_end_is_cut_off(tmp_path: Path) -> None:
    command = fake_py_spy(tmp_path, "chunk = b'x' * 65536\nwhile True:\n    sys.stdout.buffer.write(chunk)\n")
    capture = StackCapturer(command, timeout_seconds=20).capture_one(Target(os.getpid(), 0))
    assert capture.result == FAILED and "MiB" in capture.message and capture.raw is None  # cut at the cap


def test_long_names_and_deep_stacks_are_trimmed(tmp_path: Path) -> None:
    command = fake_py_spy(tmp_path, (
        "frames = [{'name': 'f' * 300, 'filename': 'x.py', 'line': 1}] * 140\n"
        "threads = [{'pid': int(sys.argv[sys.argv.index('--pid') + 1]), 'thread_id': n, 'thread_name': 'T' * 9000,"
        " 'active': True, 'frames': frames} for n in range(260)]\n"
        "print(json.dumps(threads + [1, 'x', {'frames': 'abc'}]))\n"
        "print(os.environ.get('SECRET_FOR_TEST', 'no secret'), file=sys.stderr)\n"))
    os.environ["SECRET_FOR_TEST"] = "hunter2"
    try:
        capture = StackCapturer(command, timeout_seconds=20).capture_one(Target(os.getpid(), 0))
    finally:
        del os.environ["SECRET_FOR_TEST"]
    assert capture.result == OK and capture.raw is not None and capture.dump is not None
    assert len(capture.raw) <= 256 and all(len(t["frames"]) <= 128 for t in capture.raw)  # type: ignore[arg-type]
    assert len(json.dumps(capture.raw)) < 4 * 2**20
    assert max(len(f.function) for t in capture.dump.threads for f in t.frames) <= 256
    assert max(len(t.name or "") for t in capture.dump.threads) <= 256


def test_py_spy_gets_none_of_the_daemons_secrets(tmp_path: Path) -> None:
    out = tmp_path / "env.json"
    command = fake_py_spy(tmp_path, f"open({str(out)!r}, 'w').write(json.dumps(dict(os.environ)))\nprint('[]')")
    os.environ["RECEIVER_TOKEN_FOR_TEST"] = "hunter2"
    try:
        StackCapturer(command, timeout_seconds=20).capture_one(Target(os.getpid(), 0))
    finally:
        del os.environ["RECEIVER_TOKEN_FOR_TEST"]
    seen = json.loads(out.read_text())
    assert "RECEIVER_TOKEN_FOR_TEST" not in seen and "PATH" in seen


@pytest.mark.parametrize("reply", [
    "{" * 100_000,
    '{"communicators": [{"hash": "a", "size": "abc", "ranks": []}]}',
    '{"communicators": [{"hash": "a", "size": 1e999, "ranks": []}]}',
    '{"communicators": [{"hash": "a", "ranks": [{"rank": 0, "collective_counts": {"AllReduce": '
    + "9" * 5000 + '}}]}]}',
])
def test_hostile_ras_replies_are_errors(reply: str) -> None:
    with pytest.raises(nccl_ras.RasError):
        ras_report.parse(reply)


def test_a_ras_text_line_with_a_number_past_any_rank_is_prose() -> None:
    status = ras_report.parse("Job summary\n#0-1 (abc) MISMATCH\n  Communicator ranks have different AllReduce "
                            "operation counts\n    Rank " + "7" * 5000 + " has launched up to operation 3 -- "
                            "[process information not found]\n")
    assert all(not c.ranks for c in status.communicators)


def test_ras_text_cannot_carry_markup_into_the_verdict() -> None:
    status = ras_report.parse('{"communicators": [{"hash": "<!channel>", "size": 2, "ranks": [{"rank": 0, '
                            '"host": "<http://evil|click>", "collective_counts": {"AllReduce": 3}}]}]}')
    text = json.dumps([c.hash for c in status.communicators] + [r.host for c in status.communicators
                                                                   for r in c.ranks])
    assert "<" not in text and ">" not in text and "|" not in text


def test_digits_from_other_scripts_are_not_ranks() -> None:
    assert [number(t) for t in ("²", "٣", "3", " 4 ", "-1", "9" * 30, "", None)] == \
        [None, None, 3, 4, None, None, None, None]
    info = RankInfo(1, 0.0, (), (), {"LOCAL_RANK": "²", "RANK": "٣", "WORLD_SIZE": "2"}, None)
    assert info.rank is None and info.local_rank is None


def test_log_lines_escape_what_a_rank_chose() -> None:
    line = logfmt.line("info", "x", where="train\r\nlevel=error event=forged\x1b[2J")
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert line == 'level=info event=x where="train\\x0d\\nlevel=error event=forged\\x1b[2J"'


def test_a_dump_file_that_never_ends_is_refused() -> None:
    with pytest.raises(fr_dumps.FlightRecorderError, match="not a regular file"):
        fr_dumps.read("/dev/zero")
    assert stat.S_ISCHR(os.stat("/dev/zero").st_mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="a rank of another user needs root to start")
def test_root_never_reads_for_a_rank_a_file_that_is_not_its_own(tmp_path: Path) -> None:
    """A rank running as nobody names a root-owned 0600 file as its dump: not read."""
    import subprocess

    secret = tmp_path / "dump0"
    secret.write_bytes(pickle.dumps({"entries": [{"profiling_name": "SECRET-OF-ROOT"}]}, 2))
    secret.chmod(0o600)
    tmp_path.chmod(0o755)
    rank_process = subprocess.Popen(["sleep", "30"], user=65534)
    try:
        time.sleep(0.2)
        with pytest.raises(rank_files.RankFileError, match="not by the rank's user"):
            rank_files.read(rank_process.pid, str(secret), 1 << 20)
        assert rank_files.read(os.getpid(), str(secret), 1 << 20).data  # its owner's rank reads it
    finally:
        rank_process.kill()
        rank_process.wait()


def test_a_nine_byte_pickle_cannot_make_the_daemon_allocate() -> None:
    """LONG_BINPUT 4294967295: the C unpickler would size its memo table for it (about 64 GiB)."""
    import resource
    import struct

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(fr_dumps.FlightRecorderError):
        fr_dumps.parse(b"\x80\x02N" + b"r" + struct.pack("<I", 2**32 - 1) + b".", 0, "bomb")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024  # KiB


def test_keys_that_cannot_be_text_are_dropped_not_fatal() -> None:
    data = pickle.dumps({"entries": [], "pg_status": {10**5000: {}, "0": {10**5000: 1, "x": 2}},
                         "pg_config": {10**5000: {"ranks": [1]}, ((1,) * 1000,): {}}}, 2)
    trace = fr_dumps.parse(data, 0, "keys")
    assert trace.status == {"0": {"x": 2}} and trace.groups == {}


def test_ras_replies_built_to_backtrack_are_read_in_linear_time() -> None:
    replies = ["#0-0 (abc) MISMATCH\n  Communicator ranks have different AllReduce operation counts\n  Rank 1 -- GPU "
               + "1" * 200_000 + "\n",
               '{"a": "nvml_dev":1' + "\n" * 200_000,
               '{"communicators": [{"hash": "a", "ranks": ['
               + ",".join(f'{{"rank": {r}, "collective_counts": {{"op{r}": 1, "AllReduce": {r % 2}}}}}'
                          for r in range(4000)) + "]}]}"]
    for reply in replies:
        started = time.process_time()  # CPU seconds of the parse
        with contextlib.suppress(nccl_ras.RasError):
            ras_report.behind(ras_report.parse(reply))
        assert time.process_time() - started < 2, reply[:40]


def test_a_job_id_claimed_past_any_reason_is_bounded_and_still_tells_jobs_apart() -> None:
    """TORCHELASTIC_RUN_ID, MASTER_ADDR and SLURM_JOB_ID are the rank's to set: a 131,000-character or
    unprintable claim becomes a bounded, printable job key (a metric and alert label), and two claims that
    share a long head stay two jobs."""
    from watchdog.sample.ranks import JOB_KEY_MAX

    def key(**env: str) -> str:
        return RankInfo(1, 0.0, (), (), env, None).job_key

    long_a, long_b = "j" * 131_000, "j" * 130_999 + "k"
    for claim in ({"TORCHELASTIC_RUN_ID": long_a}, {"MASTER_ADDR": long_a, "MASTER_PORT": "29500"},
                  {"SLURM_JOB_ID": long_a}, {"TORCHELASTIC_RUN_ID": "job\nlevel=error fake=1"}):
        found = key(**claim)
        assert len(found) <= JOB_KEY_MAX + len("master:") and found.isprintable(), found[:80]
    assert key(TORCHELASTIC_RUN_ID=long_a) != key(TORCHELASTIC_RUN_ID=long_b)
    assert key(TORCHELASTIC_RUN_ID=long_a) == key(TORCHELASTIC_RUN_ID=long_a)
    assert key(TORCHELASTIC_RUN_ID="job-42") == "run:job-42"  # an ordinary id is kept as it is


def test_an_environment_of_megabytes_is_read_bounded_and_never_misread(tmp_path: Path) -> None:
    """A rank makes its environment as long as it likes (the kernel bounds each string, not their number):
    what is read of /proc/<pid>/environ is bounded, the variables in its head are kept, and a variable cut at
    the bound is not read as a shorter one (RANK=1 of RANK=12...)."""
    from watchdog.sample.ranks import _ENVIRON_MAX, RankDiscovery

    filler = {f"FILLER_{n}": "x" * 100_000 for n in range(10)}  # 1.0 MB, just short of the bound
    head = len(b"".join(f"{k}={v}".encode() + b"\0" for k, v in filler.items()))
    cut_at = _ENVIRON_MAX - head  # RANK's value straddles the bound
    assert 0 < cut_at < 100_000
    env = {"WORLD_SIZE": "8", **filler, "RANK": "1" + "2" * (cut_at + 10), "LOCAL_RANK": "3"}
    with asleep(env) as process:
        started = time.process_time()  # CPU seconds of the read
        kept, problem = RankDiscovery().environment(process.pid)
        took = time.process_time() - started
    assert problem is None and took < 1.0
    assert kept.get("WORLD_SIZE") == "8"
    assert "RANK" not in kept and "LOCAL_RANK" not in kept  # cut, and past the bound: neither is read
