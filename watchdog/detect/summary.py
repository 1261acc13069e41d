"""One line a person can act on, for each episode event."""

from __future__ import annotations

from watchdog.detect.gpu_health import summary_of
from watchdog.vocabulary.model import Finding, Severity, Signature, Verdict
from watchdog.vocabulary.words import duration_text, gpu_list, plural


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


def _quoted_power(facts: dict[str, float | str]) -> str:
    """The power quoted for spinning GPUs, naming the GPUs it is the mean of where not all of them."""
    of = _gpus_of(facts.get("power_of"))
    return _power(facts) + (f" on {gpu_list(of)}" if of else "")


def _lasting(seconds: float) -> str:
    """' for 45 s'; nothing for a stretch too short to count (a GPU lost on this very sample has not been
    lost 'for 0 s')."""
    return f" for {duration_text(seconds)}" if round(seconds) >= 1 else ""


def _gpus_of(fact: float | str | None) -> list[int]:
    """GPUs a finding's fact lists ('2, 5', as detect/node.py writes them)."""
    return [int(part) for part in str(fact).split(",") if part.strip().isdigit()] if fact is not None else []


_WORDS = {Signature.BUSY_SPIN: "SPIN", Signature.ZERO_UTIL: "PAUSE", Signature.WAITING: "WAITING",
          Signature.UNDERUSE: "UNDER-USE", Signature.THROTTLE: "THROTTLED", Signature.GPU_LOST: "GPU LOST",
          Signature.GPU_HEALTH: "GPU FAULT", Signature.STRAGGLER: "STRAGGLER"}
_STALLS = (Signature.BUSY_SPIN, Signature.ZERO_UTIL, Signature.WAITING)


def headline(finding: Finding, elapsed_seconds: float, severity: Severity, stacks: Verdict | None = None) -> str:
    """The verdict first: 'HANG (critical): rank 4 (pid 8358, GPU 4) is stuck in ...; the other 7 ranks wait
    for it in all_reduce'. Stacks name the ranks when they were captured; telemetry names the GPUs."""
    word = "HANG" if severity is Severity.CRITICAL and finding.signature in _STALLS else _WORDS[finding.signature]
    if stacks is not None and stacks.headline and stacks.kind != "no_stall":
        return f"{word} ({severity.value}): {stacks.headline}"
    f, gpus, lasting = finding.facts, gpu_list(finding.gpus), _lasting(elapsed_seconds)
    sig = finding.signature
    if sig is Signature.BUSY_SPIN:
        lost = _gpus_of(f.get("lost"))
        what = (f"{gpus} {plural(len(finding.gpus), 'spins', 'spin')} at 100% util doing no work{lasting}"
                + (f" ({gpu_list(lost)} lost)" if lost else ""))
    elif sig is Signature.ZERO_UTIL:
        held = f.get("memory_used_bytes")
        what = f"{gpus} idle{lasting}" + (f" with {float(held) / 2**30:.1f} GiB held" if held else "")
    elif sig is Signature.WAITING:
        spinners = [g for g in finding.gpus if g not in finding.culprit_gpus]
        what = (f"{gpu_list(spinners)} {plural(len(spinners), 'waits', 'wait')} on {gpu_list(finding.culprit_gpus)}"
                f"{lasting}")
    elif sig is Signature.UNDERUSE:
        what = f"{gpus} at {float(f.get('mean_utilization', 0)):.0%} mean util{lasting}"
    elif sig is Signature.THROTTLE:
        what = f"{gpus} throttled{lasting}: slow, not stalled"
    elif sig is Signature.GPU_HEALTH:
        what = f"{gpus}: {f.get('problems', 'a fault')}"
    elif sig is Signature.STRAGGLER:
        one = len(finding.gpus) == 1
        if one and "rank" in f:
            gpus = f"rank {int(f['rank'])} ({gpus})"
        what = (f"{gpus} {'is the straggler' if one else 'are the stragglers'}{lasting}: the job runs about "
                f"{float(f.get('slowdown', 1)):.2f}x slower than without {'it' if one else 'them'}")
    else:
        what = f"{gpus} stopped answering NVML{lasting}"
    return f"{word} ({severity.value}): {what}"


def evidence(finding: Finding, elapsed_seconds: float, unbroken_seconds: float | None = None) -> str:
    """The telemetry behind the verdict, without a judgement of its own."""
    f = finding.facts
    gpus = gpu_list(finding.gpus)
    lasting = _lasting(elapsed_seconds)
    legs = f" [{', '.join(finding.legs)}]" if finding.legs else ""
    sig = finding.signature
    if sig is Signature.BUSY_SPIN:
        power = f"only {_quoted_power(f)}" if "power_watts" in f else "no real work"
        lost = _gpus_of(f.get("lost"))
        gone = (f"; {gpu_list(lost)} stopped answering NVML (gpu_lost), and a collective that needs "
                f"{plural(len(lost), 'it', 'them')} cannot finish") if lost else ""
        return f"Busy spin on {gpus}{lasting}: 100% util but {power}{gone}{legs}"
    if sig is Signature.WAITING:
        spinners = [g for g in finding.gpus if g not in finding.culprit_gpus]
        power = f", {_quoted_power(f)}" if "power_watts" in f else ""
        state = f" ({f['culprit_state']})" if f.get("culprit_state") else ""
        text = (f"{gpu_list(spinners)} {plural(len(spinners), 'spins', 'spin')} at 100% util{power}, waiting on "
                f"{gpu_list(finding.culprit_gpus)}{state}{lasting}")
        unbroken = elapsed_seconds if unbroken_seconds is None else unbroken_seconds
        if unbroken < elapsed_seconds - 1 and round(unbroken) >= 1:
            text += f" (the last {duration_text(unbroken)} without progress)"
        return text + legs
    if sig is Signature.ZERO_UTIL:
        held = f.get("memory_used_bytes")
        held_text = f" with {float(held) / 2**30:.1f} GiB held" if held else " with memory held"
        spinning = _gpus_of(f.get("spinning"))
        idle = len(finding.gpus) - len(spinning)
        spin = (f"; {gpu_list(spinning)} {plural(len(spinning), 'spins', 'spin')} waiting on "
                f"{plural(idle, 'it', 'them')}") if spinning else ""
        return f"Zero util on {gpus}{lasting}: 0% util{held_text}, memory neither growing nor released{spin}"
    if sig is Signature.UNDERUSE:
        return (f"Under-use on {gpus}{lasting}: {float(f.get('mean_utilization', 0)):.0%} mean util over "
                f"the last {duration_text(float(f.get('window_seconds', 0)))}; the job runs but leaves the GPUs idle")
    if sig is Signature.THROTTLE:
        clock = f" at {float(f['clock_ratio']):.0%} of max SM clock" if "clock_ratio" in f else ""
        temp = f", {float(f['temperature_celsius']):.0f} C" if "temperature_celsius" in f else ""
        return f"{gpus} throttled{lasting} ({f.get('reasons', '')}){clock}{temp}"
    if sig is Signature.GPU_HEALTH:
        return summary_of(finding.gpus, f)
    if sig is Signature.STRAGGLER:
        return _straggler_evidence(finding)
    if sig is Signature.GPU_LOST:  # the headline says it stopped answering, and for how long
        said = f"NVML's last word: {f['errors']}" if f.get("errors") else "No answer from NVML"
        return f"{said}: drain the node and reset {plural(len(finding.gpus), 'the GPU', 'the GPUs')}"
    return f"{sig.value} on {gpus}{lasting}"


def _straggler_evidence(finding: Finding) -> str:
    """What names a straggler: its rank's stack samples against its peers', its clock against theirs, or both."""
    f, gpus, one = finding.facts, gpu_list(finding.gpus), len(finding.gpus) == 1
    said = []
    if "peers_wait_ratio" in f:
        mine, theirs = float(f["wait_ratio"]), float(f["peers_wait_ratio"])
        said.append(f"Rank {int(f.get('rank', -1))}'s peers wait {theirs - mine:.0%} of each step for it: in "
                    f"{int(f.get('wait_samples', 0)):,} "
                    f"stack samples it waited in collectives {mine:.0%} of the time, the other ranks of its job "
                    f"{theirs:.0%}")
    if "peers_nccl_ratio" in f:
        mine, theirs = float(f["nccl_ratio"]), float(f["peers_nccl_ratio"])
        said.append(f"{'NCCL agrees' if said else 'NCCL says so'} (its Inspector log): over "
                    f"{int(f.get('nccl_seconds', 0)):,} s, rank {int(f.get('rank', -1))}'s collectives ran "
                    f"{mine:.0%} of the time, its peers' {theirs:.0%}")
    if "clock_hertz" in f:
        reasons = f" (held down: {f['reasons']})" if f.get("reasons") else ""
        mine_hz, theirs_hz = float(f["clock_hertz"]) / 1e6, float(f.get("peers_clock_hertz", 0)) / 1e6
        said.append(f"{gpus} {'computes' if one else 'compute'} at an SM clock of {mine_hz:,.0f} MHz{reasons} while "
                    f"{'its' if one else 'their'} working peers run at {theirs_hz:,.0f} MHz: they wait for "
                    f"{'it' if one else 'them'} in every step's collective")
    return "; ".join(said) or f"{gpus} {'is' if one else 'are'} slower than {'its' if one else 'their'} peers"


def summarize(finding: Finding, elapsed_seconds: float, severity: Severity, reason: str = "",
              stacks: Verdict | None = None, unbroken_seconds: float | None = None) -> tuple[str, str]:
    """(headline, summary): the summary is the headline, why this severity, then the evidence."""
    head = headline(finding, elapsed_seconds, severity, stacks)
    text = head + (f"; {reason}" if reason else "") + ". " + evidence(finding, elapsed_seconds, unbroken_seconds)
    if finding.facts.get("gpu_health"):
        text += f". Before it: {finding.facts['gpu_health']}"
    if stacks is not None:
        text += f". Stacks: {stacks.sentence}"
    return head, text
