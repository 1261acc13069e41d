"""zero_util: utilization 0 while the job's memory stays held, neither growing (start-up) nor released
(the job exiting). A pause shorter than the episode's for_seconds (a checkpoint) never fires."""

from __future__ import annotations

from watchdog.config import ZeroUtilConfig
from watchdog.detect.evidence import Evidence, percentile, run_start
from watchdog.detect.window import GpuRun, GpuView
from watchdog.model import Signature


def evaluate(view: GpuView, cfg: ZeroUtilConfig) -> Evidence | None:
    latest = view.latest
    util, used = latest.utilization_ratio, latest.memory_used_bytes
    if util is None or util > cfg.utilization_max_ratio or used is None or used < view.memory_min_bytes:
        return None
    window = view.recent(cfg.window_seconds)
    if len(window) < 3:
        return None
    samples = [s for _, s in window]
    utils = sorted(s.utilization_ratio for s in samples if s.utilization_ratio is not None)
    if percentile(utils, 0.9) > cfg.utilization_max_ratio:
        return None
    memory = [s.memory_used_bytes for s in samples if s.memory_used_bytes is not None]
    if min(memory) < view.memory_min_bytes:
        return None  # released or not yet allocated
    if memory[-1] - memory[0] > cfg.memory_growth_max_bytes:
        return None  # still allocating: start-up
    facts: dict[str, float | str] = {"memory_used_bytes": float(memory[-1])}
    if latest.power_watts is not None:
        facts["power_watts"] = latest.power_watts
    ceiling = cfg.utilization_max_ratio
    since = run_start([t for t, _ in window], [s.utilization_ratio is not None and s.utilization_ratio <= ceiling
                                              for _, s in window])
    return Evidence(view.index, Signature.ZERO_UTIL, since=since, facts=facts)


def steady(run: GpuRun, view: GpuView, cfg: ZeroUtilConfig) -> bool:
    """evaluate() finds nothing after any of these samples: each fails its first check (utilization
    above the ceiling, or no job-sized memory held)."""
    utils, used = run.column("utilization_ratio"), run.column("memory_used_bytes")
    ceiling, held = cfg.utilization_max_ratio, view.memory_min_bytes
    if None not in utils and min(utils) > ceiling:
        return True
    if None not in used and max(used) < held:
        return True
    return all(u is None or u > ceiling or m is None or m < held for u, m in zip(utils, used))
