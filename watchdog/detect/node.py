"""Node-level verdicts: what the per-GPU evidence means for the job as a whole.

Among the job's GPUs (those holding memory or running kernels), with S spinning, Z idle with memory
held, and R the rest (busy, or doing something else):
  all S                      -> busy_spin, critical: a collective that will never finish
  all Z                      -> zero_util, critical
  S and Z only, |S| >= |Z|   -> waiting on Z;  |S| < |Z| -> zero_util on all, critical
  S and R, |S| >= |Z|+|R|    -> waiting on Z+R (warning; the episode escalates to critical when the wait
                                outlives a checkpoint or evaluation)
A few GPUs spinning beside a busy majority is not a verdict. A GPU that stopped answering is gpu_lost's (a
per-GPU episode of its own), never an odd GPU the others wait on: what the others do is judged without it
(spinning on a collective it can no longer join is busy_spin), and the finding names it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from watchdog.detect.evidence import Evidence
from watchdog.vocabulary.model import Finding, GpuHealth, GpuSample, Progress, Severity, Signature


class GpuView:
    """One GPU as the node's verdict looks at it on one tick. Its newest sample is built when read (only the
    GPUs the others wait on are quoted)."""

    __slots__ = ("_sample", "_latest", "health", "active", "now", "host_first_at", "host_seen_at", "moved_at",
                 "progress_still_seconds")

    def __init__(self, sample: Callable[[], GpuSample], health: GpuHealth, active: bool, now: float,
                 host_first_at: float | None, host_seen_at: float | None, moved_at: float | None,
                 progress_still_seconds: float):
        self._sample, self.health, self.active, self.now = sample, health, active, now
        self._latest: GpuSample | None = None
        self.host_first_at, self.host_seen_at, self.moved_at = host_first_at, host_seen_at, moved_at
        self.progress_still_seconds = progress_still_seconds

    @property
    def latest(self) -> GpuSample:
        latest: GpuSample | None = self._latest
        if latest is None:
            latest = self._latest = self._sample()
        return latest



def _merged_legs(evidence: list[Evidence]) -> tuple[str, ...]:
    """The legs of all the evidence, each once, in the order first named."""
    if len({e.legs for e in evidence}) == 1:  # every GPU's evidence names the same legs (a job spinning as one)
        return tuple(dict.fromkeys(evidence[0].legs))
    seen: dict[str, None] = {}
    for e in evidence:
        seen.update(dict.fromkeys(e.legs))
    return tuple(seen)


def _mean_fact(evidence: list[Evidence], name: str) -> float | None:
    values = [float(e.facts[name]) for e in evidence if name in e.facts]
    return sum(values) / len(values) if values else None


def _spin_facts(spinning: list[Evidence], gpus: list[int]) -> dict[str, float | str]:
    """The means of the spinning GPUs' facts, and which GPUs the power is the mean of where they are fewer than
    the `gpus` it is quoted for (others read no power, or spin along without evidence of their own)."""
    facts: dict[str, float | str] = {}
    for name in ("power_watts", "power_limit_watts", "idle_watts", "busy_watts", "utilization"):
        value = _mean_fact(spinning, name)
        if value is not None:
            facts[name] = value
    powered = sorted(e.gpu for e in spinning if "power_watts" in e.facts)
    if powered and len(powered) < len(gpus):
        facts["power_of"] = ", ".join(map(str, powered))
    return facts


def _culprit_facts(views: Mapping[int, GpuView], culprits: list[int]) -> dict[str, float | str]:
    """The state of the GPUs the others wait on, as quoted in the summary."""
    parts = []
    for gpu in culprits:
        s = views[gpu].latest
        bits = []
        if s.health.value != "ok":
            bits.append(s.health.value)
        if s.utilization_ratio is not None:
            bits.append(f"{s.utilization_ratio:.0%} util")
        if s.memory_used_bytes is not None:
            bits.append(f"{s.memory_used_bytes / 2**30:.1f} GiB held")
        if s.power_watts is not None:
            bits.append(f"{s.power_watts:.0f} W")
        state = ", ".join(bits) or "no readings"
        parts.append(state if len(culprits) == 1 else f"GPU {gpu}: {state}")
    return {"culprit_state": "; ".join(parts)}


_HOST_FRESH_SECONDS = 5.0  # a host reading older than this is not a current view of the processes


def progress_of(views: Mapping[int, GpuView], gpus: list[int]) -> tuple[Progress, float]:
    """Whether the processes on `gpus` move on the host, and for how long none of them has. UNKNOWN when
    no process is seen on some of them (a trace without host readings)."""
    seen = [views[i] for i in gpus]
    if not seen or any(v.host_seen_at is None or v.now - v.host_seen_at > _HOST_FRESH_SECONDS for v in seen):
        return Progress.UNKNOWN, 0.0
    now = max(v.now for v in seen)
    still = now - max(v.moved_at if v.moved_at is not None else v.host_first_at or now for v in seen)
    return Progress.STILL if still >= seen[0].progress_still_seconds else Progress.MOVING, still


def job_findings(
    views: Mapping[int, GpuView], spin: Mapping[int, Evidence], zero: Mapping[int, Evidence],
    pinned: Collection[int] = (),
) -> list[Finding]:
    """The node's verdict from its GPUs' evidence. `pinned` are GPUs at 100% util with no memory traffic
    but not enough power evidence of their own: they spin along when others do, and are never culprits."""
    lost = sorted(i for i, v in views.items() if v.health is not GpuHealth.OK)
    job = sorted(i for i, v in views.items() if i not in lost and (v.active or i in spin or i in zero))
    if not job:
        return []
    strong = [i for i in job if i in spin and not spin[i].weak]
    weak = [i for i in job if i in spin and spin[i].weak]
    along = [i for i in job if i not in spin and i not in zero and i in pinned]
    z = [i for i in job if i in zero and i not in spin]
    rest = [i for i in job if i not in spin and i not in zero and i not in pinned]
    s = sorted(strong + weak + along)  # every GPU pinned at 100% with no work seen
    spin_ev = [spin[i] for i in strong + weak]
    zero_ev = [zero[i] for i in z]

    # At least half the job must show spin evidence of its own (GPUs pinned along only join it); weak
    # evidence alone (power fell, flat) counts when every GPU is pinned.
    evidenced = len(strong) + len(weak)
    if s and not z and not rest and 2 * evidenced >= len(job) and (strong or len(s) == len(job)):
        spun = _spin_facts(spin_ev, s)
        if lost:
            spun["lost"] = ", ".join(map(str, lost))
        return [Finding(Signature.BUSY_SPIN, Severity.CRITICAL, tuple(s), since=max(e.since for e in spin_ev),
                        legs=_merged_legs(spin_ev), facts=spun, early=any(e.early for e in spin_ev))]
    if z and not rest and len(s) < len(z):
        facts: dict[str, float | str] = {}
        held = _mean_fact(zero_ev, "memory_used_bytes")
        if held is not None:
            facts["memory_used_bytes"] = held
        if s:
            facts["spinning"] = ", ".join(str(i) for i in s)
        progress, still = progress_of(views, z)
        return [Finding(Signature.ZERO_UTIL, Severity.CRITICAL, tuple(job),
                        since=max(e.since for e in zero_ev + spin_ev), facts=facts, progress=progress,
                        still_seconds=still)]
    if (strong or 2 * len(weak) >= len(job)) and (z or rest) and evidenced >= len(z) + len(rest):
        culprits = z + rest
        facts = _spin_facts(spin_ev, s)
        facts.update(_culprit_facts(views, culprits))
        # The culprits busy on the host (a checkpoint writer) is a pause; still, it is a hang only for culprits
        # idle on the GPU: one still at work on its GPU may use no CPU.
        progress, still = progress_of(views, culprits)
        if rest and progress is Progress.STILL:
            progress, still = Progress.UNKNOWN, 0.0
        return [Finding(Signature.WAITING, Severity.WARNING, tuple(job), since=max(e.since for e in spin_ev),
                        culprit_gpus=tuple(sorted(culprits)), legs=_merged_legs(spin_ev), facts=facts,
                        progress=progress, still_seconds=still, culprits_busy=bool(rest),
                        early=any(e.early for e in spin_ev))]
    return []


def underuse_finding(evidence: list[Evidence]) -> Finding:
    """Every under-used GPU in one warning: the job is slow as a whole, not GPU by GPU."""
    facts: dict[str, float | str] = {
        "mean_utilization": _mean_fact(evidence, "mean_utilization") or 0.0,
        "window_seconds": min(float(e.facts["window_seconds"]) for e in evidence),
    }
    return Finding(Signature.UNDERUSE, Severity.WARNING, tuple(sorted(e.gpu for e in evidence)),
                   since=min(e.since for e in evidence), facts=facts)
