"""One rank of the demo's training job: real torch.distributed (gloo, CPU). It trains, and after
HANG_AFTER_SECONDS the rank ODD_RANK blocks in its data loader (the next batch never comes) while every
other rank waits for it in all_reduce: the hang stall-watchdog is built to name.

Run by `stall-watchdog demo`, one process per rank, as torchrun would: RANK, WORLD_SIZE, MASTER_ADDR...
"""

from __future__ import annotations

import os
import queue
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


class DataLoader:
    """Stands in for a DataLoader whose worker died: after the hang, no batch ever arrives."""

    def __init__(self, stuck_after: float):
        self.batches: queue.Queue[torch.Tensor] = queue.Queue()
        self.stuck_after = stuck_after

    def __iter__(self) -> DataLoader:
        return self

    def __next__(self) -> torch.Tensor:
        if time.monotonic() < self.stuck_after:
            return torch.ones(1024)
        return self.batches.get()


def train_step(model: torch.Tensor, batch: torch.Tensor) -> None:
    gradient = model * 0 + batch.mean()
    dist.all_reduce(gradient)
    model -= 1e-3 * gradient
    time.sleep(0.2)  # the GPU's share of the step, simulated


def main() -> None:
    ready = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    odd = int(os.environ.get("ODD_RANK", "4"))
    hang_at = time.monotonic() + float(os.environ.get("HANG_AFTER_SECONDS", "15"))
    model = torch.zeros(1024)
    (ready / f"rank-{rank}").write_text(str(os.getpid()))
    loader = DataLoader(hang_at if rank == odd else float("inf"))
    for batch in loader:
        train_step(model, batch)


if __name__ == "__main__":
    main()
