"""gpu_lost: the GPU stopped answering NVML (GPU is lost / unknown error) or an NVML call on it hung."""

from __future__ import annotations

from watchdog.config import GpuLostConfig
from watchdog.detect.evidence import Evidence
from watchdog.detect.window import GpuRun, GpuView
from watchdog.model import GpuHealth, Signature


def evaluate(view: GpuView, cfg: GpuLostConfig) -> Evidence | None:
    latest = view.latest
    if latest.health is GpuHealth.OK:
        return None
    since = view.now
    for t, sample in reversed(view.samples):
        if sample.health is GpuHealth.OK:
            break
        since = t
    errors = "; ".join(f"{k}: {v}" for k, v in latest.errors)
    return Evidence(
        view.index, Signature.GPU_LOST, since=since, legs=(latest.health.value,), facts={"errors": errors}
    )


def steady(run: GpuRun, view: GpuView, cfg: GpuLostConfig) -> bool:
    """evaluate() finds nothing after any of these samples: every one answered."""
    return run.column("health").count(GpuHealth.OK) == len(run)
