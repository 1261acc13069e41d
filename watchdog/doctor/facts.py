"""What the doctor looks at: the node's GPUs, PCIe, NVLink, P2P, IOMMU, InfiniBand, network and kernel.

sysfs, procfs and /dev are read through injectable roots so every check can be tested with a fixture tree;
NVML's facts come from the open NVML source's inventory (sample/nvml_inventory.py). A fact that cannot be read is
None ("unknown"), never a guess. Whether the node has NVIDIA GPUs at all is read without NVML too (the PCI
bus, the driver's device nodes and its /proc folder), so a driver that does not start is told from a node
with no GPU.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path

import psutil

from watchdog.sample.nvml_inventory import GpuFacts, Inventory

ACS_CAPABILITY = 0x000D
ACS_P2P_REDIRECT = 0x4  # ACS P2P Request Redirect: peer traffic goes up to the root complex
ACS_COMPLETION_REDIRECT = 0x8
NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")  # VGA and 3D controllers; an NVIDIA GPU's audio function (0x0403) and an
# NVSwitch (0x0680) are not GPUs


@dataclass(frozen=True)
class Interface:
    name: str
    up: bool
    addresses: tuple[str, ...]


@dataclass(frozen=True)
class IbPort:
    device: str
    port: int
    state: str  # "ACTIVE", "DOWN", "INIT", ...
    phys_state: str | None


@dataclass
class NodeFacts(Inventory):
    """NVML's inventory (driver, GPUs, P2P, topology) and what the host says about itself."""

    kernel: str | None = None
    cmdline: str | None = None
    iommu_groups: int | None = None  # None: unknown
    acs_bridges: dict[str, bool | None] = field(default_factory=dict)  # bridge -> redirect on (None: unreadable)
    ib_ports: list[IbPort] = field(default_factory=list)
    interfaces: list[Interface] | None = None  # None: not read
    host_gpus: dict[str, int] = field(default_factory=dict)  # NVIDIA GPUs the host shows, by where (no NVML)
    problems: list[str] = field(default_factory=list)  # what could not be read, for the report

    def p2p_read(self) -> dict[tuple[int, int], str]:
        """The P2P pairs NVML answered for: an "unknown" pair was not read, and is neither OK nor broken."""
        return {pair: status for pair, status in self.p2p.items() if status != "unknown"}


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def kernel_release(proc_root: Path) -> str | None:
    return _read(proc_root / "sys" / "kernel" / "osrelease")


def kernel_version_tuple(release: str) -> tuple[int, int]:
    parts = release.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def acs_redirect(config: bytes) -> bool | None:
    """From a PCI device's config space: is ACS P2P/completion redirect enabled? None when only the
    first 256 bytes are readable (extended capabilities need root)."""
    if len(config) < 0x104:
        return None
    offset = 0x100
    seen = 0
    while offset and seen < 64:
        header = struct.unpack_from("<I", config, offset)[0]
        if header in (0, 0xFFFFFFFF):
            return False
        if header & 0xFFFF == ACS_CAPABILITY:
            control = struct.unpack_from("<H", config, offset + 6)[0]
            return bool(control & (ACS_P2P_REDIRECT | ACS_COMPLETION_REDIRECT))
        offset = (header >> 20) & 0xFFC
        seen += 1
    return False


def read_pci(sys_root: Path, gpus: list[GpuFacts]) -> tuple[list[GpuFacts], dict[str, bool | None]]:
    """NUMA node per GPU, and ACS on every PCI bridge above a GPU."""
    devices = sys_root / "bus" / "pci" / "devices"
    with_numa = []
    bridges: dict[str, bool | None] = {}
    for gpu in gpus:
        numa = None
        if gpu.bus_id:
            text = _read(devices / gpu.bus_id / "numa_node")
            numa = int(text) if text and text.lstrip("-").isdigit() and int(text) >= 0 else None
            try:
                # /sys/bus/pci/devices/<id> links to .../pci0000:00/0000:00:01.0/0000:07:00.0: the parents are bridges
                chain = (devices / gpu.bus_id).resolve().parts
            except OSError:
                chain = ()
            for part in chain[:-1]:
                if part.count(":") == 2 and part not in bridges:
                    try:
                        bridges[part] = acs_redirect((devices / part / "config").read_bytes())
                    except OSError:
                        bridges[part] = None
        with_numa.append(GpuFacts(**{**gpu.__dict__, "numa_node": numa}))
    return with_numa, bridges


def read_infiniband(sys_root: Path) -> list[IbPort]:
    ports = []
    base = sys_root / "class" / "infiniband"
    try:
        devices = sorted(base.iterdir())
    except OSError:
        return []
    for device in devices:
        try:
            numbers = sorted((device / "ports").iterdir(), key=lambda p: int(p.name))
        except (OSError, ValueError):
            continue
        for port in numbers:
            state = _read(port / "state") or "unknown"
            phys = _read(port / "phys_state")
            ports.append(IbPort(device.name, int(port.name), state.split(":")[-1].strip(),
                                phys.split(":")[-1].strip() if phys else None))
    return ports


def _count(entries: Callable[[], Iterable[object]]) -> int:
    """How many entries a folder listing yields; none when it cannot be read."""
    try:
        return sum(1 for _ in entries())
    except OSError:
        return 0


def host_gpus(sys_root: Path, proc_root: Path, dev_root: Path) -> dict[str, int]:
    """The NVIDIA GPUs this host shows without NVML, by where they are seen: display or 3D controllers of
    vendor 0x10de on the PCI bus (seen whether or not a driver is loaded), the driver's /proc/driver/nvidia/gpus
    entries, and its /dev/nvidiaN character devices. Only the places that show one are kept."""
    devices = sys_root / "bus" / "pci" / "devices"

    def on_the_bus() -> list[Path]:
        return [d for d in devices.iterdir() if _read(d / "vendor") == NVIDIA_VENDOR
                and (_read(d / "class") or "").startswith(GPU_CLASSES)]

    def device_nodes() -> list[Path]:
        return [d for d in dev_root.glob("nvidia*") if d.name[6:].isdigit() and d.is_char_device()]

    driver = proc_root / "driver" / "nvidia" / "gpus"
    seen = {"on the PCI bus": _count(on_the_bus), f"in {driver}": _count(driver.iterdir),
            f"as {dev_root / 'nvidia'}N devices": _count(device_nodes)}
    return {where: count for where, count in seen.items() if count}


def read_interfaces() -> list[Interface]:
    stats = psutil.net_if_stats()
    out = []
    for name, addresses in sorted(psutil.net_if_addrs().items()):
        up = bool(stats[name].isup) if name in stats else False
        out.append(Interface(name, up, tuple(a.address for a in addresses if a.family.name in ("AF_INET", "AF_INET6"))))
    return out


def gather(inventory: Callable[[], Inventory] | None, sys_root: str | Path = "/sys",
           proc_root: str | Path = "/proc", interfaces: Callable[[], list[Interface]] = read_interfaces,
           dev_root: str | Path = "/dev") -> NodeFacts:
    facts = NodeFacts()
    if inventory is not None:
        try:
            inv = inventory()
            for name in (f.name for f in fields(Inventory)):
                setattr(facts, name, getattr(inv, name))
        except Exception as exc:  # NVML missing or failing: the host checks still run
            facts.problems.append(f"NVML: {exc}")
    sys_root, proc_root = Path(sys_root), Path(proc_root)
    facts.host_gpus = host_gpus(sys_root, proc_root, Path(dev_root))
    facts.kernel = kernel_release(proc_root)
    facts.cmdline = _read(proc_root / "cmdline")
    groups = sys_root / "kernel" / "iommu_groups"
    try:
        facts.iommu_groups = len(list(groups.iterdir()))
    except OSError:
        facts.iommu_groups = None
    facts.gpus, facts.acs_bridges = read_pci(sys_root, facts.gpus)
    facts.ib_ports = read_infiniband(sys_root)
    try:
        facts.interfaces = interfaces()
    except OSError as exc:
        facts.problems.append(f"interfaces: {exc}")
    return facts
