"""Ask PyTorch to dump its NCCL Flight Recorder, with no change to the training code.

When a rank runs with TORCH_NCCL_DEBUG_INFO_PIPE_FILE=<stem> and TORCH_NCCL_TRACE_BUFFER_SIZE > 0,
ProcessGroupNCCL opens a named pipe `<stem><rank>.pipe`; writing to it makes that rank write its
collective history to `<TORCH_NCCL_DEBUG_INFO_TEMP_FILE><rank>` (default /tmp/nccl_trace_rank_<rank>).
The pipe is reached through /proc/<pid>/root so a rank in a container is found in its own filesystem.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from watchdog.sample.ranks import RankInfo

DEFAULT_DUMP_STEM = "/tmp/nccl_trace_rank_"


@dataclass(frozen=True)
class FlightRecorder:
    pid: int
    rank: int | None
    result: str  # triggered | not_configured | disabled | no_pipe | not_listening | failed
    message: str
    dump_path: str | None = None

    def to_json(self) -> dict[str, object]:
        return {"pid": self.pid, "rank": self.rank, "result": self.result, "message": self.message,
                "dump_path": self.dump_path}


def trigger(rank: RankInfo, proc_root: str | Path = "/proc") -> FlightRecorder:
    env = rank.env
    stem = env.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE")
    if not stem:
        return FlightRecorder(rank.pid, rank.rank, "not_configured",
                              "set TORCH_NCCL_DEBUG_INFO_PIPE_FILE and TORCH_NCCL_TRACE_BUFFER_SIZE in the job to let "
                              "the watchdog dump NCCL's Flight Recorder")
    try:
        size = int(env.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0"))
    except ValueError:
        size = 0
    if size <= 0 or rank.rank is None:
        why = "TORCH_NCCL_TRACE_BUFFER_SIZE is not above 0" if size <= 0 else "the rank is unknown"
        return FlightRecorder(rank.pid, rank.rank, "disabled", f"{why}: PyTorch opens no pipe")
    pipe = f"{stem}{rank.rank}.pipe"
    candidates = [Path(proc_root) / str(rank.pid) / "root" / pipe.lstrip("/"), Path(pipe)] if pipe.startswith("/") \
        else [Path(proc_root) / str(rank.pid) / "cwd" / pipe, Path(pipe)]
    dump_path = f"{env.get('TORCH_NCCL_DEBUG_INFO_TEMP_FILE', DEFAULT_DUMP_STEM)}{rank.rank}"
    for path in candidates:
        try:
            if not stat.S_ISFIFO(path.stat().st_mode):
                return FlightRecorder(rank.pid, rank.rank, "failed", f"{path} is not a named pipe; not written")
        except OSError:
            continue
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                return FlightRecorder(rank.pid, rank.rank, "not_listening",
                                      f"{path} exists but no process reads it (the rank may be gone)")
            return FlightRecorder(rank.pid, rank.rank, "failed", f"{path}: {exc.strerror or exc}")
        try:
            os.write(fd, b"1\n")
        except OSError as exc:
            return FlightRecorder(rank.pid, rank.rank, "failed", f"{path}: {exc.strerror or exc}")
        finally:
            os.close(fd)
        return FlightRecorder(rank.pid, rank.rank, "triggered", f"asked rank {rank.rank} to dump to {dump_path}",
                              dump_path)
    return FlightRecorder(rank.pid, rank.rank, "no_pipe", f"{pipe} does not exist (the process group may not be "
                                                           "created yet)")
