"""Ask PyTorch to dump its NCCL Flight Recorder, with no change to the training code.

When a rank runs with TORCH_NCCL_DEBUG_INFO_PIPE_FILE=<stem> (newer PyTorch: TORCH_FR_DEBUG_INFO_PIPE_FILE)
and TORCH_NCCL_TRACE_BUFFER_SIZE (TORCH_FR_BUFFER_SIZE) > 0, ProcessGroupNCCL opens a named pipe
`<stem><rank>.pipe`; writing to it makes that rank write its collective history to
`<TORCH_FR_DUMP_TEMP_FILE or TORCH_NCCL_DEBUG_INFO_TEMP_FILE><rank>` (default /tmp/nccl_trace_rank_<rank>).
The pipe and the dump are reached inside the rank's own filesystem only (watchdog/boundary/rank_files.py: from
/proc/<pid>/root, no `..`, no symlinks, the type checked on the opened descriptor, reads capped and
timed), so a rank in a container is found in its own filesystem and a rank cannot point root elsewhere.
`collect` waits for the dumps asked for and reads them back (stacks/fr_dumps.py).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from watchdog.boundary import rank_files
from watchdog.sample.ranks import RankInfo
from watchdog.stacks.fr_dumps import MAX_DUMP_BYTES, FlightRecorderError, RankTrace, parse

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
    dump_path = f"{_first(env, DUMP_VARIABLES) or DEFAULT_DUMP_STEM}{rank.rank}"
    try:
        rank_files.write_fifo(rank.pid, pipe, b"1\n", proc_root)
    except rank_files.NoReader as exc:
        return FlightRecorder(rank.pid, rank.rank, "not_listening", str(exc))
    except rank_files.RankFileError as exc:
        if exc.missing:
            return FlightRecorder(rank.pid, rank.rank, "no_pipe", f"{pipe} does not exist (the process group "
                                                                   "may not be created yet)")
        return FlightRecorder(rank.pid, rank.rank, "failed", str(exc))
    return FlightRecorder(rank.pid, rank.rank, "triggered", f"asked rank {rank.rank} to dump to {dump_path}",
                          dump_path)


def collect(asked: Sequence[FlightRecorder], asked_at: float, timeout_seconds: float = 5.0,
            proc_root: str | Path = "/proc", node: str = "") -> tuple[list[RankTrace], list[str]]:
    """The dumps of the ranks asked (`triggered`), once each is written after `asked_at` (wall time) and
    reads whole; (traces, problems). Waits at most `timeout_seconds` for all of them."""
    waiting = {f.pid: f for f in asked if f.result == "triggered" and f.dump_path}
    traces: list[RankTrace] = []
    problems: dict[int, str] = {}
    refused: list[str] = []
    deadline = time.monotonic() + timeout_seconds
    while waiting:
        for pid, recorder in list(waiting.items()):
            path = recorder.dump_path or ""
            try:
                found = rank_files.read(pid, path, MAX_DUMP_BYTES, max(0.1, deadline - time.monotonic()),
                                        proc_root)
                if found.mtime < asked_at - 1:
                    problems[pid] = f"{path}: not rewritten since it was asked for"
                    continue
                traces.append(parse(found.data, recorder.rank, path, node))
            except rank_files.RankFileError as exc:
                problems[pid] = (f"rank {recorder.rank}: no dump at {path} yet" if exc.missing else str(exc))
                continue
            except FlightRecorderError as exc:
                problems[pid] = str(exc)
                if not exc.final:  # perhaps still being written: try again until the deadline
                    continue
                refused.append(str(exc))  # refused for what it holds: not read again and again
            del waiting[pid]
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    return traces, refused + [problems[p] for p in waiting if p in problems]
