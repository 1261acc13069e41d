"""The command as a user runs it: a real subprocess, real files, exit codes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, realdata

SCHEMA = {"event", "signature", "severity", "gpus", "culprit_gpus", "onset", "at", "summary"}


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "watchdog", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def test_replay_json_schema_on_a_scenario() -> None:
    result = cli("replay", "sim:odd_rank", "--json")
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert [e["event"] for e in events] == ["fired", "escalated"]
    for e in events:
        assert e.keys() >= SCHEMA
        assert e["signature"] == "waiting" and e["culprit_gpus"] == [4]
        assert e["onset"] == "2026-01-01T00:04:59.500+00:00"  # halfway from the last sample before it (300 s)
    assert events[1]["severity"] == "critical"


def test_replay_text_timeline() -> None:
    result = cli("replay", "sim:spin_hang")
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert "FIRED" in lines[0] and "busy_spin" in lines[0] and "HANG (critical): GPUs 0-7 spin at 100% util" in lines[0]
    assert "1 episode fired: 1 critical, 0 warning" in lines[-1]
    assert "Still open at the end: busy_spin (critical) on GPUs 0-7" in lines[-1]


def test_replay_real_nvidia_smi_log_names_times_as_in_the_trace() -> None:
    path = realdata("telemetry", "grantwilkins-training_profile", "h100-traces", "ckpt1.csv")
    result = cli("replay", str(path), "--json")
    assert result.returncode == 0, result.stderr
    first = json.loads(result.stdout.splitlines()[0])
    assert first["onset"].startswith("2025-07-27T00:24:") and "+" not in first["onset"]
    assert first["severity"] == "warning" and first["culprit_gpus"] == [0]


def test_replay_many_traces_one_timeline_each_in_order(tmp_path: Path) -> None:
    """Files and a folder, replayed side by side: each timeline whole and in the order given; a trace
    that cannot be read is named and the others still replay; --json names each line's trace."""
    folder = tmp_path / "logs"
    folder.mkdir()
    for name in ("spin_hang", "gpu_lost"):
        assert cli("record", "--simulate", name, "--duration-seconds", "500", "--out",
                   str(folder / f"{name}.jsonl")).returncode == 0
    (folder / "notes.md").write_text("not a trace\n")
    (tmp_path / "broken.csv").write_text("timestamp, index, power.draw [W]\n2024/01/01 00:00:00, 0, lots\n")
    result = cli("replay", "sim:odd_rank", str(folder), str(tmp_path / "broken.csv"), "--jobs", "2")
    assert result.returncode == 1
    footers = [line for line in result.stdout.splitlines() if " samples of " in line]
    assert [f.split(":")[0] for f in footers[:1]] == ["sim"] and "gpu_lost.jsonl" in footers[1]
    assert "spin_hang.jsonl" in footers[2] and len(footers) == 3
    assert "broken.csv:2: column 'power.draw [W]'" in result.stderr and "Traceback" not in result.stderr
    as_json = cli("replay", str(folder), "--json")
    traces = [json.loads(line)["trace"] for line in as_json.stdout.splitlines()]
    assert traces == sorted(traces)
    assert {Path(t).name for t in traces} == {"gpu_lost.jsonl", "spin_hang.jsonl"}
    assert cli("replay", str(folder), "--report", str(tmp_path / "r.html")).returncode == 2
    (tmp_path / "empty").mkdir()
    empty = cli("replay", str(tmp_path / "empty"))
    assert empty.returncode == 1 and "empty: no trace files in the folder" in empty.stderr


def test_record_simulated_then_replay(tmp_path: Path) -> None:
    out = tmp_path / "spin.jsonl"
    result = cli("record", "--simulate", "spin_hang", "--duration-seconds", "400", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "recorded 401 samples" in result.stderr
    header = json.loads(out.read_text().splitlines()[0])
    assert header["stall_watchdog_recording"] == 1 and header["source"] == "sim:spin_hang"
    replayed = cli("replay", str(out), "--json")
    (event,) = [json.loads(line) for line in replayed.stdout.splitlines()]
    assert event["signature"] == "busy_spin" and event["severity"] == "critical"


def test_record_without_a_driver_explains_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "live.jsonl"
    result = cli("record", "--out", str(out), "--duration-seconds", "1")
    assert result.returncode == 1
    assert "NVML could not start" in result.stderr and "--simulate" in result.stderr
    assert "Traceback" not in result.stderr and not out.exists()


def test_malformed_trace_line_is_named_and_lenient_goes_on(tmp_path: Path) -> None:
    log = tmp_path / "gpus.csv"
    log.write_text("timestamp, index, utilization.gpu [%], power.draw [W]\n"
                   "2025/01/01 00:00:00.000, 0, 100 %, 150 W\n"
                   "2025/01/01 00:00:01.000, 0, 10O %, 150 W\n"
                   "2025/01/01 00:00:02.000, 0, 100 %, 150 W\n")
    strict = cli("replay", str(log))
    assert strict.returncode == 1 and f"{log}:3: column 'utilization.gpu [%]'" in strict.stderr
    lenient = cli("replay", str(log), "--lenient")
    assert lenient.returncode == 0 and "1 line(s) or sample(s) skipped" in lenient.stderr
    assert "2 samples of 1 GPU," in lenient.stdout


def test_the_summary_counts_every_gpu_seen_not_the_most_one_sample_held(tmp_path: Path) -> None:
    """Four GPUs, each sample missing one of them in turn (a row dropped every sample): four GPUs were seen,
    though no sample holds more than three."""
    log = tmp_path / "gpus.csv"
    lines = ["timestamp, index, utilization.gpu [%], power.draw [W]"]
    for second in range(40):
        lines += [f"2025/01/01 00:00:{second:02d}.000, {gpu}, 95 %, 300 W" for gpu in range(4) if gpu != second % 4]
    log.write_text("\n".join(lines) + "\n")
    result = cli("replay", str(log))
    assert result.returncode == 0, result.stderr
    assert "40 samples of 4 GPUs," in result.stdout


@pytest.mark.parametrize("column, said", [
    ("power.draw [W]", "no power reading in the whole trace"),
    ("utilization.gpu [%]", "no utilization reading in the whole trace"),
])
def test_a_reading_the_detectors_need_never_read_is_said(tmp_path: Path, column: str, said: str) -> None:
    """Two GPUs at 100% for three minutes, with one of the readings [N/A] on every row: "0 episodes" alone would
    read as a healthy run, where the log could not show the hang."""
    header = ["utilization.gpu [%]", "power.draw [W]", "memory.used [MiB]"]
    values = {"utilization.gpu [%]": "100 %", "power.draw [W]": "90 W", "memory.used [MiB]": "40000 MiB",
              column: "[N/A]"}
    log = tmp_path / "gpus.csv"
    log.write_text("timestamp, index, " + ", ".join(header) + "\n" + "".join(
        f"2025/01/01 00:{second // 60:02d}:{second % 60:02d}.000, {gpu}, " + ", ".join(values[h] for h in header) + "\n"
        for second in range(180) for gpu in range(2)))
    result = cli("replay", str(log))
    assert result.returncode == 0, result.stderr
    assert said in result.stderr and "180 samples of 2 GPUs" in result.stdout
    clean = tmp_path / "clean.csv"
    clean.write_text(log.read_text().replace("[N/A]", "95 %" if "util" in column else "90 W"))
    assert "warning" not in cli("replay", str(clean)).stderr


def test_check_config_exit_codes(tmp_path: Path) -> None:
    good = cli("check-config", str(REPO / "config.example.yaml"))
    assert good.returncode == 0 and good.stdout.strip().endswith(": ok")
    bad = tmp_path / "bad.yaml"
    bad.write_text("detectors:\n  busy_spin:\n    for_seconds: 30s\n")
    result = cli("check-config", str(bad))
    assert result.returncode == 2
    assert f"{bad}: detectors.busy_spin.for_seconds: expected a number of seconds, got '30s'" in result.stderr


@pytest.mark.parametrize("args", [("replay", "sim:nope"), ("replay", "/nonexistent.csv")])
def test_bad_trace_is_a_runtime_failure_with_a_message(args: tuple[str, ...]) -> None:
    result = cli(*args)
    assert result.returncode == 1 and result.stderr.startswith("stall-watchdog: ")
    assert "Traceback" not in result.stderr


def test_report_says_what_it_was_given_instead_of_a_bundle(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    for given, said in ((tmp_path / "missing", "no such folder"), (tmp_path / "file", "not a folder"),
                        (tmp_path / "empty", "not an incident bundle")):
        result = cli("report", str(given))
        assert result.returncode == 1 and result.stderr.startswith(f"stall-watchdog: {given}: {said}"), result.stderr


def test_usage_errors_exit_2() -> None:
    assert cli().returncode == 2
    assert cli("replay").returncode == 2
    assert cli("record", "--interval-seconds", "0").returncode == 2


@pytest.mark.parametrize("verb", ["replay", "record", "check-config", "stacks dump", "stacks analyze", "run", "demo",
                                  "report", "doctor"])
def test_every_verb_has_help_with_an_example(verb: str) -> None:
    result = cli(*verb.split(), "--help")
    assert result.returncode == 0 and "Example" in result.stdout


def test_replay_help_lists_the_scenarios() -> None:
    assert "sim:odd_rank" in cli("replay", "--help").stdout


# -- the live record loop, through the faithful NVML fake -------------------------------------------
def test_record_live_keeps_its_cadence_and_writes_a_replayable_trace(tmp_path: Path) -> None:
    import io
    import threading

    from tests.fakes.fake_pynvml import FakeGpu, FakeNvml
    from watchdog.cli.trace import record_live
    from watchdog.sample import recording
    from watchdog.sample.nvml import NvmlSource

    source = NvmlSource(nvml=FakeNvml([FakeGpu(util_percent=100, power_mw=150_000), FakeGpu()]))
    source.open()
    out = io.StringIO()
    try:
        written, dropped = record_live(source, out.write, "now", interval=0.05, duration=0.5, stop=threading.Event())
    finally:
        source.close()
    assert dropped == 0 and written >= 10
    out.seek(0)
    snapshots = list(recording.read(out, "live.jsonl"))
    assert len(snapshots) == written - 1 and all(len(s.gpus) == 2 for s in snapshots)
    assert snapshots[0].gpus[0].power_watts == 150.0
    gaps = [b.time_seconds - a.time_seconds for a, b in zip(snapshots, snapshots[1:])]
    assert max(gaps) < 0.15, gaps  # on the monotonic schedule, no drift piling up


def test_record_to_a_full_disk_drops_lines_and_says_so() -> None:
    result = cli("record", "--simulate", "healthy", "--duration-seconds", "5", "--out", "/dev/full")
    assert result.returncode == 1
    assert "cannot write the recording" in result.stderr and "line(s) could not be written" in result.stderr
    assert result.stderr.count("cannot write the recording") == 1  # said once, not per line


def test_stacks_analyze_real_dump_json_schema() -> None:
    path = realdata("hang_stacks", "bigscience-tr11-176B-chronicles-2022-04-30-node48.txt")
    result = cli("stacks", "analyze", str(path), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert {"groups", "outliers", "summary", "verdict"} <= report.keys()
    assert report["outliers"] == ["pid 688514"]
    assert all({"members", "activity", "frames"} <= g.keys() for g in report["groups"])


def test_stacks_errors_are_clear(tmp_path: Path) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("nothing to see\n")
    result = cli("stacks", "analyze", str(bad))
    assert result.returncode == 1 and "none of the formats" in result.stderr and "Traceback" not in result.stderr
    assert cli("stacks", "dump").returncode == 2  # choose --pid, --gpu or --all
    gone = cli("stacks", "dump", "--pid", "999999")
    assert gone.returncode == 1 and "no such process: 999999" in gone.stderr
    nvml = cli("stacks", "dump", "--gpu", "0")
    assert nvml.returncode == 1 and "--gpu needs NVML" in nvml.stderr


def test_help_says_100_percent_and_a_bad_flag_shows_its_verbs_usage() -> None:
    text = " ".join(cli("--help").stdout.split())
    assert "(100% util at idle power)" in text and "%%" not in text
    bad = cli("stacks", "dump", "--all", "--bogus")
    assert bad.returncode == 2 and "usage: stall-watchdog stacks dump" in bad.stderr and "--bogus" in bad.stderr


def test_check_config_loads_the_endpoints_certificate_as_run_does(tmp_path: Path) -> None:
    """check-config builds what `run` builds (watchdog/service.py), the endpoint's TLS pair included, without
    listening: a certificate that does not load is refused before a restart finds it."""
    (tmp_path / "cert.pem").write_text("not a certificate\n")
    config = tmp_path / "config.yaml"
    config.write_text(f"export: {{listen_address: '127.0.0.1:1', tls_cert_file: '{tmp_path / 'cert.pem'}', "
                      f"tls_key_file: '{tmp_path / 'cert.pem'}'}}\n")
    done = cli("check-config", str(config))
    assert done.returncode == 2 and f"export.tls_cert_file {tmp_path / 'cert.pem'} and export.tls_key_file" in \
        done.stderr and "not a certificate and its private key in PEM" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    run = cli("run", "--config", str(config), "--max-ticks", "1")  # run refuses it the same way, before it starts
    assert run.returncode == 2 and "not a certificate and its private key in PEM" in run.stderr, run.stderr
    # A key that is not there is named, with its path, not blamed on the certificate.
    config.write_text(f"export: {{listen_address: '127.0.0.1:1', tls_cert_file: '{tmp_path / 'cert.pem'}', "
                      f"tls_key_file: '{tmp_path / 'key.pem'}'}}\n")
    done = cli("check-config", str(config))
    assert done.returncode == 2 and f"export.tls_key_file: cannot read {tmp_path / 'key.pem'}: No such file" in \
        done.stderr, done.stderr


def test_check_config_lists_every_secret_it_cannot_read_at_once(tmp_path: Path) -> None:
    """run stops at the first part it cannot build; check-config tries each on its own, so one pass shows every
    fix: two receivers' URL files, the endpoint's password, the dump token and the TLS key, all missing."""
    (tmp_path / "cert.pem").write_text("not a certificate\n")
    config = tmp_path / "config.yaml"
    config.write_text(
        "alerts:\n  receivers:\n"
        f"    - {{type: webhook, name: one, url_file: '{tmp_path / 'one.url'}'}}\n"
        f"    - {{type: webhook, name: two, url_file: '{tmp_path / 'two.url'}'}}\n"
        f"export: {{listen_address: '127.0.0.1:1', basic_auth_user: me, basic_auth_password_file: "
        f"'{tmp_path / 'password'}', tls_cert_file: '{tmp_path / 'cert.pem'}', "
        f"tls_key_file: '{tmp_path / 'key.pem'}'}}\n"
        f"dump: {{token_file: '{tmp_path / 'token'}'}}\n")
    done = cli("check-config", str(config))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    for missing in ("one.url", "two.url", "password", "token", "key.pem"):
        assert str(tmp_path / missing) in done.stderr, (missing, done.stderr)
    assert len(done.stderr.strip().splitlines()) == len(set(done.stderr.strip().splitlines())), done.stderr


def test_a_receiver_typo_lists_the_receivers_keys(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("alerts:\n  receivers:\n    - {type: webhook, name: h, url: 'http://x/', tokn_file: /x}\n")
    done = cli("check-config", str(config))
    assert done.returncode == 2
    assert "alerts.receivers.0.tokn_file: unknown key; valid keys here: type, name, url, url_file" in done.stderr


def test_analyze_reads_a_paste_on_standard_input(tmp_path: Path) -> None:
    log = "".join(f"[rank{r}]:[E ProcessGroupNCCL.cpp:632] [Rank {r}] Watchdog caught collective operation timeout: "
                  f"WorkNCCL(SeqNum={7 if r == 1 else 8}, OpType=ALLREDUCE, NumelIn=4, NumelOut=4, Timeout(ms)=600000)"
                  " ran for 600010 milliseconds before timing out.\r\n" for r in range(3))
    result = subprocess.run([sys.executable, "-m", "watchdog", "analyze", "--json", "-"], input=log, text=True,
                            capture_output=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["nccl_timeouts"]["culprits"] == [1]


def test_every_command_the_code_tells_people_to_run_parses() -> None:
    """A verdict, a hint or an error that says "run `stall-watchdog X --flag`" names a verb (and sub-verb) and
    flags that exist (a verdict once told people to run `doctor --all`; the flag is --all-ranks)."""
    import argparse
    import re

    from watchdog.cli.parser import build_parser

    def verbs(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        found: dict[str, argparse.ArgumentParser] = {}
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                found.update(action.choices)
        return found

    root = Path(__file__).resolve().parents[1] / "watchdog"
    told = {m.group(1) for path in root.rglob("*.py")
            for m in re.finditer(r"`stall-watchdog ([a-z][^`]*)`", path.read_text())}
    assert len(told) >= 10, told
    for command in sorted(told):
        words = command.split()
        parser = build_parser()
        while words and words[0] in verbs(parser):
            parser = verbs(parser)[words.pop(0)]
        assert parser is not build_parser() and parser.prog != build_parser().prog, f"no verb in `{command}`"
        flags = {flag for action in parser._actions for flag in action.option_strings}
        for word in words:
            if word.startswith("-"):
                assert word.split("=")[0] in flags, f"`stall-watchdog {command}`: {parser.prog} has no {word}"


def test_a_folders_notes_are_not_evidence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A folder of evidence with its SOURCES.md: the notes (which say "step 1 ... step 197" of the items they
    describe) are named as skipped, never read as a training log that made progress."""
    from watchdog.cli import main as cli

    (tmp_path / "SOURCES.md").write_text("- step 1: the job starts\n- step 197: the job was reported stuck\n")
    assert cli(["analyze", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "SOURCES.md: a document (.md), not evidence" in err and "nothing to analyse" in err
    timeout = Path(__file__).parent.parent / "bench" / "evidence" / "items" / "timeout"
    shutil.copy(next(timeout.glob("*.txt")), tmp_path / "rank.log")
    assert cli(["analyze", "--json", str(tmp_path)]) == 0
    assert '"kind": "hang"' in capsys.readouterr().out
    assert cli(["analyze", str(tmp_path / "SOURCES.md")]) == 0  # named on its own, it is read


def test_version_answers_without_importing_the_command() -> None:
    """`stall-watchdog --version` costs an interpreter's start, not the command's imports (the configuration,
    numpy: ~0.2 s of CPU): counted by the modules it loads, not timed."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "watchdog", "--version"], capture_output=True,
                          text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("stall-watchdog ")
    loaded = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "watchdog" in loaded and not {"numpy", "watchdog.cli", "watchdog.config"} & loaded, loaded


def test_the_commands_start_no_math_library_threads() -> None:
    """numpy's OpenBLAS started a thread per core at import (2 here; up to 64 on a large node) for matrix
    products the daemon never makes: counted as the process's threads once numpy is imported; the setting is
    not left for the programs the daemon starts."""
    code = ("import os\nos.environ.pop('OPENBLAS_NUM_THREADS', None)\nfrom watchdog.entry import one_math_thread\n"
            "one_math_thread()\nimport numpy\n"
            "print(len(os.listdir('/proc/self/task')), 'OPENBLAS_NUM_THREADS' in os.environ)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["1", "False"], done.stdout + done.stderr
