"""Replay throughput: GPU-samples per second through the readers and the detectors, on a day-long
8-GPU 1 Hz trace, in both trace formats.

    python bench/replay_throughput.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import training_day, write_smi_csv  # noqa: E402

from watchdog.config import Config  # noqa: E402
from watchdog.detect.engine import DetectorEngine  # noqa: E402
from watchdog.model import EventKind  # noqa: E402
from watchdog.sample import recording, sim  # noqa: E402
from watchdog.sample.replay import open_trace  # noqa: E402


def replay(path: Path, detect: bool) -> tuple[int, float, int]:
    engine = DetectorEngine(Config())
    samples = fired = 0
    started = time.perf_counter()
    with open_trace(str(path)) as trace:
        for snapshot in trace.snapshots:
            samples += len(snapshot.gpus)
            if detect:
                fired += sum(e.event is EventKind.FIRED for e in engine.observe(snapshot))
    return samples, time.perf_counter() - started, fired


def main() -> None:
    scenario = training_day()
    with tempfile.TemporaryDirectory() as tmp:
        jsonl, csv = Path(tmp) / "day.jsonl", Path(tmp) / "day.csv"
        with jsonl.open("w") as f:
            recording.write(f, recording.header("bench", "now"), sim.run(scenario))
        with csv.open("w") as f:
            write_smi_csv(f, sim.run(scenario))
        print(f"trace: {scenario.description}, 1 Hz, {scenario.gpus} GPUs, "
              f"{scenario.duration_seconds // 3600} h ({jsonl.stat().st_size / 2**20:.0f} MiB JSON Lines, "
              f"{csv.stat().st_size / 2**20:.0f} MiB CSV)")
        for name, path in (("JSON Lines", jsonl), ("nvidia-smi CSV", csv)):
            n, read_s, _ = replay(path, detect=False)
            n, total_s, fired = replay(path, detect=True)
            print(f"{name:>15}: read {n / read_s:>9,.0f} GPU-samples/s | read + detect {n / total_s:>9,.0f} "
                  f"GPU-samples/s ({total_s:.1f} s for {n:,} GPU-samples, {fired} episodes fired)")


if __name__ == "__main__":
    main()
