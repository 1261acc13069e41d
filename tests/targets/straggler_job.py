"""A steady synchronous job on gloo for stragglers (bench/straggler_live.py, tests/stacks/test_sampling.py): each
step is work and an all_reduce, as a data-parallel step is. The work is a little matrix work on the CPU and a
wait standing for the rest of the step's compute (a GPU's kernels, where the rank's Python thread waits too):
sixteen ranks all computing on the CPU would share the test machine's two cores, and their waits would then
measure the scheduler, not the job. What a rank does is read from a control file (JSON) the caller rewrites
while the job runs:

    {"slow": {"3": 1.2}, "extra": {"0": 0.1}, "checkpoint": {"0": [30, 3]}, "shuffle": 0.3}

slow: a rank's work multiplied (1.2 is 20% more); extra: a rank's standing extra work (rank 0's logging, a
pipeline stage); checkpoint: a rank that saves [every, seconds long] with torch.save; shuffle: every step a
random rank gets this much more work (experts that receive more tokens). Each rank appends its step times to
<out>/steps.<rank>: `<unix time> <seconds>` lines.

    torchrun --nproc-per-node N tests/targets/straggler_job.py CONTROL OUT
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import IO

import torch
import torch.distributed as dist

STEP_SECONDS = 0.15  # the work of one step: a 10% slower rank's takes 165 ms
PRODUCTS = 4  # of it, matrix products on the CPU


def main() -> None:
    control, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with open(os.path.join(out, f"steps.{rank}"), "a", buffering=1) as log:
        steps(rank, control, out, log)
    dist.destroy_process_group()


def steps(rank: int, control: str, out: str, log: IO[str]) -> None:
    """Step until the control file says stop, each step's time appended to `log`."""
    key = str(rank)
    plan: dict = {}
    a = torch.randn(128, 128)
    grad = torch.zeros(4096)
    read_at = last_save = 0.0
    step = 0
    while True:
        now = time.time()
        if now - read_at > 1.0:
            try:
                with open(control) as f:
                    plan = json.load(f)
            except (OSError, ValueError):
                pass
            read_at = now
            if plan.get("stop"):
                return
        factor = float(plan.get("slow", {}).get(key, 1.0)) + float(plan.get("extra", {}).get(key, 0.0))
        random.seed(step)
        if plan.get("shuffle") and random.randrange(dist.get_world_size()) == rank:
            factor += float(plan["shuffle"])
        started = time.perf_counter()
        work(a, factor)
        every, length = plan.get("checkpoint", {}).get(key, [0, 0])
        if every and now - last_save > every:
            save(length, out, rank)
            last_save = now
        dist.all_reduce(grad)
        log.write(f"{now:.3f} {time.perf_counter() - started:.5f}\n")
        step += 1


def work(a: torch.Tensor, factor: float) -> None:
    until = time.perf_counter() + STEP_SECONDS * factor
    b = a
    for _ in range(round(PRODUCTS * factor)):
        b = torch.tanh(b @ a)
    time.sleep(max(0.0, until - time.perf_counter()))


def save(seconds: float, out: str, rank: int) -> None:
    """A checkpoint: torch.save, over and over for `seconds`."""
    until = time.time() + seconds
    state = {"w": torch.randn(512, 512)}
    while time.time() < until:
        torch.save(state, os.path.join(out, f"checkpoint.{rank}.pt"))


if __name__ == "__main__":
    main()
