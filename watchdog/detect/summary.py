"""One line a person can act on, for each episode event."""

from __future__ import annotations

from watchdog.model import Finding, Signature, gpu_list


def duration_text(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds / 3600:.1f} h"


def _power(facts: dict[str, float | str]) -> str:
    power = facts.get("power_watts")
    if power is None:
        return ""
    text = f"{float(power):.0f} W"
    limit = facts.get("power_limit_watts")
    if limit:
        text += f" of {float(limit):.0f} W"
    idle = facts.get("idle_watts")
    if idle:
        text += f" ({float(power) / float(idle):.1f}x idle)"
    return text


def summarize(
    finding: Finding,
    elapsed_seconds: float,
    escalate_after_seconds: float | None = None,
    unbroken_seconds: float | None = None,
) -> str:
    f = finding.facts
    gpus = gpu_list(finding.gpus)
    lasting = duration_text(elapsed_seconds)
    legs = f" [{', '.join(finding.legs)}]" if finding.legs else ""
    sig = finding.signature
    if sig is Signature.BUSY_SPIN:
        power = f"only {_power(f)}" if "power_watts" in f else "no real work"
        return (f"Busy-spin hang on {gpus} for {lasting}: 100% util but {power}; "
                f"a collective that will not finish{legs}")
    if sig is Signature.WAITING:
        spinners = gpu_list([g for g in finding.gpus if g not in finding.culprit_gpus])
        text = (f"{spinners} spin at 100% util, {_power(f)}, waiting on {gpu_list(finding.culprit_gpus)} "
                f"({f.get('culprit_state', '')}) for {lasting}")
        unbroken = elapsed_seconds if unbroken_seconds is None else unbroken_seconds
        if unbroken < elapsed_seconds - 1:
            text += f" (the last {duration_text(unbroken)} without progress)"
        if escalate_after_seconds is not None and unbroken >= escalate_after_seconds:
            culprits = gpu_list(finding.culprit_gpus)
            return (text + "; longer than a checkpoint or evaluation should take, "
                    f"so {culprits} is the likely culprit{legs}")
        limit = f", critical after {duration_text(escalate_after_seconds)}" if escalate_after_seconds else ""
        return text + f"; a checkpoint or evaluation on the odd GPU is plausible{limit}{legs}"
    if sig is Signature.ZERO_UTIL:
        held = f.get("memory_used_bytes")
        held_text = f" with {float(held) / 2**30:.1f} GiB held" if held else " with memory held"
        spin = f"; GPUs {f['spinning']} spin waiting on them" if "spinning" in f else ""
        return (f"Zero-util hang on {gpus} for {lasting}: 0% util{held_text}, memory neither growing nor "
                f"released{spin}")
    if sig is Signature.UNDERUSE:
        return (f"Under-use on {gpus} for {lasting}: {float(f.get('mean_utilization', 0)):.0%} mean util over "
                f"the last {duration_text(float(f.get('window_seconds', 0)))}; the job runs but leaves the GPUs idle")
    if sig is Signature.THROTTLE:
        clock = f" at {float(f['clock_ratio']):.0%} of max SM clock" if "clock_ratio" in f else ""
        temp = f", {float(f['temperature_celsius']):.0f} C" if "temperature_celsius" in f else ""
        return f"{gpus} throttled for {lasting} ({f.get('reasons', '')}){clock}{temp}: slow, not stalled"
    if sig is Signature.GPU_LOST:
        errors = f.get("errors") or "no answer"
        return f"{gpus} stopped answering NVML for {lasting} ({errors}): drain the node and reset the GPU"
    return f"{sig.value} on {gpus} for {lasting}"
