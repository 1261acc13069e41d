"""throttle: clocks pulled down by thermal, power-brake or hardware slowdown. A warning, and the reason
busy_spin vetoes itself: a throttled GPU is slow, not spinning."""

from __future__ import annotations

from watchdog.config import ThrottleConfig
from watchdog.detect.evidence import Evidence
from watchdog.detect.window import GpuRun, GpuView
from watchdog.model import THROTTLE_REASON_MASK, Signature


def evaluate(view: GpuView, cfg: ThrottleConfig) -> Evidence | None:
    latest = view.latest
    if not (latest.clock_event_reasons or 0) & THROTTLE_REASON_MASK:
        return None
    reasons = latest.throttle_reasons
    facts: dict[str, float | str] = {"reasons": ", ".join(reasons)}
    if latest.sm_clock_hertz is not None and latest.sm_clock_max_hertz:
        facts["clock_ratio"] = latest.sm_clock_hertz / latest.sm_clock_max_hertz
    if latest.temperature_celsius is not None:
        facts["temperature_celsius"] = latest.temperature_celsius
    return Evidence(view.index, Signature.THROTTLE, since=view.now, legs=tuple(reasons), facts=facts)


def steady(run: GpuRun, view: GpuView, cfg: ThrottleConfig) -> bool:
    """evaluate() finds nothing after any of these samples: no hardware slowdown reason is set."""
    return not any(r & THROTTLE_REASON_MASK for r in set(run.column("clock_event_reasons")) if r)
