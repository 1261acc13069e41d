"""A real torchrun worker (gloo, CPU) that checkpoints and can hang: what a restart must recover.

    torchrun --nproc-per-node 4 --max-restarts 2 elastic_job.py WORKDIR

Every rank trains step after step (an all_reduce each); rank 0 saves a checkpoint every CHECKPOINT_EVERY
steps (written aside, then renamed in place). A worker resumes from the checkpoint, if there is one. Each
rank appends "step restart" to WORKDIR/progress-RANK after each step. HANGS names where to hang, as
"restart:step" pairs (default "0:30"): on that restart (TORCHELASTIC_RESTART_COUNT), at that step, the odd
rank blocks in its data loader (a queue nobody fills) and the others block in the next all_reduce. After
STEPS steps every rank writes WORKDIR/done-RANK and exits.
"""

from __future__ import annotations

import datetime
import os
import queue
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

CHECKPOINT_EVERY = int(os.environ.get("CHECKPOINT_EVERY", "10"))
STEPS = int(os.environ.get("STEPS", "60"))
ODD_RANK = int(os.environ.get("ODD_RANK", "2"))
STEP_SECONDS = float(os.environ.get("STEP_SECONDS", "0.2"))


def hang_step(restart: int) -> int | None:
    for pair in os.environ.get("HANGS", "0:30").split(","):
        on, _, step = pair.partition(":")
        if on and step and int(on) == restart:
            return int(step)
    return None


def main() -> None:
    work = Path(sys.argv[1])
    rank, restart = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # The agent's store outlives a restart, and with it the previous round's gloo addresses: each round
    # keeps its keys under a prefix of its own (else the new workers dial the dead ones' ports).
    timeout = datetime.timedelta(hours=1)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"restart-{restart}", store), rank=rank,
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    checkpoint = work / "checkpoint.pt"
    start = 1
    weights = torch.zeros(1024)
    if checkpoint.exists():
        saved = torch.load(checkpoint)
        start, weights = int(saved["step"]) + 1, saved["weights"]
    stuck_at = hang_step(restart)
    loader: queue.Queue[torch.Tensor] = queue.Queue()
    progress = (work / f"progress-{rank}").open("a", buffering=1)
    for step in range(start, STEPS + 1):
        # At the hang the data loader's worker has died: the odd rank's get() never returns.
        batch = loader.get() if step == stuck_at and rank == ODD_RANK else torch.ones(1024)
        dist.all_reduce(batch)
        weights += batch / 1000
        progress.write(f"{step} {restart}\n")
        if rank == 0 and step % CHECKPOINT_EVERY == 0:
            aside = work / f".checkpoint-{os.getpid()}.pt"
            torch.save({"step": step, "weights": weights}, aside)
            os.replace(aside, checkpoint)
        time.sleep(STEP_SECONDS)
    (work / f"done-{rank}").write_text(str(restart))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
