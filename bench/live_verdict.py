"""Onset -> critical, live: the real daemon ticking at 1 Hz of real time over a simulated 8-GPU node whose
ranks are a real torch.distributed job on CPU (gloo, tests/targets/gloo_job.py) held at its stall, with
py-spy capturing their stacks at suspicion and again stacks.confirm_seconds later (stacks/confirm.py).

  every GPU spins     sim spin_hang; rank 4 entered broadcast, the other seven all_reduce
  one rank blocked    sim odd_rank; rank 4 blocks in its data loader, the other seven spin in all_reduce
  spinning ranks      sim spin_hang; all eight ranks in the same all_reduce, each burning a core (a spin-wait),
                      waiting on a ninth rank that stands for another node's (it never arrives)

Each run starts a fresh daemon a random 10-20 s before the onset, so the onset falls anywhere in the
detectors' windows, and counts the seconds from the onset to the tick the episode is critical. Runs go
`--parallel` at a time, each on a job of its own (two captures of one process at once would collide).

    python bench/live_verdict.py [--runs N] [--parallel P]

Goal (issue 27): critical within 20 s of onset at the median and 30 s at p95, over 20 runs or more per
class; the telemetry-only figures (bench/accuracy.py) are not changed by this path.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import gloo_job  # noqa: E402
from watchdog.config import parse_config  # noqa: E402
from watchdog.plumbing import logfmt  # noqa: E402
from watchdog.sample import sim  # noqa: E402
from watchdog.service import build  # noqa: E402
from watchdog.vocabulary.model import Severity  # noqa: E402

ONSET = 300  # both scenarios stall at t=300 s
LIMIT = 60  # a run without a critical verdict this long after the onset counts as this
CLASSES = (("every GPU spins", "spin_hang", "collective", 0), ("one rank blocked", "odd_rank", "dataloader", 0),
           ("spinning ranks", "spin_hang", "spin", 1))  # (name, sim scenario, gloo stall, ranks elsewhere)


def one_run(scenario: str | sim.Scenario, pids: dict[int, list[int]], folder: Path, rng: random.Random,
            limit: int = LIMIT) -> tuple[int, str]:
    """Seconds from the onset to the first critical tick, and the verdict's reason."""
    lead = rng.randint(10, 20)
    config = parse_config({"export": {"listen_address": "127.0.0.1:0"},
                           "bundles": {"directory": str(folder), "capture_stacks": True}})
    timeline = sim.SCENARIOS[scenario] if isinstance(scenario, str) else scenario
    service = build(config, sim.SimSource(timeline, 1.0, ONSET - lead, pids))
    daemon = service.daemon
    started = time.monotonic()
    try:
        for tick in range(lead + limit):
            time.sleep(max(0.0, started + tick - time.monotonic()))
            daemon.tick()
            critical = [ep for ep in daemon.engine.open_episodes()
                        if ep.fired_severity is Severity.CRITICAL]
            if critical:
                return tick - lead, critical[0].reason
        return limit, "not critical"
    finally:
        service.close(timeout=15)


def one_class(scenario: str, stall: str, runs: int, parallel: int, elsewhere: int = 0) -> list[tuple[int, str]]:
    """`runs` runs, `parallel` at a time, each worker on a gloo job of its own held at `stall`."""
    results: list[tuple[int, str]] = []
    lock = threading.Lock()
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        jobs = []
        for n in range(parallel):
            work = Path(tmp) / f"job{n}"
            work.mkdir()
            jobs.append(stack.enter_context(gloo_job(stall, work, ranks=8, odd_rank=4, elsewhere=elsewhere)))

        def worker(n: int, processes: list[subprocess.Popen[str]]) -> None:
            rng = random.Random(f"{scenario}:{n}")
            pids = {gpu: [p.pid] for gpu, p in enumerate(processes)}
            for run in range(n, runs, parallel):
                result = one_run(scenario, pids, Path(tmp) / f"run{run}", rng)
                with lock:
                    results.append(result)

        threads = [threading.Thread(target=worker, args=(n, job)) for n, job in enumerate(jobs)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return results


def percentile(values: list[int], share: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(round(share * (len(ordered) - 1))))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="runs per class (default 20)")
    parser.add_argument("--parallel", type=int, default=4, help="runs at once, each on a job of its own (default 4)")
    parser.add_argument("--only", default="", help="only the classes whose name contains this")
    args = parser.parse_args()
    logfmt.log.setLevel(logfmt.ERROR)  # the daemons' own episode lines
    print(f"live onset -> critical: {args.runs} runs per class, {args.parallel} at a time, 8 real gloo ranks per "
          "run, the daemon at 1 Hz of real time with its default configuration")
    for name, scenario, stall, elsewhere in CLASSES:
        if args.only and args.only not in name:
            continue
        # Ranks that burn a core each: one job at a time, or the machine's cores are the figure measured.
        results = one_class(scenario, stall, args.runs, 1 if stall == "spin" else args.parallel, elsewhere)
        seconds = [s for s, _ in results]
        p50, p95 = statistics.median(seconds), percentile(seconds, 0.95)
        reasons = sorted({r for _, r in results})
        met = "met" if p50 <= 20 and p95 <= 30 else "NOT met"
        print(f"  {name:>16}: critical {p50:.0f} s after onset at the median, {p95:.0f} s at p95, range "
              f"{min(seconds)}-{max(seconds)} s over {len(seconds)} runs (goal <= 20 s / <= 30 s: {met})")
        print(f"  {'':>16}  why: {'; '.join(reasons)}")


if __name__ == "__main__":
    main()
