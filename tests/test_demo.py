"""The first five minutes: `stall-watchdog demo` and the README's own commands, run as written."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

from tests.conftest import REPO


def read_until(process: subprocess.Popen[str], needle: str, timeout: float, lines: list[str]) -> None:
    deadline = time.monotonic() + timeout
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip())
        if needle in line:
            return
    raise AssertionError(f"{needle!r} not printed in {timeout:.0f} s; got:\n" + "\n".join(lines))


def test_demo_names_the_stuck_rank_serves_metrics_and_cleans_up_on_ctrl_c(tmp_path: Path) -> None:
    process = subprocess.Popen([sys.executable, "-m", "watchdog", "demo", "--folder", str(tmp_path), "--port", "0"],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        read_until(process, "still serving", 150, lines)
        text = "\n".join(lines)
        assert re.search(r"^\[\s*\d+ s\] GPU util/power 0:", text, re.M)  # progress while it waits
        assert "HANG (critical): rank 4 (pid " in text and "the other 7 ranks wait for it in all_reduce" in text
        assert "culprit: rank 4 in DataLoader.__next__ -> Queue.get; its stack:" in text
        assert "Queue.get (" in text and "DataLoader.__next__ (" in text
        bundle = Path(re.search(r"^bundle:\s+(\S+)", text, re.M).group(1))  # type: ignore[union-attr]
        assert (bundle / "report.html").exists() and (bundle / "stacks.json").exists()
        url = re.search(r"^metrics: (\S+)", text, re.M).group(1)  # type: ignore[union-attr]
        with urllib.request.urlopen(url, timeout=5) as response:
            assert b'stall_watchdog_episode_culprit{gpu="4",signature="waiting"} 1.0' in response.read()
        rank_pids = [int(p) for p in re.findall(r'"pid": (\d+)', (bundle / "summary.json").read_text())]
        assert len(rank_pids) == 8
        process.send_signal(signal.SIGINT)  # Ctrl+C
        assert process.wait(timeout=30) == 0
        rest = process.stdout.read() if process.stdout else ""
        assert "stopping" in rest and "Traceback" not in rest
        alive = [p for p in rank_pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert alive == [], "the demo left ranks running"
    finally:
        if process.poll() is None:
            process.kill()


def test_readme_commands_work_on_a_clean_clone(tmp_path: Path) -> None:
    """The README's two commands, as written in its first block. The second, `make test`, is what CI runs
    (.ci/run calls it); the first is run here on a fresh clone, from creating the venv to the demo's verdict."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("```sh", 1)[1].split("```", 1)[0]  # the README's first block: its two commands
    commands = [c for line in block.strip().splitlines() if (c := line.split("#", 1)[0].strip())]
    assert commands == ["make run", "make test"]
    assert (REPO / ".ci" / "run").read_text().rstrip().endswith("make test")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    # The demo keeps its folder (its bundle and report) under $TMPDIR, as the README says: here, the test's own.
    env = {**os.environ, "DEMO_ARGS": "--duration-seconds 70 --port 0", "TMPDIR": str(tmp_path)}
    result = subprocess.run(commands[0].split(), cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "culprit: rank 4 in DataLoader.__next__ -> Queue.get" in result.stdout


def _demo_ranks(folder: Path) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "watchdog.demo_rank" in cmdline and str(folder) in cmdline:
            found.append(process)
    return found


def _gone(folder: Path, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not [p for p in _demo_ranks(folder) if p.status() != psutil.STATUS_ZOMBIE]:
            return True
        time.sleep(0.2)
    return False


def test_the_ranks_die_with_the_demo_when_its_reader_goes_or_it_is_killed(tmp_path: Path) -> None:
    """`make run | head` and a closed terminal end the demo and its ranks; so does kill -9 of the demo."""
    for how in ("pipe closed", "kill -9"):
        folder = tmp_path / how.replace(" ", "-")
        process = subprocess.Popen([sys.executable, "-m", "watchdog", "demo", "--folder", str(folder), "--port", "0"],
                                   cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            read_until(process, "metrics:", 150, [])
            assert len(_demo_ranks(folder)) == 8
            if how == "pipe closed":
                assert process.stdout is not None
                process.stdout.close()  # as `head` does once it has its lines
                assert process.wait(timeout=60) is not None
            else:
                process.kill()
                process.wait(timeout=10)
            assert _gone(folder), f"{how}: the demo's ranks outlived it"
        finally:
            if process.poll() is None:
                process.kill()
            for rank in _demo_ranks(folder):
                rank.kill()
