"""NVML's facts for the doctor: driver, GPUs, PCIe links, NVLink, P2P status and topology, memory health.

Read once per incident or `doctor` run, through the NVML handle that sample/nvml.py owns (this module is
handed the pynvml module object; it never imports or initialises it). A fact that cannot be read is None
("unknown"), never a guess.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_TOPOLOGY = {0: "same board", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
_P2P_STATUS = {0: "ok", 1: "chipset not supported", 2: "GPU not supported", 3: "IOH topology not supported",
               4: "disabled by registry key", 5: "not supported", 6: "unknown"}


@dataclass(frozen=True)
class GpuFacts:
    index: int
    name: str | None = None
    uuid: str | None = None
    bus_id: str | None = None  # "0000:07:00.0", as sysfs names it
    persistence_mode: bool | None = None
    pcie_gen: tuple[int, int] | None = None  # (current, max)
    pcie_width: tuple[int, int] | None = None
    nvlinks: tuple[bool, ...] | None = None  # per link: active; None when the GPU has no NVLink
    numa_node: int | None = None
    ecc_uncorrected: int | None = None  # volatile: since the driver loaded
    memory_repair: tuple[bool, bool] | None = None  # (pending, failed): row remapping, or page retirement (pending)


@dataclass
class Inventory:
    driver_version: str | None = None
    nvml_version: str | None = None
    cuda_driver_version: str | None = None
    gpus: list[GpuFacts] = field(default_factory=list)
    p2p: dict[tuple[int, int], str] = field(default_factory=dict)  # (i, j) -> "ok" or NVML's reason
    topology: dict[tuple[int, int], str] = field(default_factory=dict)  # (i, j) -> PIX/PXB/PHB/NODE/SYS/...


def text_of(value: object) -> str:
    """NVML returns bytes from older bindings and str from newer ones."""
    return value.decode() if isinstance(value, bytes) else str(value)


def read_inventory(nv: Any, handles: list[Any]) -> Inventory:
    """Every fact NVML gives about the node; `nv` is an initialised pynvml module, `handles` its devices."""
    def ask(call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except nv.NVMLError:
            return None

    inv = Inventory()
    inv.driver_version = text_of(ask(nv.nvmlSystemGetDriverVersion) or "") or None
    inv.nvml_version = text_of(ask(nv.nvmlSystemGetNVMLVersion) or "") or None
    cuda = ask(nv.nvmlSystemGetCudaDriverVersion)
    inv.cuda_driver_version = f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else None
    for index, h in enumerate(handles):
        pci = ask(nv.nvmlDeviceGetPciInfo, h)
        bus = text_of(pci.busId).lower()[-12:] if pci is not None else None
        gens = (ask(nv.nvmlDeviceGetCurrPcieLinkGeneration, h), ask(nv.nvmlDeviceGetMaxPcieLinkGeneration, h))
        widths = (ask(nv.nvmlDeviceGetCurrPcieLinkWidth, h), ask(nv.nvmlDeviceGetMaxPcieLinkWidth, h))
        links: list[bool] = []
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                links.append(bool(nv.nvmlDeviceGetNvLinkState(h, link)))
            except nv.NVMLError:
                break  # no such link (or no NVLink at all)
        mode = ask(nv.nvmlDeviceGetPersistenceMode, h)
        ecc = ask(nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
        rows = ask(nv.nvmlDeviceGetRemappedRows, h)
        if rows is None:
            retired = ask(nv.nvmlDeviceGetRetiredPagesPendingStatus, h)
            repair = None if retired is None else (retired == nv.NVML_FEATURE_ENABLED, False)
        else:
            repair = (bool(rows[2]), bool(rows[3]))
        inv.gpus.append(GpuFacts(
            index, text_of(ask(nv.nvmlDeviceGetName, h) or "") or None, text_of(ask(nv.nvmlDeviceGetUUID, h) or "")
            or None, bus, None if mode is None else bool(mode),
            gens if None not in gens else None, widths if None not in widths else None,
            tuple(links) or None, None, None if ecc is None else int(ecc), repair))
    # pynvml defines NVML_P2P_CAPS_INDEX_READ as the tuple (0,): pass the index itself.
    read_index = 0
    for i, a in enumerate(handles):
        for j, b in enumerate(handles):
            if i < j:
                status = ask(nv.nvmlDeviceGetP2PStatus, a, b, read_index)
                inv.p2p[(i, j)] = _P2P_STATUS.get(status, "unknown") if status is not None else "unknown"
                level = ask(nv.nvmlDeviceGetTopologyCommonAncestor, a, b)
                inv.topology[(i, j)] = _TOPOLOGY.get(level, str(level)) if level is not None else "unknown"
    return inv
