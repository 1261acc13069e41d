"""Traces that cannot starve `replay` or make it page what the GPUs did not do (issue 40, the trace readers).

A trace is a file anyone may hand to `replay`: it is bounded in what its lines add up to (the distinct GPUs it
names, what one record holds), and a cell no GPU could have written (a bit mask past 64 bits, a utilization over
100%, a header met mid-file read as readings) is a malformed cell, never a value. Whatever the input, the user sees
one line naming the file and line, never a traceback. bench/hostile_costs.py prints what these inputs cost.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hostile.test_readers import REPO, measure
from watchdog.sample.lines import MAX_GPUS

_HEAD = json.dumps({"stall_watchdog_recording": 1, "source": "hostile", "started": "2026-01-01T00:00:00+00:00"})


def new_gpus_recording(lines: int = 200, per_line: int = 1024) -> bytes:
    """A recording each of whose lines names `per_line` GPUs no line before named (200 x 1,024: 3.3 MB)."""
    rows = [_HEAD]
    for n in range(lines):
        gpus = {"index": list(range(n * per_line, (n + 1) * per_line)), "utilization_ratio": [1.0] * per_line,
                "power_watts": [100.5] * per_line}
        rows.append(json.dumps({"t": 1767225600.0 + n, "gpus": gpus}, separators=(",", ":")))
    return ("\n".join(rows) + "\n").encode()


def large_records(lines: int = 20, gpus: int = 1024, xids: int | None = None, pids: int = 40) -> bytes:
    """Records just under 1 MiB (the longest line a trace may have): `gpus` GPUs with every column, each with `pids`
    processes and `xids` Xids (none given: as many as fill the line), and errors of 1,000 characters filling the
    rest."""
    columns: dict[str, list[object]] = {
        "index": list(range(gpus)), "uuid": [f"GPU-{n:08x}-0000-0000-0000-000000000000" for n in range(gpus)],
        "name": ["NVIDIA H100 80GB HBM3"] * gpus, "health": ["ok"] * gpus,
        "pids": [list(range(100_000 + n * pids, 100_000 + (n + 1) * pids)) for n in range(gpus)],
        "rank_waits": [[1, n, 9, 8, 0, 9, 1] for n in range(gpus)],
        **{name: [0.5] * gpus for name in ("utilization_ratio", "memory_utilization_ratio", "sm_activity_ratio")},
        **{name: [150.5] * gpus for name in ("power_watts", "power_limit_watts", "temperature_celsius")},
        "sm_clock_hertz": [1.98e9] * gpus, "memory_used_bytes": [2**30] * gpus,
        "ecc_corrected": [0] * gpus, "pcie_replays": [0] * gpus, "clock_event_reasons": [0] * gpus,
    }
    size = len(json.dumps({"t": 1767225600.0, "gpus": {**columns, "xids": [[]] * gpus, "errors": [{}] * gpus}},
                          separators=(",", ":")))
    room = (2**20 - 64 - size) // gpus  # bytes each GPU may add
    count = room // 4 if xids is None else xids  # "132," each
    columns["xids"] = [[100 + k % 900 for k in range(count)] for _ in range(gpus)]
    left = room - 4 * count
    columns["errors"] = [{f"field_{k}": "e" * min(1000, left - 1020 * k - 20) for k in range(max(0, left) // 1020)}
                         for _ in range(gpus)]
    rows = [_HEAD] + [json.dumps({"t": 1767225600.0 + n, "gpus": columns}, separators=(",", ":")) for n in range(lines)]
    assert 2**20 - 2**16 < len(rows[1]) < 2**20, len(rows[1])
    return ("\n".join(rows) + "\n").encode()


def _stamp(second: float) -> str:
    return f"2024/01/02 {int(second // 3600):02d}:{int(second // 60) % 60:02d}:{second % 60:06.3f}"


def never_repeating_index_csv(rows: int = 40_000) -> bytes:
    """An nvidia-smi log whose index column never names a GPU twice: one sample of `rows` GPUs, as read."""
    lines = ["timestamp, index, utilization.gpu [%], power.draw [W]"]
    lines += [f"{_stamp(n * 0.001)}, {n}, 99 %, 500.00 W" for n in range(rows)]
    return ("\n".join(lines) + "\n").encode()


def mask_csv(mask: str, samples: int = 60) -> bytes:
    """A log of two GPUs whose GPU 1 has the clock-event mask `mask` in the middle sample."""
    lines = ["timestamp, index, utilization.gpu [%], power.draw [W], clocks_event_reasons.active"]
    for n in range(samples):
        for gpu in range(2):
            cell = mask if (n, gpu) == (samples // 2, 1) else "0x0000000000000000"
            lines.append(f"{_stamp(n + gpu * 0.003)}, {gpu}, 99 %, 500.00 W, {cell}")
    return ("\n".join(lines) + "\n").encode()


def utilization_csv(cell: str, samples: int = 60) -> bytes:
    """A log of one GPU at work, one of whose utilization cells is `cell`."""
    lines = ["timestamp, index, utilization.gpu [%], power.draw [W]"]
    lines += [f"{_stamp(n)}, 0, {cell if n == samples // 2 else '98 %'}, 500.00 W" for n in range(samples)]
    return ("\n".join(lines) + "\n").encode()


def two_logs_cat(gpus: int = 8, seconds: int = 900) -> bytes:
    """`cat` of two healthy logs (nounits: nvidia-smi keeps the units in the header) whose columns are in different
    orders: the second begins with its own header, met mid-file. Read with the first header, its 540 W is a
    utilization of 540% and its 99% a power of 99 W: a GPU pinned at "100%" drawing idle power, a busy-spin."""
    first = ["timestamp, index, utilization.gpu [%], power.draw [W], enforced.power.limit [W]"]
    second = ["timestamp, index, power.draw [W], utilization.gpu [%], enforced.power.limit [W]"]
    for n in range(seconds):
        for gpu in range(gpus):
            util, power = 97 + (n + gpu) % 3, f"{540 + (n * 7 + gpu) % 11}.25"
            first.append(f"{_stamp(n + gpu * 0.002)}, {gpu}, {util}, {power}, 700.00")
            second.append(f"{_stamp(seconds + n + gpu * 0.002)}, {gpu}, {power}, {util}, 700.00")
    return ("\n".join(first + second) + "\n").encode()


def replay(path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """`stall-watchdog replay` as a user runs it (the trace read ahead by a second process, on two cores)."""
    return subprocess.run([sys.executable, "-m", "watchdog", "replay", *flags, str(path)], capture_output=True,
                          text=True, cwd=REPO, timeout=300)


def said_one_line(done: subprocess.CompletedProcess[str], where: str) -> str:
    """The one line a refused trace is: no traceback, the file and line named."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"stall-watchdog: {where}"), done.stderr[-3000:]
    return lines[0]


def test_a_recording_naming_ever_more_gpus_is_refused_at_once(tmp_path: Path) -> None:
    """Each line naming 1,024 new GPUs grew the detectors' arrays (ticks x every GPU ever named) to gigabytes and
    ended in a MemoryError: a line of more GPUs than a node has is malformed, with or without --lenient."""
    path = tmp_path / "gpus.jsonl"
    path.write_bytes(new_gpus_recording())
    said_one_line(replay(path), f"{path}:2: ")
    lenient = replay(path, "--lenient")
    assert lenient.returncode == 1 and "Traceback" not in lenient.stderr, lenient.stderr[-3000:]
    assert "no samples in the trace" in lenient.stderr and "200 line(s)" in lenient.stderr, lenient.stderr
    found = measure("""
import contextlib, io
from watchdog.cli import main
with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
    outcome = main(["replay", "--jobs", "1", "--lenient", args["path"]])
""", {"path": str(path)})
    assert float(found["grew_mib"]) < 50, found  # type: ignore[arg-type]


def test_a_recording_naming_a_few_new_gpus_a_line_stops_at_the_bound(tmp_path: Path) -> None:
    """Lines of 8 GPUs, each 8 new ones: the line naming the trace's 65th GPU is the error."""
    path = tmp_path / "gpus.jsonl"
    path.write_bytes(new_gpus_recording(lines=MAX_GPUS, per_line=8))
    line = said_one_line(replay(path), f"{path}:{2 + MAX_GPUS // 8}: ")
    assert f"more than {MAX_GPUS} GPUs" in line, line


def test_a_log_whose_index_never_repeats_is_refused_after_the_bound(tmp_path: Path) -> None:
    path = tmp_path / "gpus.csv"
    path.write_bytes(never_repeating_index_csv())
    line = said_one_line(replay(path), f"{path}:{2 + MAX_GPUS}: ")
    assert f"more than {MAX_GPUS} GPUs" in line, line


_CELLS = {  # a cell no GPU writes -> the log holding it, and where and what the error says
    **{f"mask {mask[:12]}": (lambda mask=mask: mask_csv(mask), "63: column 'clocks_event_reasons.active': ",
                             "as a bit mask") for mask in ("0x" + "f" * 400, "-0x8", "0x1_0", "0x10000000000000000")},
    **{f"utilization {cell}": (lambda cell=cell: utilization_csv(cell), "32: column 'utilization.gpu [%]': ",
                               "out of range") for cell in ("1e11", "1e11 %", "540", "100.5 %")},
}


@pytest.mark.parametrize("name", sorted(_CELLS))
def test_a_cell_no_gpu_writes_is_malformed_with_or_without_lenient(tmp_path: Path, name: str) -> None:
    """A mask of 400 hex digits ended the replay in an OverflowError traceback (--lenient too), `-0x8` was read as
    every reason at once, a utilization of 1e11 overflowed the detectors' fixed-point sums: each is a malformed
    cell, an error naming its line, or under --lenient one line skipped."""
    make, where, said = _CELLS[name]
    path = tmp_path / "log.csv"
    path.write_bytes(make())
    line = said_one_line(replay(path), f"{path}:{where}")
    assert said in line, line
    lenient = replay(path, "--lenient")
    assert lenient.returncode == 0 and "Traceback" not in lenient.stderr, lenient.stderr[-3000:]
    assert "1 line(s) or sample(s) skipped" in lenient.stderr, lenient.stderr


def test_two_logs_joined_by_cat_are_read_each_by_its_own_header(tmp_path: Path) -> None:
    """The second log's header is the header of the lines after it: with or without --lenient, nothing is skipped
    and nothing fires (before: with --lenient, a false critical busy-spin on every GPU)."""
    path = tmp_path / "joined.csv"
    path.write_bytes(two_logs_cat())
    for flags in ([], ["--lenient"]):
        done = replay(path, "--json", *flags)
        assert done.returncode == 0 and not done.stdout.strip(), (done.stdout[-2000:], done.stderr[-2000:])
        assert "skipped" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
