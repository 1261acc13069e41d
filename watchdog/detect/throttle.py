"""throttle: clocks pulled down by thermal, power-brake or hardware slowdown. A warning, and the reason
busy_spin vetoes itself: a throttled GPU is slow, not spinning."""

from __future__ import annotations

import numpy as np

from watchdog.config import ThrottleConfig
from watchdog.detect.evidence import Evidence
from watchdog.detect.levels import zeroed
from watchdog.detect.stretch import Cells, Context
from watchdog.vocabulary.model import THROTTLE_REASON_MASK, Signature


def detect(cells: Cells, cfg: ThrottleConfig, ctx: Context) -> dict[int, Evidence]:
    """The evidence of each cell (by its number) whose newest sample has a hardware slowdown reason."""
    reasons = zeroed(cells.latest("clock_event_reasons")).astype(np.int64)
    out = {}
    for n in np.flatnonzero(reasons & THROTTLE_REASON_MASK).tolist():
        latest = cells.stretch.sample(int(cells.end[n]), int(cells.cols[n]))
        named = latest.throttle_reasons
        facts: dict[str, float | str] = {"reasons": ", ".join(named)}
        if latest.sm_clock_hertz is not None and latest.sm_clock_max_hertz:
            facts["clock_ratio"] = latest.sm_clock_hertz / latest.sm_clock_max_hertz
        if latest.temperature_celsius is not None:
            facts["temperature_celsius"] = latest.temperature_celsius
        out[n] = Evidence(latest.index, Signature.THROTTLE, since=float(cells.now()[n]), legs=tuple(named),
                          facts=facts)
    return out
