"""The kernel's and the driver's word about a GPU, as `dmesg` or `journalctl -k` print it: Xid lines, a GPU that
NVML can no longer reach, PCIe AER errors. Each names the GPU by its bus id; what an Xid means comes from the
GPU health detector's one table (detect/gpu_health.py XIDS), so the daemon and `analyze` say it alike.

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1913, name=python, GPU has fallen off the bus.
    Unable to determine the device handle for GPU 0000:3B:00.0: Unknown Error
    pcieport 0000:00:03.0: AER: Uncorrected (Fatal) error received: 0000:00:03.0
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from watchdog.detect.gpu_health import xid_words
from watchdog.pasted.finding import Finding
from watchdog.vocabulary.model import NO_DEVICE_HANDLE, Severity

_XID = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<bus>[0-9A-Fa-f:.]{7,20})\):\s{0,4}(?P<xid>\d{1,4})\b"
                  r"(?P<rest>[^\n]{0,200})")
_LOST = re.compile(re.escape(NO_DEVICE_HANDLE) + r"\s{0,4}(?P<bus>[0-9A-Fa-f:.]{7,20}):\s{0,4}"
                   r"(?P<why>[^\n]{0,80})|GPU (?P<bus2>[0-9A-Fa-f:.]{7,20}):?\s{0,4}GPU has fallen off the bus")
_AER = re.compile(r"(?P<bus>[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d):\s{0,4}AER:\s{0,4}(?P<kind>Corrected|"
                  r"Uncorrected \((?:Non-)?Fatal\)|Multiple Uncorrected \((?:Non-)?Fatal\))")
_MOST = 10_000  # lines of one kind read: a log of a flood says what it holds in its first ten thousand


@dataclass(frozen=True)
class GpuEvent:
    bus: str
    what: str  # "Xid 79", "lost", "AER Uncorrected (Fatal)"
    xid: int | None = None
    detail: str = ""


def looks_like(text: str) -> bool:
    head = text[:1 << 22]
    return "NVRM: Xid" in head or NO_DEVICE_HANDLE in head or "fallen off the bus" in head \
        or " AER: " in head


def events(text: str) -> list[GpuEvent]:
    found: list[GpuEvent] = []
    for m in itertools.islice(_XID.finditer(text), _MOST):
        rest = m["rest"].split(",")
        detail = next((part.strip(" .") for part in rest if part.strip() and "=" not in part), "")
        found.append(GpuEvent(m["bus"].lower(), f"Xid {int(m['xid'])}", int(m["xid"]), detail[:120]))
    for m in itertools.islice(_LOST.finditer(text), _MOST):
        found.append(GpuEvent((m["bus"] or m["bus2"]).lower(), "lost", None, (m["why"] or "").strip()[:80]))
    for m in itertools.islice(_AER.finditer(text), _MOST):
        found.append(GpuEvent(m["bus"].lower(), f"AER {m['kind']}"))
    return found


def judge(found: list[GpuEvent]) -> Finding | None:
    """One finding: a GPU the hardware or its driver failed (a hardware Xid, a GPU lost, an uncorrected PCIe
    error) is a crash of the GPU, never a software hang; a program's own Xid (13, 31, 43...) a crash of the
    program on it; corrected PCIe errors alone are said and judged nothing."""
    if not found:
        return None
    faults: list[tuple[str, str, str]] = []  # (bus, what, the line said)
    programs: list[tuple[str, str, str]] = []
    said: list[str] = []
    first: dict[tuple[str, str], GpuEvent] = {}  # each GPU's first event of each kind, in the order they came
    for e in found:
        first.setdefault((e.bus, e.what), e)
    for (bus, what), event in first.items():
        if event.xid is not None:
            meaning, action, hardware = xid_words(event.xid)
            line = f"{what} on the GPU at {bus}: {meaning} ({action})"
            (faults if hardware else programs).append((bus, what, line))
        elif what == "lost":
            faults.append((bus, "lost", f"the GPU at {bus} cannot be reached ({event.detail or 'lost'}): it fell "
                                        "off the bus or its driver lost it (drain the node, reset or reboot)"))
        elif "Uncorrected" in what:
            faults.append((bus, what, f"{what} at {bus}: the PCIe link of a GPU or its switch failed"))
        else:
            said.append(f"{what} at {bus}")
    named = tuple(dict.fromkeys(f"GPU {bus}" for bus, _, _ in faults + programs))
    lines = [line for _, _, line in faults + programs][:6]
    if faults:
        return Finding("crash", Severity.CRITICAL, "; ".join(lines) + ". A hardware fault, not a software hang: the "
                       "job's ranks on that GPU fail or wait for ever, and restarting the job on this node will not "
                       "help", f"{named[0]} failed ({faults[0][1]})", named)
    if programs:
        return Finding("crash", Severity.WARNING, "; ".join(lines) + ". The program's own fault on the GPU, not the "
                       "hardware's", f"a program faulted on {named[0]} ({programs[0][1]})", named)
    return Finding("unknown", None, "; ".join(said[:6]) + ": corrected errors, which the hardware recovered from; "
                   "nothing here stops a job", "corrected PCIe errors only")
