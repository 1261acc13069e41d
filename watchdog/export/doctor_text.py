"""The doctor's report for a terminal: worst first, each with its evidence and fix."""

from __future__ import annotations

from collections.abc import Sequence

from watchdog.detect.doctor import DoctorFinding

_MARK = {"error": "ERROR", "warning": "WARN ", "unknown": "  ?  ", "info": "info ", "ok": " ok  "}


def render(findings: Sequence[DoctorFinding], title: str) -> str:
    lines = [title]
    for f in findings:
        lines.append(f"  {_MARK[f.severity]} {f.check:<19} {f.evidence}")
        if f.fix and f.severity in ("error", "warning", "info"):
            lines.append(f"  {'':5} {'':<19} -> {f.fix}")
    counts = {s: sum(f.severity == s for f in findings) for s in ("error", "warning", "unknown")}
    lines.append(f"{counts['error']} error(s), {counts['warning']} warning(s), {counts['unknown']} unknown")
    return "\n".join(lines)
