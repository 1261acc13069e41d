"""Ask PyTorch to dump its NCCL Flight Recorder, with no change to the training code.

When a rank runs with TORCH_NCCL_DEBUG_INFO_PIPE_FILE=<stem> (newer PyTorch: TORCH_FR_DEBUG_INFO_PIPE_FILE)
and TORCH_NCCL_TRACE_BUFFER_SIZE (TORCH_FR_BUFFER_SIZE) > 0, ProcessGroupNCCL opens a named pipe
`<stem><rank>.pipe`; writing to it makes that rank write its collective history to
`<TORCH_FR_DUMP_TEMP_FILE or TORCH_NCCL_DEBUG_INFO_TEMP_FILE><rank>` (default /tmp/nccl_trace_rank_<rank>).
The pipe and the dump are reached through /proc/<pid>/root, so a rank in a container is found in its own
filesystem. `collect` waits for the dumps asked for and reads them back (stacks/fr_dumps.py).
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from watchdog.sample.ranks import RankInfo
from watchdog.stacks.fr_dumps import FlightRecorderError, RankTrace, read

DEFAULT_DUMP_STEM = "/tmp/nccl_trace_rank_"
PIPE_VARIABLES = ("TORCH_FR_DEBUG_INFO_PIPE_FILE", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE")
BUFFER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
DUMP_VARIABLES = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def _first(env: Mapping[str, str], names: Sequence[str]) -> str | None:
    return next((env[n] for n in names if env.get(n)), None)


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
    stem = _first(env, PIPE_VARIABLES)
    if not stem:
        return FlightRecorder(rank.pid, rank.rank, "not_configured",
                              "set TORCH_NCCL_DEBUG_INFO_PIPE_FILE (or TORCH_FR_DEBUG_INFO_PIPE_FILE) and "
                              "TORCH_NCCL_TRACE_BUFFER_SIZE in the job to let the watchdog dump the Flight Recorder")
    try:
        size = int(_first(env, BUFFER_VARIABLES) or "0")
    except ValueError:
        size = 0
    if size <= 0 or rank.rank is None:
        why = "TORCH_NCCL_TRACE_BUFFER_SIZE is not above 0" if size <= 0 else "the rank is unknown"
        return FlightRecorder(rank.pid, rank.rank, "disabled", f"{why}: PyTorch opens no pipe")
    pipe = f"{stem}{rank.rank}.pipe"
    candidates = _in_root(rank.pid, pipe, proc_root)
    dump_path = f"{_first(env, DUMP_VARIABLES) or DEFAULT_DUMP_STEM}{rank.rank}"
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


def _in_root(pid: int, path: str, proc_root: str | Path) -> list[Path]:
    return [Path(proc_root) / str(pid) / "root" / path.lstrip("/"), Path(path)] if path.startswith("/") \
        else [Path(proc_root) / str(pid) / "cwd" / path, Path(path)]


def collect(asked: Sequence[FlightRecorder], asked_at: float, timeout_seconds: float = 5.0,
            proc_root: str | Path = "/proc", node: str = "") -> tuple[list[RankTrace], list[str]]:
    """The dumps of the ranks asked (`triggered`), once each is written after `asked_at` (wall time) and
    reads whole; (traces, problems). Waits at most `timeout_seconds` for all of them."""
    waiting = {f.pid: f for f in asked if f.result == "triggered" and f.dump_path}
    traces: list[RankTrace] = []
    problems: dict[int, str] = {}
    deadline = time.monotonic() + timeout_seconds
    while waiting:
        for pid, recorder in list(waiting.items()):
            for path in _in_root(pid, recorder.dump_path or "", proc_root):
                try:
                    if path.stat().st_mtime < asked_at - 1:
                        problems[pid] = f"{path}: not rewritten since it was asked for"
                        continue
                    traces.append(read(path, node=node))
                except FileNotFoundError:
                    problems[pid] = f"rank {recorder.rank}: no dump at {recorder.dump_path} yet"
                    continue
                except (OSError, FlightRecorderError) as exc:
                    problems[pid] = str(exc)  # perhaps still being written: try again until the deadline
                    continue
                del waiting[pid]
                break
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    return traces, [problems[p] for p in waiting if p in problems]
