"""zero_util: utilization 0 while the job's memory stays held, neither growing (start-up) nor released
(the job exiting). An idle GPU with a context shows brief 1-4% blips: at least half the window at
utilization_max_ratio and none of it above blip_max_ratio is idle. A pause shorter than the episode's
for_seconds (a checkpoint) never fires."""

from __future__ import annotations

from watchdog.config import ZeroUtilConfig
from watchdog.detect.evidence import Evidence, percentile, run_start
from watchdog.detect.window import GpuRun, GpuView, span
from watchdog.model import Signature

_MIN_SAMPLES = 3


def evaluate(view: GpuView, cfg: ZeroUtilConfig) -> Evidence | None:
    latest = view.latest
    util, used = latest.utilization_ratio, latest.memory_used_bytes
    blip = cfg.blip_max_ratio
    if (util is not None and util > blip) or (used is not None and used < view.memory_min_bytes):
        return None  # an [N/A] reading is judged on the window's others
    window = view.recent(span(view, cfg.window_seconds, _MIN_SAMPLES))
    if len(window) < _MIN_SAMPLES:
        return None
    samples = [s for _, s in window]
    utils = sorted(s.utilization_ratio for s in samples if s.utilization_ratio is not None)
    if not utils or percentile(utils, 0.5) > cfg.utilization_max_ratio or utils[-1] > blip:
        return None  # at work, or more than the blips of an idle GPU
    memory = [s.memory_used_bytes for s in samples if s.memory_used_bytes is not None]
    if not memory or min(memory) < view.memory_min_bytes:
        return None  # released or not yet allocated
    if memory[-1] - memory[0] > cfg.memory_growth_max_bytes:
        return None  # still allocating: start-up
    facts: dict[str, float | str] = {"memory_used_bytes": float(memory[-1])}
    if latest.power_watts is not None:
        facts["power_watts"] = latest.power_watts
    since = run_start([t for t, _ in window], [s.utilization_ratio is None or s.utilization_ratio <= blip
                                              for _, s in window])
    return Evidence(view.index, Signature.ZERO_UTIL, since=since, facts=facts)


def steady(run: GpuRun, view: GpuView, cfg: ZeroUtilConfig) -> bool:
    """evaluate() finds nothing after any of these samples: each fails its first check (utilization
    above the blips of an idle GPU, or no job-sized memory held; an [N/A] fails neither)."""
    utils, used = run.column("utilization_ratio"), run.column("memory_used_bytes")
    blip, held = cfg.blip_max_ratio, view.memory_min_bytes
    if None not in utils and min(utils) > blip:
        return True
    if None not in used and max(used) < held:
        return True
    return all((u is not None and u > blip) or (m is not None and m < held) for u, m in zip(utils, used))
