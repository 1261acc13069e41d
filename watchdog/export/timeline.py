"""Replay output: one JSON object per episode event, or a timeline a person reads top to bottom."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TextIO

from watchdog.detect.summary import duration_text
from watchdog.vocabulary.model import EpisodeEvent, EventKind, Severity
from watchdog.vocabulary.words import counted, iso_time


def json_line(event: EpisodeEvent, naive_time: bool, trace: str | None = None) -> str:
    """One event as a JSON object; `trace` names its trace where one output holds many."""
    body = event.to_json(naive_time)
    return json.dumps({"trace": trace, **body} if trace is not None else body)


class TextTimeline:
    def __init__(self, out: TextIO, source: str, naive_time: bool):
        self.out = out
        self.source = source
        self.naive = naive_time
        self.fired: dict[Severity, int] = {Severity.CRITICAL: 0, Severity.WARNING: 0}

    def event(self, e: EpisodeEvent) -> None:
        clock = iso_time(e.at_seconds, self.naive).replace("T", " ")
        kind = e.event.value.upper() if e.event is not EventKind.RESOLVED else e.event.value
        if e.event is EventKind.FIRED:
            self.fired[e.severity] += 1
        elif e.event is EventKind.ESCALATED:  # the episode now counts as critical
            self.fired[Severity.WARNING] -= 1
            self.fired[Severity.CRITICAL] += 1
        self.out.write(f"{clock}  {kind:<9} {e.severity.value:<8} {e.signature.value:<9} {e.summary}\n")

    def footer(self, first: float, last: float, samples: int, gpus: int, still_open: Sequence[str],
               observed: float | None = None) -> None:
        """`first` and `last` as stamped; `observed`, the time the samples span on the trace's clock as read
        (a clock set back an hour mid-log spans its samples, not minus an hour)."""
        observed = last - first if observed is None else observed
        span = duration_text(observed)
        if abs(observed - (last - first)) >= 1:
            span += " observed: the clock was stepped"
        self.out.write(f"{self.source}: {counted(samples, 'sample')} of {counted(gpus, 'GPU')}, "
                       f"{iso_time(first, self.naive)} to {iso_time(last, self.naive)} ({span}). ")
        total = sum(self.fired.values())
        self.out.write(f"{counted(total, 'episode')} fired: {self.fired[Severity.CRITICAL]} critical, "
                       f"{self.fired[Severity.WARNING]} warning. ")
        self.out.write(f"Still open at the end: {', '.join(still_open) if still_open else 'none'}.\n")
