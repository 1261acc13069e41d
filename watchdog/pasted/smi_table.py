"""`nvidia-smi`'s table, as people paste it: each GPU's utilization, power against its limit and memory held,
read from the cells whatever the driver's column widths, and judged as one look.

    |   0  Tesla V100-PCIE...  On   | 00000000:3B:00.0 Off |                    0 |
    | N/A   48C    P0    47W / 250W |  30765MiB / 32510MiB |    100%   E. Process |

A GPU at 100% whose power is near idle spins (NVML's utilization says only that a kernel was resident): the
busy-spin detector's own threshold (detectors.busy_spin: idle_power_max_multiple x default_idle_power_ratio of
the limit) decides it. A GPU at 0% that holds a job's memory runs nothing. One table is one look: it can raise a
suspicion (a warning), never confirm a hang; several tables of one paste (`watch nvidia-smi`) that all agree are
still tables, not a timeline with its clock.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from watchdog.config import BusySpinConfig
from watchdog.pasted.finding import Finding
from watchdog.vocabulary.model import Severity

_GPU = re.compile(r"^\|\s{0,6}(?P<index>\d{1,2})\s+(?P<name>\S.{0,60}?)\s+(?:On|Off)\s*\|\s*(?P<bus>[0-9A-Fa-f]{4,8}:"
                  r"[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])\s")
_READINGS = re.compile(r"^\|.{0,40}?(?P<power>\d{1,5}|N/A|ERR!)W?\s{0,4}/\s{0,4}(?P<cap>\d{1,5}|N/A|ERR!)W?\s*\|\s*"
                       r"(?P<used>\d{1,7})MiB\s{0,4}/\s{0,4}(?P<total>\d{1,7})MiB\s*\|\s*(?P<util>\d{1,3}\s?%|N/A|ERR!)")
_MOST_GPUS = 64
_HELD_MIB = 1024  # memory a job holds (an idle GPU with a bare context holds a few hundred MiB at most)
_SPIN_UTIL = 90  # the table rounds to whole percents: a spinning kernel reads 100


@dataclass(frozen=True)
class SmiGpu:
    index: int
    bus: str
    name: str
    power_w: float | None
    cap_w: float | None
    used_mib: int
    total_mib: int
    util: int | None
    unreadable: bool = False  # a cell reads ERR!: nvidia-smi could not read this GPU

    @property
    def label(self) -> str:
        return f"GPU {self.index} ({self.bus})"

    @property
    def held(self) -> bool:
        return self.used_mib >= _HELD_MIB

    def spins(self, cfg: BusySpinConfig) -> bool:
        near_idle = cfg.idle_power_max_multiple * cfg.default_idle_power_ratio
        return (self.util is not None and self.util >= _SPIN_UTIL and self.held and self.power_w is not None
                and bool(self.cap_w) and self.power_w <= near_idle * (self.cap_w or 0))

    def works(self, cfg: BusySpinConfig) -> bool:
        return self.util is not None and self.util > 0 and not self.spins(cfg)

    def text(self) -> str:
        if self.unreadable:
            return f"GPU {self.index} ERR!"
        power = f"{self.power_w:g} W of {self.cap_w:g} W" if self.power_w is not None and self.cap_w else "power N/A"
        util = f"{self.util}%" if self.util is not None else "N/A"
        return f"GPU {self.index} {util} at {power}, {self.used_mib} of {self.total_mib} MiB"


def looks_like(text: str) -> bool:
    return "NVIDIA-SMI" in text[:1 << 20] or bool(tables(text[:1 << 16]))


def tables(text: str) -> list[list[SmiGpu]]:
    """Each table of the text: its GPUs in order (a GPU's index seen again starts the next table)."""
    found: list[list[SmiGpu]] = []
    current: list[SmiGpu] = []
    pending: re.Match[str] | None = None
    for line in text.splitlines()[:200_000]:
        line = line.strip()[:400]
        header = _GPU.match(line)
        if header:
            pending = header
            continue
        readings = _READINGS.match(line) if pending is not None else None
        if readings and pending is not None:
            gpu = _gpu(pending, readings)
            if any(g.index == gpu.index for g in current):
                found.append(current)
                current = []
            if len(current) < _MOST_GPUS:
                current.append(gpu)
            pending = None
    if current:
        found.append(current)
    return found[:1000]


def _number(cell: str) -> float | None:
    return None if cell in ("N/A", "ERR!") else float(cell)


def _gpu(header: re.Match[str], readings: re.Match[str]) -> SmiGpu:
    util = readings["util"].rstrip("% ")
    return SmiGpu(int(header["index"]), header["bus"], " ".join(header["name"].split()), _number(readings["power"]),
                  _number(readings["cap"]), int(readings["used"]), int(readings["total"]),
                  None if util in ("N/A", "ERR!") else int(util), "ERR!" in readings.group(0))


def judge(found: list[list[SmiGpu]], cfg: BusySpinConfig | None = None) -> Finding | None:
    """One finding over the tables: the last one judged, the earlier ones saying whether it held."""
    if not found:
        return None
    cfg = cfg or BusySpinConfig()
    last = found[-1]
    spinning = [g for g in last if g.spins(cfg)]
    held_idle = [g for g in last if g.held and g.util == 0]
    working = [g for g in last if g.works(cfg) and g.held]
    seen = f"{len(found)} nvidia-smi tables" if len(found) > 1 else "one nvidia-smi table"
    agree = len(found) > 1 and all(
        {g.index for g in table if g.spins(cfg)} == {g.index for g in spinning}
        and {g.index for g in table if g.held and g.util == 0} == {g.index for g in held_idle} for table in found)
    look = (f"The {len(found)} tables agree, but tables carry no clock: run stall-watchdog on the node to confirm"
            if agree else ("The last table is judged: the tables before it differ" if len(found) > 1 else
                           "One table is one look") + ": whether anything moves is not in it (run stall-watchdog, or "
            "take nvidia-smi again a minute later)")
    readings = "; ".join(g.text() for g in last[:8]) + ("; ..." if len(last) > 8 else "")
    broken = [g for g in last if g.unreadable]
    if broken:
        them = "it" if len(broken) == 1 else "them"
        return Finding("unknown", None, f"{seen}: {_gpus(broken)} read ERR! (nvidia-smi could not read {them}: a "
                       f"GPU failing or lost by its driver; look for Xid lines in the kernel log). {readings}. {look}",
                       f"{_gpus(broken)} read ERR!: the GPU may be failing",
                       tuple(g.label for g in broken))
    if len(spinning) >= 2 and not working:  # a collective's spin holds every GPU of it but the odd one
        odd = held_idle if held_idle else []
        cause = (f"; {_gpus(odd)} at 0% with memory held: the rank there never arrived, or stopped before the "
                 "collective" if odd else "")
        return Finding("hang", Severity.WARNING,
                       f"{seen}: {_gpus(spinning)} at 100% utilization with power near idle (at most "
                       f"{cfg.idle_power_max_multiple * cfg.default_idle_power_ratio:.0%} of the limit) and memory "
                       f"held: kernels resident and doing no work, as NCCL's spin on a peer that never arrived "
                       f"reads{cause}. {readings}. {look}",
                       f"{_gpus(spinning)} spin at 100% near idle power (a busy-spin hang, suspected)",
                       tuple(g.label for g in odd))
    if spinning and not working:
        return Finding("unknown", None,
                       f"{seen}: {_gpus(spinning)} at 100% utilization with power near idle and memory held"
                       + (f", {_gpus(held_idle)} at 0% with memory held" if held_idle else "") +
                       f": one GPU spinning is as much a moment of light kernels as a kernel that never ends. "
                       f"{readings}. {look}", f"{_gpus(spinning)} at 100% near idle power: cannot tell from one table")
    if held_idle and not working:
        return Finding("hang", Severity.WARNING,
                       f"{seen}: {_gpus(held_idle)} at 0% utilization with memory held: nothing runs on GPUs that "
                       f"hold a job (a zero-util hang, or a pause: data loading, a checkpoint, an evaluation on "
                       f"another rank). {readings}. {look}",
                       f"{_gpus(held_idle)} idle with memory held (a zero-util hang or a pause, suspected)")
    if working and not spinning:
        note = f"; {_gpus(held_idle)} at 0% with memory held" if held_idle else ""
        return Finding("no_stall" if not held_idle else "unknown", None,
                       f"{seen}: {_gpus(working)} at work (utilization with power above idle){note}. {readings}",
                       f"{_gpus(working)} at work in this table" + (": the idle ones may wait on them" if note else ""))
    if spinning and working:
        return Finding("unknown", None, f"{seen}: {_gpus(working)} at work and {_gpus(spinning)} at 100% near idle "
                       f"power, both holding memory: mixed readings, which one table cannot tell apart (a spin, or "
                       f"light kernels between heavy ones). {readings}. {look}", "mixed readings: cannot tell from "
                       "this table")
    return Finding("unknown", None, f"{seen}: {readings}. No GPU holds a job's memory", "no job's memory on these GPUs")


def _gpus(gpus: list[SmiGpu]) -> str:
    indices = [g.index for g in gpus]
    return ("GPU " if len(indices) == 1 else "GPUs ") + ", ".join(str(i) for i in indices)
