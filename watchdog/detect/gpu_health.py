"""gpu_health: a GPU that reports a fault of its own, before a hang or instead of one (a warning).

Signals (the health fields of GpuSample, read by sample/nvml.py):
  xid             a hardware or driver Xid, for xid_hold_seconds after it came (XIDS: what NVIDIA documents it
                  to mean and the action it names). Application Xids (13, 31, 43, 45, 109) are a program's own
                  fault, and an Xid not in XIDS is not known to be the hardware's: no episode, but a hang's verdict
                  quotes them with the others.
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

import math
import operator
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from watchdog.config import GpuHealthConfig
from watchdog.vocabulary.model import HEALTH_COUNTERS, Finding, GpuSample, Severity, Signature
from watchdog.vocabulary.words import duration_text, gpu_list

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
    109: ("a context switch timed out: a program's kernel that does not yield, or the driver", "check the "
          "program that ran (a kernel that spins or runs very long); reset the GPU if it repeats with others", False),
    119: ("GPU firmware (GSP) call timed out", "reset the GPU; update the driver if it repeats", True),
    120: ("GPU firmware (GSP) error", "reset the GPU; update the driver if it repeats", True),
    140: ("unrecovered ECC error", "drain the node and reset the GPU", True),
}
_XIDS_KEPT = 64  # distinct Xids kept per GPU (the least recently seen go first): repeats cannot push one out
_XIDS_QUOTED = 3  # distinct Xids a sentence quotes, hardware ones first; the rest are counted
_RISES = (("ecc_corrected", "corrected_ecc_rise", "corrected ECC errors"),
          ("nvlink_errors", "nvlink_errors_rise", "NVLink errors"),
          ("pcie_replays", "pcie_replays_rise", "PCIe replays"))
_HISTORY_KEPT = 256  # readings of a climbing counter kept per GPU, at least window_seconds / 128 apart
_PLAUSIBLE_RISE, _PLAUSIBLE_RISE_PER_SECOND = 100_000, 10_000  # a counter rising faster is not read
_LINK_MAX = {"gen": 16, "width": 32}  # above these a PCIe reading is not a reading: left unjudged
_SLOTS = [HEALTH_COUNTERS.index(name) for name, _, _ in _RISES]
COUNTERS_OF = operator.itemgetter(*(GpuSample._fields.index(name) for name in HEALTH_COUNTERS))  # of a sample
NO_COUNTERS = (None,) * len(HEALTH_COUNTERS)


def xid_words(xid: int) -> tuple[str, str, bool]:
    """What an Xid means, the action NVIDIA names for it, and whether the GPU or its driver is at fault."""
    # Not known here is not known to be the hardware: quoted in a hang's verdict, never an episode of its own.
    return XIDS.get(xid, ("an Xid this version does not know", "look it up in NVIDIA's Xid catalog", False))


@dataclass
class _Xid:
    first: float
    last: float
    count: int = 1


@dataclass
class _Gpu:
    xids: dict[int, _Xid] = field(default_factory=dict)
    last_xid: float = -math.inf  # when the newest Xid came (the latest time any was seen)
    counters: tuple[Any, ...] = (None,) * len(HEALTH_COUNTERS)
    # each climbing counter's rise since it was first read, at each reading kept: (time, rise so far)
    history: list[deque[tuple[float, int]]] = field(
        default_factory=lambda: [deque(maxlen=_HISTORY_KEPT) for _ in _RISES])
    raw: list[tuple[float, int] | None] = field(default_factory=lambda: [None] * len(_RISES))  # the last reading
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
        for xid in map(int, xids):
            seen = state.xids.get(xid)
            if seen is None:
                if len(state.xids) >= _XIDS_KEPT:
                    del state.xids[min(state.xids, key=lambda x: state.xids[x].last)]
                state.xids[xid] = _Xid(t, t)
            else:
                seen.last, seen.count = t, seen.count + 1
            state.last_xid = max(state.last_xid, t)
        if counters != state.counters:
            spacing = self.cfg.window_seconds / 128
            for n, (history, slot) in enumerate(zip(state.history, _SLOTS)):
                value = counters[slot]
                if value is None:
                    continue
                rise = _step(state.raw[n], t, int(value))
                state.raw[n] = (t, int(value))
                if rise is None or (history and not rise):
                    continue
                total = (history[-1][1] if history else 0) + rise
                if len(history) >= 2 and t - history[-2][0] < spacing:
                    history[-1] = (t, total)  # a fast log: the newest reading stands for its spacing
                else:
                    history.append((t, total))
            state.counters = counters
            c = dict(zip(HEALTH_COUNTERS, counters))
            state.slow_link = _below(c["pcie_link_gen"], c["pcie_link_gen_max"], "gen")  # a fault only while busy
            state.standing = bool(c["ecc_uncorrected"] or c["memory_repair_failed"] or c["memory_repair_pending"]
                                  or _below(c["pcie_link_width"], c["pcie_link_width_max"], "width")
                                  or any(len(h) > 1 and h[-1][1] - h[0][1] >= getattr(self.cfg, setting)
                                         for h, (_, setting, _) in zip(state.history, _RISES)))
        state.busy = utilization is not None and utilization >= self.cfg.busy_min_ratio

    def _showing(self, state: _Gpu, t: float) -> bool:
        """Whether a GPU may show a problem at time t (problems() finds none where not): a standing one, a slow
        link while busy, or an Xid within xid_hold_seconds."""
        return state.standing or (state.slow_link and state.busy) or state.last_xid >= t - self.cfg.xid_hold_seconds

    def problems(self, t: float, gpu: int) -> list[tuple[str, str, str]]:
        """(signal, what it shows, the action) for each problem GPU `gpu` shows at time t, the worst first."""
        state = self._gpus.get(gpu)
        if state is None:
            return []
        cfg, out = self.cfg, []
        recent = self._xids(state, t - cfg.xid_hold_seconds, t, hardware_only=True)
        if recent:
            out.append(("xid", _xid_text(recent, t, "ago"), xid_words(recent[0][0])[1]))
        c = dict(zip(HEALTH_COUNTERS, state.counters))
        if c["memory_repair_failed"]:
            out.append(("memory_repair", "a memory row remap failed", "drain the node: the GPU needs service"))
        if c["ecc_uncorrected"]:
            out.append(("ecc_uncorrected", f"{c['ecc_uncorrected']} uncorrected ECC "
                        f"{'error' if c['ecc_uncorrected'] == 1 else 'errors'} since the driver loaded",
                        "drain the node and reset the GPU; replace it if this repeats"))
        if c["memory_repair_pending"] and not c["memory_repair_failed"]:
            out.append(("memory_repair", "a memory row remap is pending", "reset the GPU when it is idle to apply it"))
        for (name, setting, words), history in zip(_RISES, state.history):
            rise = _rise(history, t - cfg.window_seconds, t)
            if rise >= getattr(cfg, setting):
                span = duration_text(min(cfg.window_seconds, t - history[0][0]))
                out.append((name, f"{rise} {words} in the last {span}", _RISE_ACTIONS[name]))
        width, width_max = c["pcie_link_width"], c["pcie_link_width_max"]
        gen, gen_max = c["pcie_link_gen"], c["pcie_link_gen_max"]
        if _below(width, width_max, "width"):
            out.append(("pcie_link", f"PCIe link at x{width} of x{width_max}", "reseat the GPU or check its slot"))
        elif _below(gen, gen_max, "gen") and state.busy:
            out.append(("pcie_link", f"PCIe link at Gen{gen} of Gen{gen_max} while busy",
                        "reseat the GPU or check its slot and the BIOS link settings"))
        return out

    @staticmethod
    def _xids(state: _Gpu, start: float, t: float, hardware_only: bool) -> list[tuple[int, _Xid]]:
        """The distinct Xids last seen within [start, t], known hardware ones first, then the newest first."""
        found = [(xid, seen) for xid, seen in state.xids.items() if start <= seen.last <= t
                 and (xid_words(xid)[2] or not hardware_only)]
        return sorted(found, key=lambda item: (item[0] not in XIDS or not XIDS[item[0]][2], -item[1].last))

    def findings(self, t: float) -> list[Finding]:
        """A warning for each GPU that shows a problem at time t."""
        out = []
        for gpu, state in self._gpus.items():
            if not self._showing(state, t):
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
                                      "action": "; ".join(dict.fromkeys(action for _, _, action in problems))},
                               key=f"gpu_health:{gpu}"))
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
            if state.last_xid >= t - lookback:  # the newest Xid is recent enough (the usual tick: none at all)
                xids = self._xids(state, t - lookback, t, hardware_only=False)
                if xids:
                    parts.append(f"GPU {gpu} reported {_xid_text(xids, t, 'earlier')}")
            if self._showing(state, t):
                parts += [f"GPU {gpu}: {what}" for signal, what, _ in self.problems(t, gpu) if signal != "xid"]
        return "; ".join(parts)

    @property
    def reported(self) -> bool:
        """Whether any GPU has reported a health reading."""
        return bool(self._gpus)


_RISE_ACTIONS = {
    "ecc_corrected": "watch it; replace the GPU if the rate holds",
    "nvlink_errors": "check the GPU's NVLink connections and reset it; replace it if they keep coming",
    "pcie_replays": "reseat the GPU or check its slot and riser; replace it if they keep coming",
}


def _below(now: int | None, most: int | None, what: str) -> bool:
    """A PCIe link reading below its maximum; readings out of any real range are not judged."""
    return bool(now and most and 1 <= now < most <= _LINK_MAX[what])


def _xid_text(xids: list[tuple[int, _Xid]], t: float, when: str) -> str:
    """'Xid 79 (the GPU has fallen off the bus) 40 s ago; Xid 45 (...) 3 times, the last 2 s ago; and 4 more'."""
    parts = []
    for xid, seen in xids[:_XIDS_QUOTED]:
        age = "just now" if t - seen.last < 1 else f"{duration_text(t - seen.last)} {when}"
        times = f" {seen.count} times, the last" if seen.count > 1 else ""
        parts.append(f"Xid {xid} ({xid_words(xid)[0]}){times} {age}")
    if len(xids) > _XIDS_QUOTED:
        parts.append(f"and {len(xids) - _XIDS_QUOTED} more")
    return "; ".join(parts)


def _step(last: tuple[float, int] | None, t: float, value: int) -> int | None:
    """What a climbing counter rose by since its last reading: 0 for its first, None where it went back (a driver
    reload, a GPU swapped: it counts again from here) or rose past anything a GPU reports (a reading that is no
    reading: the next ones count from it, the jump counts for nothing)."""
    if last is None:
        return 0
    at, before = last
    rise = value - before
    if rise < 0 or rise > _PLAUSIBLE_RISE + _PLAUSIBLE_RISE_PER_SECOND * max(0.0, t - at):
        return None
    return rise


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
    """The evidence sentence of a gpu_health episode (the headline has said what the fault is)."""
    action = str(facts.get("action", ""))
    return f"What to do on {gpu_list(gpus)}: {action}"
