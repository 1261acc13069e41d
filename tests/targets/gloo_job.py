"""A real torch.distributed job on CPU (gloo) that trains a few steps, then stalls in a chosen way.

Launched like torchrun launches workers: one process per rank, with RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT in its environment. Usage: gloo_job.py SCENARIO READY_DIR

  dataloader   the odd rank blocks in its data loader (a queue nobody fills); the rest in all_reduce
  collective   the odd rank enters broadcast; the rest enter all_reduce
  checkpoint   rank 0 writes a checkpoint slowly with torch.save; the rest wait in all_reduce
  spin         every rank enters all_reduce, each burning a core the while (CUDA's spin-wait in a sync, a
               host-side wait loop); the collective waits on the ranks past LOCAL_WORLD_SIZE, which stand for
               a node whose ranks never arrive: they sit in time.sleep
  healthy      every rank keeps training

With TORCH_FR_BUFFER_SIZE set, PyTorch's Flight Recorder records the gloo collectives. PyTorch opens its
dump-on-request pipe (TORCH_NCCL_DEBUG_INFO_PIPE_FILE / TORCH_FR_DEBUG_INFO_PIPE_FILE) only in
ProcessGroupNCCL, so a rank here does what that code does: a thread reads `<pipe stem><rank>.pipe` and
writes PyTorch's own dump (`_dump_fr_trace`) to `<TORCH_FR_DUMP_TEMP_FILE><rank>`.

NCCL's RAS service needs GPUs, so a rank given RAS_STAND_IN_REPORT (a report file) and RAS_STAND_IN_LISTEN
stands in for it: it listens on its NCCL_RAS_ADDR, as the first NCCL process on a node does, and answers
each query with the file as it is then (the daemon believes RAS only from a socket its job's ranks hold).
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from ras_speaker import serve_forever  # beside this file, as it is run

ODD_RANK = int(os.environ.get("ODD_RANK", "2"))


class FakeLoader:
    """Stands in for a DataLoader whose worker died: the next batch never arrives."""

    def __init__(self) -> None:
        self.batches: queue.Queue[torch.Tensor] = queue.Queue()

    def __iter__(self) -> FakeLoader:
        return self

    def __next__(self) -> torch.Tensor:
        return self.batches.get()


class SlowFile:
    """A file on slow storage: every write takes a while, so saving takes minutes."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("wb")

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        for start in range(0, len(view), 256 * 1024):
            self.file.write(view[start:start + 256 * 1024])
            self.file.flush()
            time.sleep(0.05)
        return len(data)

    def flush(self) -> None:
        self.file.flush()


def train_step(model: torch.Tensor) -> None:
    grad = torch.ones_like(model)
    dist.all_reduce(grad)
    model -= 0.01 * grad


def save_checkpoint(model: torch.Tensor, folder: Path) -> None:
    torch.save({"model": model.repeat(64)}, SlowFile(folder / "checkpoint.pt"))


def serve_flight_recorder_pipe(rank: int) -> None:
    stem = os.environ.get("TORCH_FR_DEBUG_INFO_PIPE_FILE") or os.environ.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE")
    if not stem:
        return
    pipe = Path(f"{stem}{rank}.pipe")
    os.mkfifo(pipe)
    dump_stem = os.environ.get("TORCH_FR_DUMP_TEMP_FILE", "/tmp/nccl_trace_rank_")

    def serve() -> None:
        from torch._C._distributed_c10d import _dump_fr_trace

        while True:
            with pipe.open("rb") as requests:
                if requests.read(1):
                    Path(f"{dump_stem}{rank}").write_bytes(_dump_fr_trace())

    threading.Thread(target=serve, name="fr-pipe", daemon=True).start()


def serve_ras_stand_in() -> None:
    """With RAS_STAND_IN_REPORT and RAS_STAND_IN_LISTEN, this rank listens on its NCCL_RAS_ADDR as NCCL's RAS
    service would (ras_speaker.py), answering with that report."""
    report = os.environ.get("RAS_STAND_IN_REPORT")
    if not report or not os.environ.get("RAS_STAND_IN_LISTEN"):
        return
    host, _, port = os.environ["NCCL_RAS_ADDR"].rpartition(":")
    server = socket.create_server((host, int(port)))
    threading.Thread(target=serve_forever, args=(server, Path(report)), name="ras-stand-in", daemon=True).start()


def burn() -> None:
    """A core at 100%, as a rank's spin-wait burns it: no I/O, no progress."""
    while True:
        pass


def main() -> None:
    scenario, ready = sys.argv[1], Path(sys.argv[2])
    serve_ras_stand_in()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    serve_flight_recorder_pipe(rank)
    model = torch.zeros(1 << 18)
    for _ in range(3):
        train_step(model)
    (ready / f"rank-{rank}").write_text(str(os.getpid()))
    if scenario == "healthy":
        while True:
            train_step(model)
    elif scenario == "dataloader" and rank == ODD_RANK:
        for batch in FakeLoader():
            model += batch
    elif scenario == "collective" and rank == ODD_RANK:
        dist.broadcast(model, src=ODD_RANK)
    elif scenario == "checkpoint" and rank == 0:
        save_checkpoint(model, ready)
    elif scenario == "spin" and rank >= int(os.environ["LOCAL_WORLD_SIZE"]):
        time.sleep(3600)  # on the other node: never arrives
    elif scenario == "spin":
        threading.Thread(target=burn, name="spin-wait", daemon=True).start()
    train_step(model)  # the ranks that wait: all_reduce, until the odd one arrives
    time.sleep(3600)


if __name__ == "__main__":
    main()
