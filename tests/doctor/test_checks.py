"""The doctor's checks, table by table, on fixture sysfs/procfs trees and the fake NVML."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, python_target
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml
from watchdog.doctor.checks import examine
from watchdog.doctor.facts import Interface, NodeFacts, acs_redirect, gather
from watchdog.doctor.finding import ERROR, INFO, OK, UNKNOWN, WARNING
from watchdog.doctor.job_checks import interface_matches
from watchdog.sample.nvml import NvmlSource
from watchdog.sample.nvml_inventory import Inventory
from watchdog.sample.ranks import RankInfo

UP = [Interface("lo", True, ("127.0.0.1",)), Interface("eth0", True, ("10.0.0.5",)),
      Interface("ib0", False, ()), Interface("docker0", True, ("172.17.0.1",))]


def config_space(acs_control: int | None) -> bytes:
    """A PCI config space of 4 KiB with an ACS extended capability at 0x100 (or none)."""
    data = bytearray(4096)
    if acs_control is not None:
        struct.pack_into("<I", data, 0x100, 0x000D | (1 << 16))  # ACS, version 1, no next capability
        struct.pack_into("<H", data, 0x106, acs_control)
    return bytes(data)


def node_tree(root: Path, gpus: list[tuple[str, int]], bridge_acs: int | None = 0, short_config: bool = False,
              kernel: str = "6.8.0", cmdline: str = "ro quiet", iommu_groups: int | None = 0,
              ib: list[tuple[str, str]] | None = None) -> tuple[Path, Path]:
    """sys/ and proc/ as Linux lays them out: each GPU behind bridge 0000:00:01.0."""
    sys_root, proc_root = root / "sys", root / "proc"
    bridge = sys_root / "devices" / "pci0000:00" / "0000:00:01.0"
    bridge.mkdir(parents=True)
    (bridge / "config").write_bytes(config_space(bridge_acs)[:64] if short_config else config_space(bridge_acs))
    devices = sys_root / "bus" / "pci" / "devices"
    devices.mkdir(parents=True)
    os.symlink(bridge, devices / "0000:00:01.0")
    for bus, numa in gpus:
        gpu = bridge / bus
        gpu.mkdir()
        (gpu / "numa_node").write_text(f"{numa}\n")
        os.symlink(gpu, devices / bus)
    (proc_root / "sys" / "kernel").mkdir(parents=True)
    (proc_root / "sys" / "kernel" / "osrelease").write_text(kernel + "\n")
    (proc_root / "cmdline").write_text(cmdline + "\n")
    if iommu_groups is not None:
        groups = sys_root / "kernel" / "iommu_groups"
        groups.mkdir(parents=True)
        for n in range(iommu_groups):
            (groups / str(n)).mkdir()
    for n, (state, phys) in enumerate(ib or []):
        port = sys_root / "class" / "infiniband" / f"mlx5_{n}" / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text(f"{state}\n")
        (port / "phys_state").write_text(f"{phys}\n")
    return sys_root, proc_root


def facts_for(tmp_path: Path, fake: FakeNvml, **tree: object) -> NodeFacts:
    buses = [(g.bus_id[-12:], n % 2) for n, g in enumerate(fake.gpus)]
    sys_root, proc_root = node_tree(tmp_path, buses, **tree)  # type: ignore[arg-type]
    source = NvmlSource(nvml=fake)
    source.open()
    try:
        return gather(source.inventory, sys_root, proc_root, lambda: UP)
    finally:
        source.close()


def eight(name: str = "NVIDIA H100 80GB HBM3", **kwargs: object) -> list[FakeGpu]:
    return [FakeGpu(name=name, bus_id=f"00000000:{0x10 + n:02x}:00.0", **kwargs) for n in range(8)]  # type: ignore[arg-type]


def finding(findings, check: str):  # type: ignore[no-untyped-def]
    return next(f for f in findings if f.check == check)


def rank(env: dict[str, str], gpus: tuple[int, ...] = (0,), pid: int = 1) -> RankInfo:
    return RankInfo(pid, 0.0, (), gpus, {"RANK": "0", "WORLD_SIZE": "8", "MASTER_ADDR": "h", "MASTER_PORT": "1",
                                         **env}, None)


def test_inventory_from_nvml_and_sysfs(tmp_path: Path) -> None:
    gpus = eight(nvlinks=(1, 1, 1, 1))
    facts = facts_for(tmp_path, FakeNvml(gpus, topology={(0, 1): 10}))
    assert facts.driver_version == "550.54.15" and facts.cuda_driver_version == "12.4"
    assert [g.bus_id for g in facts.gpus][:2] == ["0000:10:00.0", "0000:11:00.0"]
    assert [g.numa_node for g in facts.gpus][:3] == [0, 1, 0]
    assert facts.topology[(0, 1)] == "PIX" and facts.topology[(0, 2)] == "NODE" and len(facts.p2p) == 28
    assert facts.acs_bridges == {"0000:00:01.0": False}
    assert all(f.severity in (OK, INFO) for f in examine(facts)), [f for f in examine(facts)
                                                                     if f.severity not in (OK, INFO)]


@pytest.mark.parametrize(("case", "check", "severity", "phrase"), [
    ("acs enabled", "pcie_acs", WARNING, "ACS redirect enabled on bridges above the GPUs: 0000:00:01.0"),
    ("acs unreadable", "pcie_acs", UNKNOWN, "not readable"),
    ("x8 link", "pcie_link", WARNING, "GPU 3 x8 of x16"),
    ("gen at idle", "pcie_link", INFO, "normal at idle"),
    ("mixed models", "gpu_models", WARNING, "mixed GPU models"),
    ("old kernel", "kernel", WARNING, "Linux 4.18.0-305.el8_4.x86_64 on a node with 8 GPUs"),
    ("p2p broken", "p2p", WARNING, "P2P unavailable between 1 GPU pair (0-1: chipset not supported)"),
    ("iommu translating", "iommu", WARNING, "IOMMU translating DMA"),
    ("iommu passthrough", "iommu", OK, "passthrough"),
    ("iommu unreadable", "iommu", UNKNOWN, "not readable"),
    ("ib down", "infiniband", WARNING, "mlx5_0/1 DOWN"),
    ("nvlink down", "nvlink", WARNING, "GPU 2 link 1"),
    ("persistence off", "persistence_mode", WARNING, "persistence mode off on GPU 5"),
    ("memory repair pending", "gpu_memory", WARNING, "memory repair pending on GPU 4"),
    ("uncorrected ecc", "gpu_memory", WARNING, "uncorrected ECC errors since the driver loaded (GPU 6: 3)"),
    ("memory repair failed", "gpu_memory", ERROR, "memory row remap failed on GPU 1"),
    ("retired pages pending", "gpu_memory", WARNING, "memory repair pending on GPU 2"),
    ("memory health unreported", "gpu_memory", UNKNOWN, "not reported"),
])
def test_node_checks(tmp_path: Path, case: str, check: str, severity: str, phrase: str) -> None:
    gpus, tree, nvml = eight(), {}, {}
    if case == "acs enabled":
        tree = {"bridge_acs": 0x001D}  # source validation, P2P request redirect, upstream forwarding
    elif case == "acs unreadable":
        tree = {"short_config": True}
    elif case == "x8 link":
        gpus[3] = FakeGpu(bus_id=gpus[3].bus_id, pcie_width=(8, 16))
    elif case == "memory repair pending":
        gpus[4] = FakeGpu(bus_id=gpus[4].bus_id, remapped_rows=(0, 1, 1, 0))
    elif case == "uncorrected ecc":
        gpus[6] = FakeGpu(bus_id=gpus[6].bus_id, ecc=(40, 3))
    elif case == "memory repair failed":
        gpus[1] = FakeGpu(bus_id=gpus[1].bus_id, remapped_rows=(0, 9, 0, 1))
    elif case == "retired pages pending":  # before Ampere: page retirement, no row remapping
        gpus[2] = FakeGpu(bus_id=gpus[2].bus_id, not_supported={"nvmlDeviceGetRemappedRows"}, retired_pages_pending=1)
    elif case == "memory health unreported":
        gpus = [FakeGpu(bus_id=g.bus_id, not_supported={"nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows",
                                                        "nvmlDeviceGetRetiredPagesPendingStatus"}) for g in gpus]
    elif case == "gen at idle":
        gpus[0] = FakeGpu(bus_id=gpus[0].bus_id, pcie_gen=(1, 5))
    elif case == "mixed models":
        gpus[7] = FakeGpu(name="NVIDIA A100-SXM4-80GB", bus_id=gpus[7].bus_id)
    elif case == "old kernel":
        tree = {"kernel": "4.18.0-305.el8_4.x86_64"}
    elif case == "p2p broken":
        nvml = {"p2p": {(0, 1): 1}}
    elif case == "iommu translating":
        tree = {"iommu_groups": 12, "cmdline": "ro intel_iommu=on"}
    elif case == "iommu passthrough":
        tree = {"iommu_groups": 12, "cmdline": "ro intel_iommu=on iommu=pt"}
    elif case == "iommu unreadable":
        tree = {"iommu_groups": None}
    elif case == "ib down":
        tree = {"ib": [("1: DOWN", "3: Disabled")]}
    elif case == "nvlink down":
        gpus = eight(nvlinks=(1, 1))
        gpus[2] = FakeGpu(bus_id=gpus[2].bus_id, nvlinks=(1, 0))
    elif case == "persistence off":
        gpus[5] = FakeGpu(bus_id=gpus[5].bus_id, persistence=0)
    facts = facts_for(tmp_path, FakeNvml(gpus, **nvml), **tree)  # type: ignore[arg-type]
    result = finding(examine(facts), check)
    assert result.severity == severity and phrase in result.evidence, result
    if severity in (WARNING, ERROR):
        assert result.fix


def test_acs_reader_follows_the_capability_chain() -> None:
    data = bytearray(4096)
    struct.pack_into("<I", data, 0x100, 0x0001 | (1 << 16) | (0x140 << 20))  # AER first, then ACS at 0x140
    struct.pack_into("<I", data, 0x140, 0x000D | (1 << 16))
    struct.pack_into("<H", data, 0x146, 0x0004)
    assert acs_redirect(bytes(data)) is True
    assert acs_redirect(bytes(data[:256])) is None


@pytest.mark.parametrize(("spec", "expected"), [
    ("eth", ["eth0"]), ("=eth0", ["eth0"]), ("=eth", []), ("^docker,lo", ["eth0"]), ("ib", []),
    ("eth,docker", ["eth0", "docker0"]), ("^=eth0", ["lo", "docker0"]),
])
def test_socket_ifname_syntax(spec: str, expected: list[str]) -> None:
    assert interface_matches(spec, UP) == expected


def job_findings(tmp_path: Path, ranks: list[RankInfo], gpus: list[FakeGpu] | None = None, **tree: object):  # type: ignore[no-untyped-def]
    facts = facts_for(tmp_path, FakeNvml(gpus or eight()), **tree)
    return examine(facts, ranks)


@pytest.mark.parametrize(("case", "check", "severity", "phrase"), [
    ("missing interface", "socket_ifname", ERROR, "NCCL_SOCKET_IFNAME=ib matches no interface that is up"),
    ("interface ok", "socket_ifname", OK, "NCCL_SOCKET_IFNAME=^docker,lo -> eth0"),
    ("gloo interface", "socket_ifname", ERROR, "GLOO_SOCKET_IFNAME==bond0"),
    ("ib down, not disabled", "ib_disable", WARNING, "no port active, and NCCL_IB_DISABLE is unset"),
    ("ib up, disabled", "ib_disable", WARNING, "NCCL_IB_DISABLE=1 while InfiniBand ports are active"),
    ("h20 p2p", "p2p_settings", WARNING,
     "P2P reported OK but NCCL_P2P_DISABLE unset on H20 GPUs, which have a known P2P issue"),
    ("p2p broken, unset", "p2p_settings", WARNING, "P2P unavailable on 1 GPU pair but NCCL_P2P_DISABLE is unset"),
    ("p2p disabled needlessly", "p2p_settings", INFO, "NCCL_P2P_DISABLE=1 although P2P is reported OK"),
    ("p2p not read", "p2p_settings", UNKNOWN, "the P2P matrix was not read"),
    ("non-contiguous", "visible_devices", WARNING, "CUDA_VISIBLE_DEVICES=0,2,4 is not contiguous"),
    ("numa span", "visible_devices", WARNING, "spans NUMA nodes [0, 1]"),
    ("inconsistent", "job_nccl_settings", WARNING, "ranks of one job disagree on NCCL_ALGO"),
    ("mixed job", "job_gpu_models", WARNING, "different GPU models"),
    ("no error handling", "timeouts", WARNING, "TORCH_NCCL_ASYNC_ERROR_HANDLING=0"),
    ("flight recorder", "flight_recorder", INFO, "TORCH_NCCL_TRACE_BUFFER_SIZE"),
])
def test_job_checks(tmp_path: Path, case: str, check: str, severity: str, phrase: str) -> None:
    gpus, tree = None, {}
    ranks = [rank({})]
    if case == "missing interface":
        ranks = [rank({"NCCL_SOCKET_IFNAME": "ib"})]
    elif case == "interface ok":
        ranks = [rank({"NCCL_SOCKET_IFNAME": "^docker,lo"})]
    elif case == "gloo interface":
        ranks = [rank({"GLOO_SOCKET_IFNAME": "=bond0"})]
    elif case == "ib down, not disabled":
        tree = {"ib": [("1: DOWN", "3: Disabled")]}
    elif case == "ib up, disabled":
        tree, ranks = {"ib": [("4: ACTIVE", "5: LinkUp")]}, [rank({"NCCL_IB_DISABLE": "1"})]
    elif case == "h20 p2p":
        gpus = eight(name="NVIDIA H20")
    elif case == "p2p broken, unset":
        facts = facts_for(tmp_path, FakeNvml(eight(), p2p={(0, 1): 2}))
        result = finding(examine(facts, ranks), check)
        assert result.severity == severity and phrase in result.evidence
        return
    elif case == "p2p disabled needlessly":
        ranks = [rank({"NCCL_P2P_DISABLE": "1"})]
    elif case == "p2p not read":  # NVML does not answer the P2P query on this driver
        facts = facts_for(tmp_path, FakeNvml(eight(), missing={"nvmlDeviceGetP2PStatus"}))
        found = examine(facts, ranks)
        assert finding(found, "p2p").severity == UNKNOWN
        result = finding(found, check)
        assert result.severity == severity and phrase in result.evidence, result
        return
    elif case == "non-contiguous":
        ranks = [rank({"CUDA_VISIBLE_DEVICES": "0,2,4"})]  # fixture: even GPUs on NUMA 0, odd on NUMA 1
    elif case == "numa span":
        ranks = [rank({"CUDA_VISIBLE_DEVICES": "0,1"})]
    elif case == "inconsistent":
        ranks = [rank({"NCCL_ALGO": "Ring"}, pid=1), rank({"NCCL_ALGO": "Tree"}, pid=2)]
    elif case == "mixed job":
        gpus = eight()
        gpus[1] = FakeGpu(name="NVIDIA A100-SXM4-80GB", bus_id=gpus[1].bus_id)
        ranks = [rank({}, gpus=(0,), pid=1), rank({}, gpus=(1,), pid=2)]
    elif case == "no error handling":
        ranks = [rank({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})]
    result = finding(job_findings(tmp_path, ranks, gpus, **tree), check)
    assert result.severity == severity and phrase in result.evidence, result


def test_without_nvml_the_gpu_checks_say_unknown(tmp_path: Path) -> None:
    sys_root, proc_root = node_tree(tmp_path, [])

    def no_driver() -> Inventory:
        raise RuntimeError("NVML Shared Library Not Found")

    findings = examine(gather(no_driver, sys_root, proc_root, lambda: UP))
    assert finding(findings, "driver").severity == UNKNOWN
    assert finding(findings, "p2p").severity == UNKNOWN and finding(findings, "nvlink").severity == UNKNOWN
    assert finding(findings, "kernel").severity == OK


def test_cli_exit_codes_and_json(tmp_path: Path) -> None:
    clean = subprocess.run([sys.executable, "-m", "watchdog", "doctor", "--json"], capture_output=True, text=True,
                           cwd=REPO, timeout=60)
    assert clean.returncode == 0, clean.stderr
    report = json.loads(clean.stdout)
    assert {"check", "severity", "evidence", "fix"} <= report["findings"][0].keys()
    env = {"RANK": "0", "WORLD_SIZE": "2", "NCCL_SOCKET_IFNAME": "nosuchif"}
    with python_target("queue", tmp_path, env) as process:
        bad = subprocess.run([sys.executable, "-m", "watchdog", "doctor", "--pid", str(process.pid)],
                             capture_output=True, text=True, cwd=REPO, timeout=60)
    assert bad.returncode == 4
    assert "ERROR socket_ifname" in bad.stdout and "NCCL_SOCKET_IFNAME=nosuchif matches no interface" in bad.stdout
    assert "-> set NCCL_SOCKET_IFNAME to an interface that exists here" in bad.stdout
