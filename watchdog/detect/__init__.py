"""Detectors: pure functions of a stretch of ticks x GPUs (detect/stretch.py), with time passed in.

`DETECTORS` is the one explicit table of per-GPU detectors; each name is also its config section
(`detectors.<name>`), its signature and its metric label. A detector's rule is one function,
`detect(cells, section, context) -> {cell: Evidence}`, its gate in its first lines; the daemon applies it
to its newest tick, a replay to a day. `scope` says what becomes of its evidence: a per-GPU episode of the
given severity, the job's verdict (`node.job_findings`: busy_spin, zero_util, waiting), or one warning for
the node's GPUs together (underuse).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from watchdog.detect import busy_spin, gpu_lost, straggler, throttle, underuse, zero_util
from watchdog.detect.evidence import Evidence
from watchdog.detect.stretch import Cells, Context
from watchdog.vocabulary.model import Severity

Rule = Callable[[Cells, Any, Context], "dict[int, Evidence]"]


@dataclass(frozen=True)
class DetectorSpec:
    rule: Rule
    scope: str  # "gpu": a per-GPU episode of `severity`; "job": the job's verdict; "node": one warning
    severity: Severity | None = None
    # The cells whose GPUs this detector judges, that another leaves to it (its gate, as a mask of cells).
    claims: Callable[[Cells, Any], np.ndarray] | None = None
    yields_to: str | None = None  # the detector whose claimed cells this one leaves alone, while it runs


DETECTORS: dict[str, DetectorSpec] = {
    "gpu_lost": DetectorSpec(gpu_lost.detect, "gpu", Severity.CRITICAL),
    # A GPU held down below its working peers is the straggler rule's to name (one alert, with the slowdown
    # it costs the job); throttle names the rest: a GPU idle, alone, or held down with all its peers.
    "throttle": DetectorSpec(throttle.detect, "gpu", Severity.WARNING, yields_to="straggler"),
    "straggler": DetectorSpec(straggler.detect, "gpu", Severity.WARNING,
                              claims=lambda cells, cfg: straggler.below_peers(cells, cfg)[0]),
    "busy_spin": DetectorSpec(busy_spin.detect, "job"),
    "zero_util": DetectorSpec(zero_util.detect, "job"),
    "underuse": DetectorSpec(underuse.detect, "node"),
}


def leave_claimed(found: dict[str, dict[int, Evidence]], failed: set[str], cells: Cells,
                  detectors: Mapping[str, DetectorSpec], sections: Any) -> None:
    """A GPU another detector judges is left to it (one alert for one cause): the evidence of a detector that
    yields drops the cells the other claims, while the other runs."""
    for name, spec in detectors.items():
        other = spec.yields_to
        if other and found.get(name) and other in found and other not in failed:
            claims = detectors[other].claims
            assert claims is not None, f"{name} yields to {other}, which claims nothing"
            claimed = claims(cells, getattr(sections, other))
            found[name] = {cell: e for cell, e in found[name].items() if not claimed[cell]}
