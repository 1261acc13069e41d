"""A job that crashed, as its log says it: the error a rank died of (CUDA out of memory, an illegal memory
access, a NCCL error, a signal), and which rank, from the `[rankN]:` prefix PyTorch puts on each rank's lines or
torchrun's failure summary. A crash is not a hang: `analyze` says which rank crashed of what.

A collective's timeout also ends in a traceback and an abort: the lines that say a timeout (the watchdog's, or a
`timed out`) are never read as the crash; the timeout reader has them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from watchdog.pasted.finding import Finding
from watchdog.vocabulary.model import Severity

# (what a person calls it, the line that says it), the most telling first
_ERRORS: tuple[tuple[str, re.Pattern[str]], ...] = tuple((name, re.compile(pattern, re.IGNORECASE)) for name, pattern in (  # noqa: E501
    ("CUDA out of memory", r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED"),
    ("an illegal memory access", r"illegal memory access|CUDA_ERROR_ILLEGAL_ADDRESS|misaligned address"),
    ("a device-side assert", r"device-side assert(?:ion)? triggered"),
    ("a CUDA error", r"CUDA error:|CUDA_ERROR_|cudaError"),
    ("a NCCL error", r"(?<![\w-])NCCL error(?: in:|:)|"
                     r"\bnccl(?:UnhandledCuda|System|Internal|InvalidUsage|Remote)Error\b"),
    ("a GPU hardware exception", r"HW Exception by GPU"),
    ("collectives that do not match (TORCH_DISTRIBUTED_DEBUG)", r"Detected mismatch between collectives"),
    ("a segmentation fault", r"Segmentation fault|SIGSEGV|exitcode\s{0,4}:\s{0,4}-11\b"),
    ("SIGKILL (the host's out-of-memory killer, or a person)", r"Signal 9 \(SIGKILL\)|exitcode\s{0,4}:\s{0,4}-9\b"),
    ("a Python exception", r"^\s*(?:\[rank\d{1,6}\]:\s*)?(?:[A-Za-z_][\w.]{0,80}\.)?(?!ChildFailedError)[A-Z]\w{0,60}"
                           r"(?:Error|Exception):"),  # ChildFailedError is torchrun's own: its summary names the rank
))
# A watchdog's timeout and the abort after it (a watchdog thread that died of an error is a crash, and said)
_TIMEOUT = re.compile(r"time[ds]?[ _-]?out|Timeout|SIGABRT|exitcode\s*:?\s*-6\b|Signal 6\b", re.IGNORECASE)
GPU_FAULTS = ("a GPU hardware exception",)  # the GPU failed: the ranks that then time out wait on it
_RANK_PREFIX = re.compile(r"^\s*\[(?:rank|default)\s?(?P<rank>\d{1,6})\]:?")
_SUMMARY_RANK = re.compile(r"^\s*rank\s*:\s*(?P<rank>\d{1,6})\s*\(local_rank")
_SUMMARY_EXIT = re.compile(r"^\s*exitcode\s*:\s*(?P<code>-?\d{1,4})\b")
_FAILED_LOCAL = re.compile(r"failed \(exitcode: (?P<code>-?\d{1,4})\) local_rank: (?P<local>\d{1,6})")
_TRACEBACK = re.compile(r"Traceback \(most recent call last\)|ChildFailedError|exitcode\s*:?\s*-?\d|"
                        r"terminate called after", re.IGNORECASE)
_MOST_LINES = 200_000


@dataclass(frozen=True)
class Crash:
    what: str  # "CUDA out of memory"
    line: str  # the line that says it, cut short
    rank: str | None  # "rank 3", "local rank 3"; None when the log does not say


def looks_like(text: str) -> bool:
    """A traceback or a launcher's failure, or a line that names an error of its own (a paste of the last lines
    often holds just `RuntimeError: CUDA error: an illegal memory access was encountered`)."""
    head = text[:1 << 22]
    return bool(_TRACEBACK.search(head)) or any(pattern.search(head) for name, pattern in _ERRORS
                                                 if name not in _GENERIC)


_GENERIC = ("a Python exception", "SIGKILL (the host's out-of-memory killer, or a person)")


def crashes(text: str, generic: bool = True) -> list[Crash]:
    """Each rank's first error (the first of all when no rank is said), in the order they came. `generic` False
    (the text also holds a collective's timeout): an exception or a kill without a cause of its own is the
    timeout's consequence (PyTorch raises and the launcher kills after it), not a crash."""
    found: dict[str | None, Crash] = {}
    summary_rank: str | None = None
    summary_exit: str | None = None
    for line in text.splitlines()[:_MOST_LINES]:
        line = line[:2000]
        m = _SUMMARY_RANK.match(line)
        if m:
            summary_rank = f"rank {int(m['rank'])}"
        m = _SUMMARY_EXIT.match(line)
        if m and summary_rank is not None and summary_exit is None and m["code"] not in ("-6", "0"):
            summary_exit = _short(line)
        m = _FAILED_LOCAL.search(line)
        if m and f"local rank {int(m['local'])}" not in found and not _TIMEOUT.search(line):
            name = _what(line)
            if generic and (name is not None or m["code"] != "1"):
                local = f"local rank {int(m['local'])}"
                found.setdefault(local, Crash(name or f"exit code {m['code']}", _short(line), local))
            continue
        if _TIMEOUT.search(line):
            continue
        name = _what(line)
        if name is None or (not generic and name in _GENERIC):
            continue
        prefix = _RANK_PREFIX.match(line)
        rank = f"rank {int(prefix['rank'])}" if prefix else None
        if rank is not None or not found:
            found.setdefault(rank, Crash(name, _short(line), rank))
    if summary_rank is not None and not any(c.rank and c.rank.startswith("rank ") for c in found.values()):
        first = next(iter(found.values()), None)
        if first is not None:
            return [Crash(first.what, first.line, summary_rank)]
        if summary_exit is not None and generic:  # torchrun's summary alone: the rank and how it exited
            return [Crash(f"an error (torchrun: {summary_exit.strip()})", summary_exit, summary_rank)]
    named = [c for c in found.values() if c.rank is not None]
    return named or list(found.values())[:1]


def _what(line: str) -> str | None:
    return next((name for name, pattern in _ERRORS if pattern.search(line)), None)


def _short(line: str) -> str:
    """The line, cut at a word's end near 160 characters (a number cut short would read as another)."""
    line = " ".join(line.split())
    if len(line) <= 160:
        return line
    cut = line.rfind(" ", 100, 160)
    return line[:cut if cut > 0 else 160] + " ..."


def judge(found: list[Crash]) -> Finding | None:
    if not found:
        return None
    first = found[0]
    ranks = [c.rank for c in found if c.rank]
    who = ", ".join(ranks[:6]) + (f" and {len(ranks) - 6} more" if len(ranks) > 6 else "") if ranks else "a process"
    lines = "; ".join(f"{c.rank or 'a process'}: '{c.line}'" for c in found[:4])
    return Finding("crash", Severity.CRITICAL,
                   f"{who} crashed: {first.what} ({lines}). A crash, not a hang: the other ranks stop when their "
                   "launcher ends them, or wait in their next collective until its timeout",
                   f"{who} crashed: {first.what}", tuple(r for r in ranks if r.startswith("rank "))[:16])
