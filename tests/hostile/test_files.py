"""Hostile files and folders: a shared bundle directory, a half-written bundle left by a kill -9, a report
that cannot be written, links planted where `stacks dump --out` writes, traces that are not text, that
never end a line, or whose clock steps back."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, python_target
from watchdog.act.bundles import MARKER, BundleStore, Incident
from watchdog.boundary import private_files
from watchdog.config import parse_config
from watchdog.export.metrics import new_counters
from watchdog.vocabulary.model import EpisodeEvent, EventKind, GpuSample, NodeSnapshot, Severity, Signature


def event(onset: float) -> EpisodeEvent:
    return EpisodeEvent(EventKind.FIRED, Signature.BUSY_SPIN, Severity.CRITICAL, (0, 1), (), onset, onset + 30,
                        "HANG (critical): GPUs 0, 1 spin", key=f"busy_spin@{onset:.0f}", headline="HANG (critical)")


def store(root: Path, render: object = None, **cfg: object) -> BundleStore:
    config = parse_config({"bundles": {"directory": str(root), **cfg}}).bundles
    return BundleStore(config, new_counters(), render_report=render)  # type: ignore[arg-type]


def test_rotation_removes_only_what_the_daemon_wrote(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    for foreign in ("home-backup", "aaa-important-data", "20200101T000000Z-busy_spin-gpu0"):  # the last: no marker
        (shared / foreign).mkdir(parents=True)
        (shared / foreign / "data").write_text("keep me")
    bundles = store(shared, max_count=1)
    for n in range(3):
        assert bundles.write(Incident(event(1.9e9 + 100 * n), [])) is not None
    left = sorted(p.name for p in shared.iterdir())
    assert {"home-backup", "aaa-important-data", "20200101T000000Z-busy_spin-gpu0"} <= set(left)
    assert len(bundles.bundles()) == 1 and all((shared / f / "data").exists() for f in ("home-backup",))


def test_no_disk_budget_keeps_every_bundle_and_a_refusal_names_its_setting(tmp_path: Path) -> None:
    """max_total_bytes 0 is no disk budget, for the rotation as for each bundle's writes (rotation removed every
    bundle but the newest); a write past a bundle's budget names the setting that set it."""
    bundles = store(tmp_path / "none", max_total_bytes=0)
    for n in range(3):
        assert bundles.write(Incident(event(1.9e9 + 100 * n), [])) is not None
    assert len(bundles.bundles()) == 3
    budget = private_files.Budget(10, "bundles.max_bundle_bytes")
    with pytest.raises(private_files.OverBudget, match=r"budget of 10 bytes \(bundles.max_bundle_bytes, 0 spent\)"):
        budget.take(11, tmp_path / "telemetry.jsonl")


def test_a_half_written_bundle_from_a_killed_daemon_is_counted_and_cleaned(tmp_path: Path) -> None:
    root = tmp_path / "incidents"
    leftover = root / ".partial-20260101T000000Z-busy_spin-gpu0-1-999999"
    leftover.mkdir(parents=True)
    (leftover / MARKER).write_text("{}")
    (leftover / "telemetry.jsonl").write_bytes(b"x" * 10_000)
    foreign = root / ".partial-something-else"  # not ours: no marker
    foreign.mkdir()
    bundles = store(root)
    assert bundles.disk_bytes() >= 10_000  # inside the budget's count
    bundles.write(Incident(event(1.9e9), []))
    assert not leftover.exists() and foreign.exists()


def test_bundle_sizes_are_walked_again_only_when_a_bundle_changed(tmp_path: Path, monkeypatch) -> None:
    """The disk the bundles take is published every half minute: each bundle is walked once, and again only once
    it changed (an action recorded, evidence kept, one removed by hand), and the total stays right."""
    from watchdog.act import bundles as module

    walked: list[Path] = []
    walk = module._size
    monkeypatch.setattr(module, "_size", lambda path: walked.append(path) or walk(path))
    bundles = store(tmp_path / "incidents", max_count=20)
    written = [bundles.write(Incident(event(1.9e9 + 100 * n), [])) for n in range(3)]
    assert all(written)
    first = bundles.disk_bytes()
    walked.clear()
    assert bundles.disk_bytes() == first and walked == []  # nothing changed: no walk
    bundles.record_action(str(written[1]), {"decision": "x" * 5000})
    after = bundles.disk_bytes()
    assert walked == [written[1]] and after >= first + 5000  # the one changed, walked again
    walked.clear()
    shutil.rmtree(written[0])  # removed by hand: gone from the total without a walk
    gone = bundles.disk_bytes()
    assert walked == [] and gone < after and gone == sum(walk(p) for p in written[1:])
    with (written[2] / "summary.json").open("a") as grown:  # grown in place by hand: seen at the next rewalk
        grown.write(" " * 7000)
    then = bundles._sizes[written[2]][0][1]
    os.utime(written[2] / "summary.json", ns=(then, then))  # as a write that keeps the mtime (tar, rsync -t)
    assert bundles.disk_bytes() == gone
    clock = time.monotonic() + module.REWALK_SECONDS
    monkeypatch.setattr(module.time, "monotonic", lambda: clock)
    assert bundles.disk_bytes() == gone + 7000


def test_a_report_that_cannot_be_written_makes_the_bundle_partial(tmp_path: Path) -> None:
    def full_disk(folder: Path) -> None:
        (folder / "report.html").write_bytes(b"")
        raise OSError(28, "No space left on device")

    bundles = store(tmp_path / "incidents", render=full_disk)
    assert bundles.write(Incident(event(1.9e9), [])) is not None
    assert bundles.counters.get("bundles_total", "partial") == 1
    assert bundles.counters.get("bundles_total", "written") == 0


def test_stacks_dump_out_never_writes_through_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / "analysis.json").symlink_to(victim)
    with python_target("queue", tmp_path) as process:
        result = subprocess.run([sys.executable, "-m", "watchdog", "stacks", "dump", "--pid", str(process.pid),
                                 "--out", str(out)], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert victim.read_text() == "precious"  # the link is replaced by the file, never written through
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert not (out / "analysis.json").is_symlink() and (out / "analysis.json").stat().st_mode & 0o777 == 0o600


def test_stacks_dump_out_at_a_file_is_a_clear_error_and_new_folders_are_private(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("")
    with python_target("queue", tmp_path) as process:
        bad = subprocess.run([sys.executable, "-m", "watchdog", "stacks", "dump", "--pid", str(process.pid),
                              "--out", str(a_file)], capture_output=True, text=True, cwd=REPO, timeout=60)
        good = subprocess.run([sys.executable, "-m", "watchdog", "stacks", "dump", "--pid", str(process.pid),
                               "--out", str(tmp_path / "new")], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert bad.returncode == 1 and "cannot write there" in bad.stderr and "Traceback" not in bad.stderr
    assert good.returncode == 0 and (tmp_path / "new").stat().st_mode & 0o777 == 0o700


def replay(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "watchdog", "replay", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_traces_that_are_not_text_are_a_clear_error(tmp_path: Path) -> None:
    binary = tmp_path / "trace.csv"
    binary.write_bytes(b"timestamp, index, utilization.gpu [%]\n" + bytes(range(256)) * 4 + b"\n")
    jsonl = tmp_path / "trace.jsonl"
    jsonl.write_bytes(b'{"stall_watchdog_recording": 1}\n\xff\xfe\x00garbage\n')
    for trace in (binary, jsonl):
        for lenient in ([], ["--lenient"]):
            result = replay(str(trace), *lenient)
            assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
            assert re.search(r"trace\.(csv|jsonl):\d+: ", result.stderr) or "no samples" in result.stderr
    assert "not UTF-8 text" in replay(str(jsonl)).stderr


def test_a_line_that_never_ends_is_bounded(tmp_path: Path) -> None:
    result = replay("/dev/zero")
    assert result.returncode == 1 and "longer than 1 MiB" in result.stderr and "Traceback" not in result.stderr
    huge = tmp_path / "huge.jsonl"
    huge.write_text('{"stall_watchdog_recording": 1}\n{"t": 1, "gpus": {"index": [' + "0," * 3_000_000 + "0]}}\n")
    result = replay(str(huge))
    assert result.returncode == 1 and ":2: line longer than" in result.stderr
    result = replay("/dev/zero", "--lenient")  # skipping it never ends: bounded too
    assert result.returncode == 1 and "no end of line in 64 MiB" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("where", ["middle", "last"])
def test_lenient_skips_a_line_over_1_mib_and_reads_on(tmp_path: Path, where: str) -> None:
    rows = [f"2026/01/01 00:{m:02d}:{s:02d}.000, 0, 100 %, 150.0 W, 40000 MiB" for m in range(2) for s in range(60)]
    junk = "x" * (3 << 20)
    lines = ["timestamp, index, utilization.gpu [%], power.draw [W], memory.used [MiB]",
             *rows[:60], junk, *rows[60:]] if where == "middle" else [
             "timestamp, index, utilization.gpu [%], power.draw [W], memory.used [MiB]", *rows, junk + "\n" + junk]
    log = tmp_path / "long.csv"
    log.write_text("\n".join(lines) + "\n")
    strict = replay(str(log))
    number = 62 if where == "middle" else 122
    assert strict.returncode == 1 and f"long.csv:{number}: line longer than 1 MiB" in strict.stderr, strict.stderr
    assert "--lenient" in strict.stderr
    lenient = replay(str(log), "--lenient")
    assert lenient.returncode in (0, 2) and "Traceback" not in lenient.stderr, lenient.stderr[-2000:]
    skipped = 1 if where == "middle" else 2
    assert f"{skipped} line(s) or sample(s) skipped" in lenient.stderr, (lenient.stdout + lenient.stderr)[-2000:]
    assert "120 samples" in lenient.stdout + lenient.stderr, (lenient.stdout + lenient.stderr)[-2000:]


def test_a_byte_order_mark_and_a_report_to_a_folder(tmp_path: Path) -> None:
    log = tmp_path / "bom.csv"
    rows = "".join(f"2026/01/01 00:{m:02d}:{s:02d}.000, 0, 100 %, 150.0 W, 40000 MiB\n"
                   for m in range(2) for s in range(60))
    log.write_bytes("\ufefftimestamp, index, utilization.gpu [%], power.draw [W], memory.used [MiB]\n".encode()
                    + rows.encode())
    assert replay(str(log)).returncode == 0
    result = replay(str(log), "--report", str(tmp_path))
    assert result.returncode == 1 and "--report" in result.stderr and "Traceback" not in result.stderr


def test_a_clock_that_steps_back_an_hour_keeps_detecting(tmp_path: Path) -> None:
    """DST on a local-time log: the spin that starts after the step is still found, and the step is said once."""
    lines = []
    for t in range(0, 200):
        stamp = t if t < 100 else t - 3600  # the clock steps back an hour at t=100
        hh, rest = divmod(stamp + 7200, 3600)
        mm, ss = divmod(rest, 60)
        busy = t < 120
        for gpu in range(4):
            util, power = (98, 560.0) if busy else (100, 150.0)
            lines.append(f"2026/03/29 {hh:02d}:{mm:02d}:{ss:02d}.000, {gpu}, {util} %, {power} W, 700.00 W, "
                         f"40000 MiB\n")
    log = tmp_path / "dst.csv"
    log.write_text("timestamp, index, utilization.gpu [%], power.draw [W], enforced.power.limit [W], "
                   "memory.used [MiB]\n" + "".join(lines))
    result = replay(str(log), "--json")
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(e["event"], e["signature"], e["severity"]) for e in events][:1] == [("fired", "busy_spin", "critical")]
    assert result.stderr.count("stepped back") == 1


def test_the_recorded_host_readings_are_checked_like_the_rest(tmp_path: Path) -> None:
    from watchdog.sample import recording

    line = recording.encode(NodeSnapshot(1.0, (GpuSample(index=0, host_cpu_ratio=0.5),)))
    assert '"host_cpu_ratio":[0.5]' in line
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"stall_watchdog_recording": 1}\n' + line.replace("0.5", "-1") + "\n")
    result = replay(str(bad))
    assert result.returncode == 1
    assert "bad.jsonl:2: not a snapshot: expected a number >= 0.0, at gpus.host_cpu_ratio[0]" in result.stderr


def test_the_same_gpu_twice_at_one_time_is_a_malformed_row(tmp_path: Path) -> None:
    log = tmp_path / "dup.csv"
    log.write_text("timestamp, index, utilization.gpu [%], power.draw [W]\n"
                   "2026/01/01 00:00:00.000, 0, 100 %, 150 W\n2026/01/01 00:00:00.000, 0, 100 %, 150 W\n")
    result = replay(str(log))
    assert result.returncode == 1 and "dup.csv:3: GPU 0 twice at the same time" in result.stderr


def test_damaged_inputs_of_other_verbs_are_clear_errors(tmp_path: Path) -> None:
    bundle = tmp_path / "20260101T000000Z-busy_spin-gpu0"
    bundle.mkdir()
    (bundle / "summary.json").write_text("{garbage")
    (bundle / "telemetry.jsonl").write_text("")
    shapes = [tmp_path / "a.json", tmp_path / "b.json"]
    shapes[0].write_text("[1, 2, 3]")
    shapes[1].write_text('{"threads": 5}')
    runs = [["report", str(bundle)], ["record", "--simulate", "healthy", "--interval-seconds", "nan"],
            ["record", "--simulate", "healthy", "--interval-seconds", "0.000001"],
            *[["stacks", "analyze", str(p)] for p in shapes]]
    for args in runs:
        result = subprocess.run([sys.executable, "-m", "watchdog", *args], capture_output=True, text=True, cwd=REPO,
                                timeout=60)
        assert result.returncode in (1, 2) and "Traceback" not in result.stderr, (args, result.stderr[-1500:])
        assert result.stderr.startswith(("stall-watchdog: ", "usage: ")), result.stderr


def _bundle(tmp_path: Path, **files: str | bytes) -> Path:
    """A hand-made bundle: a summary and the files given (by name, `_` for `.`)."""
    bundle = tmp_path / "bundle"
    bundle.mkdir(exist_ok=True)
    for name, content in {"summary_json": "{}", **files}.items():
        path = bundle / name.replace("_", ".")
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return bundle


def _report(bundle: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "watchdog", "report", str(bundle)], capture_output=True, text=True,
                          cwd=REPO, timeout=60)


def test_a_bundles_telemetry_that_is_a_pipe_or_a_link_is_refused_not_waited_on(tmp_path: Path) -> None:
    """`report` on a FIFO at telemetry.jsonl waited for a writer for ever; through a link it read the file linked."""
    bundle = _bundle(tmp_path)
    os.mkfifo(bundle / "telemetry.jsonl")
    result = _report(bundle)
    assert result.returncode == 1 and "telemetry.jsonl: not a regular file (a named pipe)" in result.stderr, \
        result.stderr
    (bundle / "telemetry.jsonl").unlink()
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_text("")
    (bundle / "telemetry.jsonl").symlink_to(elsewhere)
    (bundle / "stacks.json").symlink_to(elsewhere)
    result = _report(bundle)
    assert result.returncode == 1 and "a symbolic link; not followed" in result.stderr, result.stderr
    assert not (bundle / "report.html").exists()


@pytest.mark.parametrize(("files", "said"), [
    ({"summary_json": "[1, 2]"}, "summary.json: holds a list where the daemon writes an object"),
    ({"summary_json": "[" * 100_000 + "]" * 100_000}, "summary.json: nested too deeply to read"),
    ({"stacks_json": '"groups"'}, "stacks.json: holds a string where the daemon writes a list"),
    ({"stacks_json": '[{"groups": ["a", "b"]}]'}, "stacks.json: groups[0]: holds a string where the daemon writes an"),
    ({"stacks_json": '[{"groups": [{"frames": ["f"]}]}]'}, "stacks.json: groups[0].frames[0]: holds a string"),
    ({"summary_json": '{"ranks": [7]}'}, "summary.json: ranks[0]: holds a number where the daemon writes an object"),
    ({"doctor_json": b"\xff\xfe"}, "doctor.json: not JSON"),
    ({"doctor_json": "[1]"}, "doctor.json: [0]: holds a number where the daemon writes an object"),
    ({"telemetry_jsonl": '{"t": "x"}\n'}, "telemetry.jsonl:1"),
    ({"telemetry_jsonl": '{"stall_watchdog_recording": 1}\n[1]\n'}, "telemetry.jsonl:2"),
    ({"summary_json": '{"actions": [{"at": 1e308}]}'}, "summary.json: actions[0].at: not a time between 1970 and"),
    ({"summary_json": '{"actions": [{"at": ' + "9" * 400 + '}]}'}, "summary.json: actions[0].at: not a time"),
    ({"summary_json": '{"event": {"onset": "not a date"}}'}, "summary.json: event.onset: not a time ('not a date')"),
    ({"summary_json": '{"event": {"onset": "9999-12-31T23:00:00-12:00"}}'}, "summary.json: event.onset: not a time"),
    ({"summary_json": '{"resolved": "yesterday"}'}, "summary.json: resolved: not a time ('yesterday')"),
])
def test_a_damaged_bundle_is_a_message_naming_its_file(tmp_path: Path, files: dict[str, str], said: str) -> None:
    """Before: AssertionError, RecursionError and AttributeError tracebacks, or an error cut at 120 characters that
    offered --lenient, an option `report` does not have."""
    result = _report(_bundle(tmp_path, **files))
    assert result.returncode == 1 and result.stderr.startswith("stall-watchdog: "), result.stderr[-2000:]
    assert said in result.stderr and "Traceback" not in result.stderr and "--lenient" not in result.stderr, \
        result.stderr[-2000:]


def test_a_bundles_file_that_is_a_socket_or_a_dangling_link_is_said_as_what_it_is(tmp_path: Path) -> None:
    """A socket at telemetry.jsonl was 'No such device or address'; a dangling link at summary.json 'no
    summary.json in it'; an empty folder name '.: not an incident bundle'."""
    import socket

    bundle = _bundle(tmp_path)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(bundle / "telemetry.jsonl"))
        result = _report(bundle)
    assert result.returncode == 1 and "telemetry.jsonl: not a regular file (a socket)" in result.stderr, \
        result.stderr
    (bundle / "telemetry.jsonl").unlink()
    (bundle / "summary.json").unlink()
    (bundle / "summary.json").symlink_to(tmp_path / "nowhere")
    result = _report(bundle)
    assert result.returncode == 1 and "summary.json: a symbolic link; not followed" in result.stderr, result.stderr
    result = subprocess.run([sys.executable, "-m", "watchdog", "report", ""], capture_output=True, text=True,
                            cwd=REPO, timeout=60)
    assert result.returncode == 1 and "give the bundle's folder" in result.stderr, result.stderr


def test_a_bundles_values_are_shown_as_text_not_as_python_writes_them(tmp_path: Path) -> None:
    """A list or an object where the daemon writes text was shown as ['x'] or {'a': 1}, a missing GPU list as
    None, an event with no GPUs titled 'incident on GPUs '; a culprit GPU of true was GPU 1."""
    summary = {"event": {"culprit_gpus": [True]}, "verdict": ["stalled", "twice"],
               "ranks": [{"pid": 7, "rank": 0, "gpus": None}],
               "actions": [{"at": 1.9e9, "decision": ["x", "y"], "reason": {"a": 1}, "steps": [{"action": None}]}]}
    bundle = _bundle(tmp_path, summary_json=json.dumps(summary))
    result = _report(bundle)
    assert result.returncode == 0, result.stderr
    page = (bundle / "report.html").read_text()
    for leak in ("[&#x27;", "{&#x27;", "None", "GPUs <", "data-culprit"):
        assert leak not in page, leak
    assert "<title>stall-watchdog: incident</title>" in page and "stalled, twice" in page and "x, y" in page


def test_a_bundles_telemetry_still_being_written_is_read_to_its_size_when_opened(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer appending to telemetry.jsonl as fast as it is read kept the page reading for ever (3 GB): here
    each stretch read appends as many lines again, up to 20,000 stretches."""
    from watchdog.export import bundle_files
    from watchdog.sample import recording

    path = tmp_path / "telemetry.jsonl"
    line = (json.dumps({"t": 1.9e9, "gpus": {"index": list(range(8)), "utilization_ratio": [0.5] * 8}}) + "\n")
    path.write_text(json.dumps({"stall_watchdog_recording": 1}) + "\n" + line * 100)
    read = recording.stretches
    appended = [0]

    def growing(*args: object, **kwargs: object) -> object:
        with path.open("a") as f:
            for stretch in read(*args, **kwargs):  # type: ignore[arg-type]
                if appended[0] < 20_000:
                    f.write(line * 8)
                    f.flush()
                    appended[0] += 1
                yield stretch

    monkeypatch.setattr(recording, "stretches", growing)
    assert len(bundle_files.telemetry(path)) == 100 and appended[0] < 20_000, appended


def test_a_dump_bundle_without_telemetry_gets_its_page_saying_so(tmp_path: Path) -> None:
    """A dump's bundle has no telemetry.jsonl: it was refused as 'no summary.json and telemetry.jsonl'."""
    bundle = _bundle(tmp_path, summary_json=json.dumps({"event": {"signature": "busy_spin", "gpus": [0]}}))
    result = _report(bundle)
    assert result.returncode == 0, result.stderr
    assert "No snapshot to draw" in (bundle / "report.html").read_text()
