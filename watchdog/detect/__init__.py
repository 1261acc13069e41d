"""Detectors: pure functions of a window of samples, with time passed in.

`DETECTORS` is the one explicit table of per-GPU detectors; each name is also its config section
(`detectors.<name>`), its signature and its metric label. `node.job_findings` turns busy_spin and
zero_util evidence into job-level verdicts (busy_spin, zero_util, waiting).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from watchdog.detect import busy_spin, gpu_lost, throttle, underuse, zero_util
from watchdog.detect.evidence import Evidence
from watchdog.detect.window import GpuRun, GpuView

Detector = Callable[[GpuView, Any], "Evidence | None"]
Steady = Callable[[GpuRun, GpuView, Any], bool]

DETECTORS: dict[str, Detector] = {
    "gpu_lost": gpu_lost.evaluate,
    "throttle": throttle.evaluate,
    "busy_spin": busy_spin.evaluate,
    "zero_util": zero_util.evaluate,
    "underuse": underuse.evaluate,
}

# For each detector, whether it would find nothing on any sample of a stretch (see GpuRun): a replay
# ingests such stretches in bulk. A detector table without an entry here is run on every tick.
STEADY: dict[str, Steady] = {
    "gpu_lost": gpu_lost.steady,
    "throttle": throttle.steady,
    "busy_spin": busy_spin.steady,
    "zero_util": zero_util.steady,
    "underuse": underuse.steady,
}
