"""Stack capture: wall time to capture 8 and 32 live Python ranks, and the pause a capture imposes
on a busy process (nonblocking vs blocking reads).

    python bench/capture_stacks.py
"""

from __future__ import annotations

import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from watchdog.stacks.capture import OK, StackCapturer, Target

TARGET = Path(__file__).resolve().parent.parent / "tests" / "targets" / "stuck.py"


def start(mode: str, count: int, folder: Path) -> list[subprocess.Popen[str]]:
    processes = []
    for number in range(count):
        ready = folder / f"{mode}-{number}-{time.monotonic_ns()}"
        processes.append(subprocess.Popen([sys.executable, str(TARGET), mode, str(ready)], text=True,
                                          stdout=subprocess.PIPE))
    deadline = time.monotonic() + 60
    while len(list(folder.glob(f"{mode}-*"))) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    return processes


def stop(processes: list[subprocess.Popen[str]]) -> None:
    for p in processes:
        p.kill()
        p.wait()


def capture_wall(count: int, folder: Path, repeats: int = 5) -> None:
    processes = start("queue", count, folder)
    try:
        capturer = StackCapturer(max_parallel=count)
        walls = []
        for _ in range(repeats):
            started = time.perf_counter()
            results = capturer.capture(Target(p.pid) for p in processes)
            walls.append(time.perf_counter() - started)
            assert all(r.result == OK for r in results), [r.message for r in results if r.result != OK]
        print(f"capture {count:>2} ranks in parallel: median {statistics.median(walls):.3f} s, "
              f"max {max(walls):.3f} s over {repeats} rounds")
    finally:
        stop(processes)


def longest_pause(folder: Path, capturer: StackCapturer | None, seconds: float = 3.0) -> tuple[float, int]:
    """The busy target's longest gap between two loop iterations, in ms, while being captured."""
    (process,) = start("busy", 1, folder)
    captures = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if capturer is not None:
            capturer.capture_one(Target(process.pid))
            captures += 1
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=10)
    return float(out.strip()), captures


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for count in (8, 32):
            capture_wall(count, folder)
        baseline, _ = longest_pause(folder, None)
        nonblocking, n1 = longest_pause(folder, StackCapturer())
        blocking, n2 = longest_pause(folder, StackCapturer(nonblocking=False))
        print(f"longest stall of a busy process over 3 s: {baseline:.1f} ms with no capture, "
              f"{nonblocking:.1f} ms with {n1} nonblocking captures, {blocking:.1f} ms with {n2} blocking captures")


if __name__ == "__main__":
    main()
