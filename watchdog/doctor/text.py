"""The doctor's report for a terminal: worst first, each with its evidence and fix."""

from __future__ import annotations

from collections.abc import Sequence

from watchdog.doctor.finding import ERROR, INFO, UNKNOWN, WARNING, DoctorFinding
from watchdog.vocabulary.words import counted

_MARK = {"error": "ERROR", "warning": "WARN ", "unknown": "  ?  ", "info": "info ", "ok": " ok  "}  # by Level value


def render(findings: Sequence[DoctorFinding], title: str) -> str:
    lines = [title]
    for f in findings:
        lines.append(f"  {_MARK[f.severity.value]} {f.check:<19} {f.evidence}")
        if f.fix and f.severity in (ERROR, WARNING, INFO):
            lines.append(f"  {'':5} {'':<19} -> {f.fix}")
    counts = {s: sum(f.severity == s for f in findings) for s in (ERROR, WARNING, UNKNOWN)}
    lines.append(f"{counted(counts[ERROR], 'error')}, {counted(counts[WARNING], 'warning')}, {counts[UNKNOWN]} unknown")
    return "\n".join(lines)
