"""A small Python process for py-spy to attach to. Usage: stuck.py MODE [READY_FILE]

  queue   blocks in a data loader's queue.get (idle)
  busy    spins in a tight loop and, on SIGTERM, prints the longest gap between two iterations in ms
          (how long the process was paused, for the capture benchmark)
  deaf    blocks like queue, and ignores SIGTERM (only SIGKILL ends it)
"""

from __future__ import annotations

import queue
import signal
import sys
import time
from pathlib import Path


class BatchLoader:
    def __init__(self) -> None:
        self.q: queue.Queue[int] = queue.Queue()

    def __next__(self) -> int:
        return self.q.get()


def busy() -> None:
    longest = 0.0

    def report(signum: int, frame: object) -> None:
        print(f"{longest * 1000:.3f}", flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, report)
    last = time.perf_counter()
    while True:
        now = time.perf_counter()
        longest = max(longest, now - last)
        last = now


def main() -> None:
    mode = sys.argv[1]
    if mode == "deaf":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if len(sys.argv) > 2:
        Path(sys.argv[2]).write_text("ready")
    if mode == "busy":
        busy()
    else:
        next(BatchLoader())


if __name__ == "__main__":
    main()
