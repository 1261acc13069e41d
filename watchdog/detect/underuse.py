"""underuse: a running job that keeps its GPU mostly idle for a long time (the MoE fine-tune at 30-40%
for hours). A warning: nobody should be paged for it."""

from __future__ import annotations

from watchdog.config import UnderuseConfig
from watchdog.detect.evidence import Evidence
from watchdog.detect.window import GpuView
from watchdog.model import Signature


def evaluate(view: GpuView, cfg: UnderuseConfig) -> Evidence | None:
    mean = view.long_mean_utilization
    if mean is None or not view.active or view.long_span_seconds < 0.9 * cfg.window_seconds:
        return None
    if not cfg.utilization_min_ratio <= mean <= cfg.utilization_max_ratio:
        return None
    return Evidence(
        view.index,
        Signature.UNDERUSE,
        since=view.now - view.long_span_seconds,
        facts={"mean_utilization": mean, "window_seconds": view.long_span_seconds},
    )
