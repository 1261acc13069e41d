"""One line a person can act on, for each episode event."""

from __future__ import annotations

from watchdog.model import Finding, Severity, Signature, Verdict, duration_text, gpu_list


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


_WORDS = {Signature.BUSY_SPIN: "SPIN", Signature.ZERO_UTIL: "PAUSE", Signature.WAITING: "WAITING",
          Signature.UNDERUSE: "UNDER-USE", Signature.THROTTLE: "THROTTLED", Signature.GPU_LOST: "GPU LOST"}
_STALLS = (Signature.BUSY_SPIN, Signature.ZERO_UTIL, Signature.WAITING)


def headline(finding: Finding, elapsed_seconds: float, severity: Severity, stacks: Verdict | None = None) -> str:
    """The verdict first: 'HANG (critical): rank 4 (pid 8358, GPU 4) is stuck in ...; the other 7 ranks wait
    for it in all_reduce'. Stacks name the ranks when they were captured; telemetry names the GPUs."""
    word = "HANG" if severity is Severity.CRITICAL and finding.signature in _STALLS else _WORDS[finding.signature]
    if stacks is not None and stacks.headline and stacks.kind != "no_stall":
        return f"{word} ({severity.value}): {stacks.headline}"
    f, gpus, lasting = finding.facts, gpu_list(finding.gpus), duration_text(elapsed_seconds)
    sig = finding.signature
    if sig is Signature.BUSY_SPIN:
        what = f"{gpus} spin at 100% util doing no work for {lasting}"
    elif sig is Signature.ZERO_UTIL:
        held = f.get("memory_used_bytes")
        what = f"{gpus} idle for {lasting}" + (f" with {float(held) / 2**30:.1f} GiB held" if held else "")
    elif sig is Signature.WAITING:
        spinners = gpu_list([g for g in finding.gpus if g not in finding.culprit_gpus])
        what = f"{spinners} wait on {gpu_list(finding.culprit_gpus)} for {lasting}"
    elif sig is Signature.UNDERUSE:
        what = f"{gpus} at {float(f.get('mean_utilization', 0)):.0%} mean util for {lasting}"
    elif sig is Signature.THROTTLE:
        what = f"{gpus} throttled for {lasting}: slow, not stalled"
    else:
        what = f"{gpus} stopped answering NVML for {lasting}"
    return f"{word} ({severity.value}): {what}"


def evidence(finding: Finding, elapsed_seconds: float, unbroken_seconds: float | None = None) -> str:
    """The telemetry behind the verdict, without a judgement of its own."""
    f = finding.facts
    gpus = gpu_list(finding.gpus)
    lasting = duration_text(elapsed_seconds)
    legs = f" [{', '.join(finding.legs)}]" if finding.legs else ""
    sig = finding.signature
    if sig is Signature.BUSY_SPIN:
        power = f"only {_power(f)}" if "power_watts" in f else "no real work"
        return f"Busy spin on {gpus} for {lasting}: 100% util but {power}{legs}"
    if sig is Signature.WAITING:
        spinners = gpu_list([g for g in finding.gpus if g not in finding.culprit_gpus])
        text = (f"{spinners} spin at 100% util, {_power(f)}, waiting on {gpu_list(finding.culprit_gpus)} "
                f"({f.get('culprit_state', '')}) for {lasting}")
        unbroken = elapsed_seconds if unbroken_seconds is None else unbroken_seconds
        if unbroken < elapsed_seconds - 1:
            text += f" (the last {duration_text(unbroken)} without progress)"
        return text + legs
    if sig is Signature.ZERO_UTIL:
        held = f.get("memory_used_bytes")
        held_text = f" with {float(held) / 2**30:.1f} GiB held" if held else " with memory held"
        spin = f"; GPUs {f['spinning']} spin waiting on them" if "spinning" in f else ""
        return f"Zero util on {gpus} for {lasting}: 0% util{held_text}, memory neither growing nor released{spin}"
    if sig is Signature.UNDERUSE:
        return (f"Under-use on {gpus} for {lasting}: {float(f.get('mean_utilization', 0)):.0%} mean util over "
                f"the last {duration_text(float(f.get('window_seconds', 0)))}; the job runs but leaves the GPUs idle")
    if sig is Signature.THROTTLE:
        clock = f" at {float(f['clock_ratio']):.0%} of max SM clock" if "clock_ratio" in f else ""
        temp = f", {float(f['temperature_celsius']):.0f} C" if "temperature_celsius" in f else ""
        return f"{gpus} throttled for {lasting} ({f.get('reasons', '')}){clock}{temp}"
    if sig is Signature.GPU_LOST:
        errors = f.get("errors") or "no answer"
        return f"{gpus} stopped answering NVML for {lasting} ({errors}): drain the node and reset the GPU"
    return f"{sig.value} on {gpus} for {lasting}"


def summarize(finding: Finding, elapsed_seconds: float, severity: Severity, reason: str = "",
              stacks: Verdict | None = None, unbroken_seconds: float | None = None) -> tuple[str, str]:
    """(headline, summary): the summary is the headline, why this severity, then the evidence."""
    head = headline(finding, elapsed_seconds, severity, stacks)
    text = head + (f"; {reason}" if reason else "") + ". " + evidence(finding, elapsed_seconds, unbroken_seconds)
    if stacks is not None:
        text += f". Stacks: {stacks.sentence}"
    return head, text
