"""gpu_health: a GPU that reports a fault of its own, before a hang or instead of one (a warning).

Signals (the health fields of GpuSample, read by sample/nvml.py):
  xid             a hardware or driver Xid, for xid_hold_seconds after it came (XIDS: what NVIDIA documents it
                  to mean and the action it names). Application Xids (13, 31, 43, 45) are a program's own fault:
                  no episode, but a hang's verdict quotes them with the others.
  ecc_uncorrected uncorrected ECC errors since the driver loaded
  ecc_corrected   corrected ECC errors climbing by corrected_ecc_rise within window_seconds
  memory_repair   a row remap or page retirement pending (a GPU reset applies it), or one that failed
  nvlink_errors   NVLink CRC, replay and recovery errors climbing by nvlink_errors_rise within window_seconds
  pcie_replays    PCIe replays climbing by pcie_replays_rise within window_seconds
  pcie_link       a link narrower than its maximum, or of a lower generation while the GPU works (links
                  train down at idle to save power)
The counters come every HEALTH_SECONDS and the Xids as they happen, not as readings of a window: a ledger per
GPU keeps what they have shown, the daemon's tick and a replay's day feeding it the same samples in order.
"""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from watchdog.config import GpuHealthConfig
from watchdog.model import HEALTH_COUNTERS, Finding, GpuSample, Severity, Signature, duration_text, gpu_list

# Xid -> (what NVIDIA documents it to mean, the action it names, whether the GPU or its driver is at fault
# rather than the program that ran on it). In our words; NVIDIA's Xid catalog has the full list.
XIDS: dict[int, tuple[str, str, bool]] = {
    13: ("graphics engine exception, usually a program fault", "check the program (an illegal address or "
         "instruction); run the GPU diagnostics if it is not the program", False),
    31: ("GPU memory page fault, usually a program's illegal address", "check the program", False),
    43: ("the GPU stopped the program that faulted", "restart the program; the GPU itself is fine", False),
    45: ("cleanup after an earlier error", "see the Xid before it", False),
    48: ("double-bit ECC error: memory that cannot be corrected", "drain the node and reset the GPU; replace "
         "it if this repeats", True),
    61: ("internal micro-controller breakpoint", "reset the GPU; report it to NVIDIA if it repeats", True),
    62: ("internal micro-controller halt", "reset the GPU; report it to NVIDIA if it repeats", True),
    63: ("a memory row remap or page retirement was recorded", "reset the GPU when it is idle to apply it", True),
    64: ("a memory row remap or page retirement failed", "drain the node: the GPU needs service", True),
    74: ("NVLink error", "check the NVLink connections and reset the GPUs; replace one if it repeats", True),
    79: ("the GPU has fallen off the bus", "drain the node; check its power, cooling and PCIe slot, and reboot",
         True),
    92: ("high rate of single-bit ECC errors", "watch its ECC counts; replace the GPU if the rate holds", True),
    94: ("contained uncorrectable ECC error", "restart the program that hit it; reset the GPU when it can be "
         "drained, to remap the row", True),
    95: ("uncontained uncorrectable ECC error", "drain the node and reset the GPU: every program on it is "
         "affected", True),
    119: ("GPU firmware (GSP) call timed out", "reset the GPU; update the driver if it repeats", True),
    120: ("GPU firmware (GSP) error", "reset the GPU; update the driver if it repeats", True),
    140: ("unrecovered ECC error", "drain the node and reset the GPU", True),
}
_XIDS_KEPT = 16  # per GPU, the newest
_RISES = (("ecc_corrected", "corrected_ecc_rise", "corrected ECC errors"),
          ("nvlink_errors", "nvlink_errors_rise", "NVLink errors"),
          ("pcie_replays", "pcie_replays_rise", "PCIe replays"))
_HISTORY_KEPT = 256  # readings of a climbing counter kept per GPU (one a HEALTH_SECONDS: over two hours)
_SLOTS = [HEALTH_COUNTERS.index(name) for name, _, _ in _RISES]
COUNTERS_OF = operator.itemgetter(*(GpuSample._fields.index(name) for name in HEALTH_COUNTERS))  # of a sample
NO_COUNTERS = (None,) * len(HEALTH_COUNTERS)


def xid_words(xid: int) -> tuple[str, str, bool]:
    """What an Xid means, the action NVIDIA names for it, and whether the GPU or its driver is at fault."""
    return XIDS.get(xid, ("an Xid this version does not know", "look it up in NVIDIA's Xid catalog", True))


@dataclass
class _Gpu:
    xids: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=_XIDS_KEPT))
    counters: tuple[Any, ...] = (None,) * len(HEALTH_COUNTERS)
    history: list[deque[tuple[float, int]]] = field(
        default_factory=lambda: [deque(maxlen=_HISTORY_KEPT) for _ in _RISES])
    busy: bool = False
    standing: bool = False  # the counters show a problem that needs no window (or climb enough to look at one)
    slow_link: bool = False  # the PCIe link below its maximum generation (normal at idle)
    since: float | None = None  # when the problems of the open stretch began


class HealthLedger:
    """What each GPU has reported, fed the samples in order (`observe`), asked on each judged tick (`findings`)
    and by a hang's verdict (`before`)."""

    def __init__(self, cfg: GpuHealthConfig):
        self.cfg = cfg
        self._gpus: dict[int, _Gpu] = {}

    def observe(self, t: float, gpu: int, xids: tuple[int, ...], counters: tuple[Any, ...],
                utilization: float | None) -> None:
        state = self._gpus.get(gpu)
        if state is None:
            if not xids and counters.count(None) == len(counters):
                return  # a GPU that never reported health: nothing to keep
            state = self._gpus[gpu] = _Gpu()
        for xid in xids:
            state.xids.append((t, int(xid)))
        if counters != state.counters:
            for history, slot in zip(state.history, _SLOTS):
                value = counters[slot]
                if value is not None and (not history or history[-1][1] != value):
                    history.append((t, int(value)))
            state.counters = counters
            c = dict(zip(HEALTH_COUNTERS, counters))
            state.slow_link = (c["pcie_link_gen"] or 0) < (c["pcie_link_gen_max"] or 0)  # a fault only while busy
            state.standing = bool(c["ecc_uncorrected"] or c["memory_repair_failed"] or c["memory_repair_pending"]
                                  or (c["pcie_link_width"] or 0) < (c["pcie_link_width_max"] or 0)
                                  or any(len(h) > 1 and h[-1][1] - h[0][1] >= getattr(self.cfg, setting)
                                         for h, (_, setting, _) in zip(state.history, _RISES)))
        state.busy = utilization is not None and utilization >= self.cfg.busy_min_ratio

    def problems(self, t: float, gpu: int) -> list[tuple[str, str, str]]:
        """(signal, what it shows, the action) for each problem GPU `gpu` shows at time t."""
        state = self._gpus.get(gpu)
        if state is None:
            return []
        cfg, out = self.cfg, []
        recent = [(at, xid) for at, xid in state.xids if t - cfg.xid_hold_seconds <= at <= t and xid_words(xid)[2]]
        for at, xid in recent[-3:]:
            meaning, action, _ = xid_words(xid)
            out.append(("xid", f"Xid {xid} ({meaning}) {duration_text(t - at)} ago", action))
        c = dict(zip(HEALTH_COUNTERS, state.counters))
        if c["ecc_uncorrected"]:
            out.append(("ecc_uncorrected", f"{c['ecc_uncorrected']} uncorrected ECC "
                        f"{'error' if c['ecc_uncorrected'] == 1 else 'errors'} since the driver loaded",
                        "drain the node and reset the GPU; replace it if they come back"))
        if c["memory_repair_failed"]:
            out.append(("memory_repair", "a memory row remap failed", "drain the node: the GPU needs service"))
        elif c["memory_repair_pending"]:
            out.append(("memory_repair", "a memory row remap is pending", "reset the GPU when it is idle to apply it"))
        for (name, setting, words), history in zip(_RISES, state.history):
            rise = _rise(history, t - cfg.window_seconds, t)
            if rise >= getattr(cfg, setting):
                span = duration_text(min(cfg.window_seconds, t - history[0][0]))
                out.append((name, f"{rise} {words} in the last {span}",
                            "check the link or memory it names and reset the GPU; replace it if they keep coming"
                            if name != "ecc_corrected" else "watch it; replace the GPU if the rate holds"))
        width, width_max = c["pcie_link_width"], c["pcie_link_width_max"]
        gen, gen_max = c["pcie_link_gen"], c["pcie_link_gen_max"]
        if width and width_max and width < width_max:
            out.append(("pcie_link", f"PCIe link at x{width} of x{width_max}", "reseat the GPU or check its slot"))
        elif gen and gen_max and gen < gen_max and state.busy:
            out.append(("pcie_link", f"PCIe link at Gen{gen} of Gen{gen_max} while busy",
                        "reseat the GPU or check its slot and the BIOS link settings"))
        return out

    def findings(self, t: float) -> list[Finding]:
        """A warning for each GPU that shows a problem at time t."""
        out = []
        hold = t - self.cfg.xid_hold_seconds
        for gpu, state in self._gpus.items():
            if not (state.standing or (state.slow_link and state.busy) or (state.xids and state.xids[-1][0] >= hold)):
                state.since = None  # the usual tick: nothing to look at
                continue
            problems = self.problems(t, gpu)
            if not problems:
                state.since = None
                continue
            if state.since is None:
                state.since = t
            out.append(Finding(Signature.GPU_HEALTH, Severity.WARNING, (gpu,), since=state.since,
                               legs=tuple(dict.fromkeys(signal for signal, _, _ in problems)),
                               facts={"problems": "; ".join(what for _, what, _ in problems),
                                      "action": problems[0][2]}, key=f"gpu_health:{gpu}"))
        return out

    def before(self, gpus: tuple[int, ...], t: float) -> str:
        """What the GPUs of a hang reported before it: every Xid within hang_lookback_seconds, then the other
        problems they show (empty when none)."""
        lookback = self.cfg.hang_lookback_seconds
        parts = []
        for gpu in gpus:
            state = self._gpus.get(gpu)
            if state is None:
                continue
            xids = [(at, xid) for at, xid in state.xids if t - lookback <= at <= t]
            for at, xid in xids[-3:]:
                parts.append(f"GPU {gpu} reported Xid {xid} ({xid_words(xid)[0]}) {duration_text(t - at)} "
                             "before this tick")
            parts += [f"GPU {gpu}: {what}" for signal, what, _ in self.problems(t, gpu) if signal != "xid"]
        return "; ".join(parts)

    @property
    def reported(self) -> bool:
        """Whether any GPU has reported a health reading."""
        return bool(self._gpus)


def _rise(history: deque[tuple[float, int]], start: float, t: float) -> int:
    """How far a counter climbed within (start, t]: from the last reading at or before start (or the first)."""
    if not history:
        return 0
    base = history[0][1]
    newest = base
    for at, value in history:
        if at <= start:
            base = value
        if at <= t:
            newest = value
    return max(0, newest - base)


def summary_of(gpus: tuple[int, ...], facts: dict[str, float | str]) -> str:
    """The evidence sentence of a gpu_health episode."""
    action = str(facts.get("action", ""))
    return f"{gpu_list(gpus)} reports a fault: {facts.get('problems', '')}. {action[:1].upper()}{action[1:]}"
