"""Hang onset -> training again, under torchrun, with the actions policy at its defaults.

A real `torchrun --nproc-per-node 4 --max-restarts 2` job (gloo, CPU; tests/elastic.py) checkpoints every
10 steps and hangs at step 30 (one rank blocked in its data loader, the others in all_reduce). The real
daemon watches four simulated GPUs that follow the job, with actions.mode act and every other actions
setting at its default (after_seconds 120): it detects the hang, captures the evidence, terminates the
ranks; torchrun restarts them and they resume from the step-20 checkpoint.

    python bench/act_restart.py [--after-seconds S]

Prints the hang's onset (the last step finished before it), when the action ran, and when the job
finished a step again, against what PyTorch does alone: its NCCL watchdog ends a hung collective after
600 s (init_process_group's default timeout for NCCL), and then a person restarts the job (not counted).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.elastic import FollowingSource, last_progress, steps, torchrun_job  # noqa: E402
from watchdog.config import parse_config  # noqa: E402
from watchdog.daemon import build  # noqa: E402

PYTORCH_DEFAULT_TIMEOUT = 600.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--after-seconds", type=float, default=None, help="actions.after_seconds (default: its "
                        "default, 120)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        actions: dict[str, object] = {"mode": "act", "pause_file": str(work / "pause")}
        if args.after_seconds is not None:
            actions["after_seconds"] = args.after_seconds
        config = parse_config({"export": {"listen_address": "127.0.0.1:0"},
                               "bundles": {"directory": str(work / "incidents")}, "actions": actions})
        with torchrun_job(work, hangs="0:30") as agent:
            daemon = build(config, FollowingSource(agent, work))
            threading.Thread(target=daemon.run, daemon=True).start()
            try:
                deadline = time.monotonic() + 600
                while not any(s == 29 for s, _ in steps(work)):
                    assert time.monotonic() < deadline, "the job never reached its hang"
                    time.sleep(0.5)
                time.sleep(3)
                onset = last_progress(work)
                while not any(r == 1 for _, r in steps(work)):
                    assert time.monotonic() < deadline, "the job did not train again within 10 minutes"
                    time.sleep(0.5)
                again = last_progress(work)
                acted = daemon.counters.get("actions_total", "terminate_ranks", "done")
            finally:
                daemon.stop_requested.set()
                time.sleep(1.5)
                daemon.shutdown(timeout=15)
        resumed = min(s for s, r in steps(work) if r == 1)
    after = config.actions.after_seconds
    print(f"actions.after_seconds {after:g} (mode act, other settings default); terminate_ranks done: {acted:g}")
    print(f"hang onset -> training again: {again - onset:.0f} s (resumed at step {resumed}, checkpoint of step 20)")
    print(f"PyTorch alone: the NCCL watchdog ends the job after {PYTORCH_DEFAULT_TIMEOUT:.0f} s, then a person "
          "restarts it: 10 min + the manual restart")
    print(f"goal: under 180 s with the defaults -> {'met' if again - onset < 180 else 'NOT met'}")


if __name__ == "__main__":
    main()
