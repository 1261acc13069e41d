"""How the project writes numbers, times and counts in its sentences (summaries, alerts, actions, reports): one
place, so every sentence that counts GPUs or says a duration says it the same way."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone


def iso_time(seconds: float, naive: bool = False) -> str:
    """ISO-8601 with milliseconds. Naive traces (nvidia-smi's local timestamps) stay without an offset."""
    stamp = datetime.fromtimestamp(seconds, tz=timezone.utc)
    if naive:
        stamp = stamp.replace(tzinfo=None)
    return stamp.isoformat(timespec="milliseconds")


def duration_text(seconds: float) -> str:
    """'45 s', '2 min 10 s', '3.5 h': a duration in summaries, alerts and actions."""
    seconds = max(0, round(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds / 3600:.1f} h"


def plural(count: int, one: str, many: str | None = None) -> str:
    """The word that agrees with `count`: plural(1, "GPU") is 'GPU', plural(2, "GPU") 'GPUs'; irregular words
    and verbs name both forms: plural(n, "process", "processes"), plural(n, "spins", "spin"). Every generated
    sentence that counts says it through here."""
    return one if count == 1 else many if many is not None else one + "s"


def counted(count: int, one: str, many: str | None = None) -> str:
    """'1 GPU', '8 GPUs', '1 process', '3 processes': a number and the noun that agrees with it."""
    return f"{count} {plural(count, one, many)}"


def number_runs(numbers: Sequence[int]) -> str:
    """'0-3', '0, 2, 5-7': sorted, with runs of three or more written as a range."""
    runs: list[list[int]] = []
    for n in sorted(set(numbers)):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def gpu_list(gpus: tuple[int, ...] | list[int]) -> str:
    """'GPU 3', 'GPUs 0-7', 'GPUs 0-3, 5-7', 'GPUs 0, 2, 5' - compact, for summaries."""
    items = sorted(set(gpus))
    return f"{plural(len(items), 'GPU')} {number_runs(items)}"
