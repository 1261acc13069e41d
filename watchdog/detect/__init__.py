"""Detectors: pure functions of a stretch of ticks x GPUs (detect/stretch.py), with time passed in.

`DETECTORS` is the one explicit table of per-GPU detectors; each name is also its config section
(`detectors.<name>`), its signature and its metric label. A detector's rule is one function,
`detect(cells, section, context) -> {cell: Evidence}`, its gate in its first lines; the daemon applies it
to its newest tick, a replay to a day. `scope` says what becomes of its evidence: a per-GPU episode of the
given severity, the job's verdict (`node.job_findings`: busy_spin, zero_util, waiting), or one warning for
the node's GPUs together (underuse).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from watchdog.detect import busy_spin, gpu_lost, straggler, throttle, underuse, zero_util
from watchdog.detect.evidence import Evidence
from watchdog.detect.stretch import Cells, Context
from watchdog.model import Severity

Rule = Callable[[Cells, Any, Context], "dict[int, Evidence]"]


@dataclass(frozen=True)
class DetectorSpec:
    rule: Rule
    scope: str  # "gpu": a per-GPU episode of `severity`; "job": the job's verdict; "node": one warning
    severity: Severity | None = None


DETECTORS: dict[str, DetectorSpec] = {
    "gpu_lost": DetectorSpec(gpu_lost.detect, "gpu", Severity.CRITICAL),
    "throttle": DetectorSpec(throttle.detect, "gpu", Severity.WARNING),
    "straggler": DetectorSpec(straggler.detect, "gpu", Severity.WARNING),
    "busy_spin": DetectorSpec(busy_spin.detect, "job"),
    "zero_util": DetectorSpec(zero_util.detect, "job"),
    "underuse": DetectorSpec(underuse.detect, "node"),
}
