"""The doctor: the environment faults behind most stalls, each a small named check with a severity, the
evidence, and the fix in one sentence. Pure functions of the node's facts (here) and the job's ranks
(doctor/job_checks.py).

Claims stay within what was checked: a fact that could not be read makes a check "unknown", never ok.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from watchdog.doctor.facts import NodeFacts, kernel_version_tuple
from watchdog.doctor.finding import ERROR, INFO, OK, ORDER, UNKNOWN, WARNING, DoctorFinding, model_short
from watchdog.doctor.job_checks import job_findings
from watchdog.sample.ranks import RankInfo
from watchdog.vocabulary.words import counted, gpu_list


def check_driver(f: NodeFacts) -> DoctorFinding:
    """NVML that cannot start is an error on a node whose host shows NVIDIA GPUs (no job can use them: the
    Slurm prolog drains it), and unknown on a node that shows none."""
    if f.driver_version is None:
        reason = "; ".join(p.removeprefix("NVML: ").removeprefix("NVML could not start: ") for p in f.problems
                           if p.startswith("NVML")) or "not read"
        if f.host_gpus:
            seen = ", ".join(f"{counted(n, 'NVIDIA GPU')} {where}" for where, n in f.host_gpus.items())
            return DoctorFinding("driver", ERROR, f"NVML cannot start ({reason}) on a node with GPUs: {seen}",
                                 "load or repair the NVIDIA driver until `nvidia-smi` lists every GPU: until then "
                                 "no job can use a GPU here")
        return DoctorFinding("driver", UNKNOWN, f"NVML cannot start ({reason}); no NVIDIA GPU on the PCI bus, in "
                             "/proc/driver/nvidia or in /dev either",
                             "if this node should have GPUs: install the NVIDIA driver and check that "
                             "`nvidia-smi` works")
    return DoctorFinding("driver", INFO, f"driver {f.driver_version}, NVML {f.nvml_version or '?'}, "
                                         f"CUDA driver {f.cuda_driver_version or '?'}, {counted(len(f.gpus), 'GPU')}")


def check_mixed_models(f: NodeFacts) -> DoctorFinding:
    models = Counter(model_short(g.name) for g in f.gpus)
    if len(models) > 1:
        return DoctorFinding("gpu_models", WARNING, "mixed GPU models: " + ", ".join(f"{n}x {m}" for m, n in
                                                                                    models.items()),
                             "run one job on one GPU model: mixed models make the fast ranks wait on the slow")
    return DoctorFinding("gpu_models", OK if models else UNKNOWN, ", ".join(f"{n}x {m}" for m, n in models.items())
                         or "no GPU seen")


def check_persistence(f: NodeFacts) -> DoctorFinding:
    off = [g.index for g in f.gpus if g.persistence_mode is False]
    if off:
        return DoctorFinding("persistence_mode", WARNING, f"persistence mode off on {gpu_list(off)}",
                             "enable it (`nvidia-smi -pm 1` or nvidia-persistenced) so the driver stays loaded "
                             "between jobs")
    known = [g for g in f.gpus if g.persistence_mode is not None]
    return DoctorFinding("persistence_mode", OK if known else UNKNOWN, "on" if known else "not reported")


def check_kernel(f: NodeFacts) -> DoctorFinding:
    if f.kernel is None:
        return DoctorFinding("kernel", UNKNOWN, "kernel release not readable")
    gpus = len(f.gpus) if f.driver_version is not None else max(f.host_gpus.values(), default=0)
    if gpus > 1 and kernel_version_tuple(f.kernel) < (5, 5):
        return DoctorFinding("kernel", WARNING, f"Linux {f.kernel} on a node with {counted(gpus, 'GPU')}",
                             "use a kernel >= 5.5: multi-GPU NCCL jobs are known to hang on older ones")
    return DoctorFinding("kernel", OK, f"Linux {f.kernel}")


def check_p2p(f: NodeFacts) -> DoctorFinding:
    if not f.gpus:
        return DoctorFinding("p2p", UNKNOWN, "no GPU seen")
    read = f.p2p_read()
    if not read:
        return DoctorFinding("p2p", UNKNOWN if len(f.gpus) > 1 else OK,
                             "P2P not read" if len(f.gpus) > 1 else "single GPU")
    broken = {pair: status for pair, status in read.items() if status != "ok"}
    if broken:
        listed = ", ".join(f"{i}-{j}: {s}" for (i, j), s in sorted(broken.items())[:6])
        return DoctorFinding("p2p", WARNING, f"P2P unavailable between {counted(len(broken), 'GPU pair')} ({listed})",
                             "set NCCL_P2P_DISABLE=1 (or NCCL_P2P_LEVEL) for jobs here, or fix the PCIe/ACS setup")
    unread = len(f.p2p) - len(read)
    return DoctorFinding("p2p", OK, f"P2P reported OK between {'all ' if len(read) > 1 else ''}"
                                    f"{counted(len(read), 'GPU pair')} read"
                         + (f" ({unread} not read)" if unread else ""))


def check_topology(f: NodeFacts) -> DoctorFinding:
    numa = {g.index: g.numa_node for g in f.gpus}
    nodes = sorted({n for n in numa.values() if n is not None})
    cross = Counter(level for level in f.topology.values())
    evidence = f"NUMA nodes {nodes or 'unknown'}; GPU pair links: " + (", ".join(
        f"{n} {level}" for level, n in sorted(cross.items())) or "not read")
    return DoctorFinding("topology", INFO, evidence)


def check_pcie(f: NodeFacts) -> DoctorFinding:
    narrow = [f"GPU {g.index} x{g.pcie_width[0]} of x{g.pcie_width[1]}" for g in f.gpus
              if g.pcie_width and g.pcie_width[0] < g.pcie_width[1]]
    if narrow:
        return DoctorFinding("pcie_link", WARNING, "PCIe link trained narrower than the slot: " + ", ".join(narrow),
                             "reseat the GPU or riser and check the slot: a narrow link slows every collective")
    slow = [f"GPU {g.index} gen{g.pcie_gen[0]} of gen{g.pcie_gen[1]}" for g in f.gpus
            if g.pcie_gen and g.pcie_gen[0] < g.pcie_gen[1]]
    if slow:
        return DoctorFinding("pcie_link", INFO, "below max generation (normal at idle, as links save power): "
                             + ", ".join(slow))
    known = [g for g in f.gpus if g.pcie_width]
    return DoctorFinding("pcie_link", OK if known else UNKNOWN, "full width" if known else "not reported")


def check_gpu_memory(f: NodeFacts) -> DoctorFinding:
    """Uncorrected ECC errors and memory repairs (row remapping, page retirement) waiting or failed."""
    failed = [g.index for g in f.gpus if g.memory_repair and g.memory_repair[1]]
    if failed:
        return DoctorFinding("gpu_memory", ERROR, f"memory row remap failed on {gpu_list(failed)}",
                             "drain the node: the GPU needs service")
    pending = [g.index for g in f.gpus if g.memory_repair and g.memory_repair[0]]
    errors = [f"GPU {g.index}: {g.ecc_uncorrected}" for g in f.gpus if g.ecc_uncorrected]
    if pending or errors:
        parts = ([f"memory repair pending on {gpu_list(pending)}"] if pending else []) + (
            [f"uncorrected ECC errors since the driver loaded ({', '.join(errors)})"] if errors else [])
        return DoctorFinding("gpu_memory", WARNING, "; ".join(parts),
                             "drain the node and reset the GPU (nvidia-smi -r) when it is idle; replace it if the "
                             "errors come back")
    known = [g for g in f.gpus if g.ecc_uncorrected is not None or g.memory_repair is not None]
    return DoctorFinding("gpu_memory", OK if known else UNKNOWN,
                         "no uncorrected ECC errors, no memory repair waiting" if known else "not reported")


def check_nvlink(f: NodeFacts) -> DoctorFinding:
    down = [f"GPU {g.index} link {n}" for g in f.gpus if g.nvlinks for n, up in enumerate(g.nvlinks) if not up]
    if down:
        return DoctorFinding("nvlink", WARNING, "NVLink links down: " + ", ".join(down[:8]),
                             "check `nvidia-smi nvlink -s` and the NVSwitch fabric manager")
    if not f.gpus:
        return DoctorFinding("nvlink", UNKNOWN, "no GPU seen")
    with_links = [g for g in f.gpus if g.nvlinks]
    return DoctorFinding("nvlink", OK if with_links else INFO, counted(sum(len(g.nvlinks or ()) for g in with_links),
                                                                       "link") + " up" if with_links else "no NVLink")


def check_acs(f: NodeFacts) -> DoctorFinding:
    on = [b for b, redirect in f.acs_bridges.items() if redirect]
    if on:
        return DoctorFinding("pcie_acs", WARNING, "ACS redirect enabled on bridges above the GPUs: "
                             + ", ".join(on[:6]),
                             "disable ACS on those bridges (BIOS, or setpci): it sends P2P traffic through the "
                             "root complex and is a classic cause of NCCL P2P hangs")
    unknown = [b for b, redirect in f.acs_bridges.items() if redirect is None]
    if unknown or not f.acs_bridges:
        return DoctorFinding("pcie_acs", UNKNOWN, "bridge config space not readable (run as root)"
                             if unknown else "no bridges found above the GPUs")
    return DoctorFinding("pcie_acs", OK, f"ACS redirect off on {counted(len(f.acs_bridges), 'bridge')}")


def check_iommu(f: NodeFacts) -> DoctorFinding:
    cmdline = f.cmdline or ""
    if f.iommu_groups is None:
        return DoctorFinding("iommu", UNKNOWN, "IOMMU state not readable")
    if f.iommu_groups == 0:
        return DoctorFinding("iommu", OK, "IOMMU off")
    if "iommu=pt" in cmdline or "iommu.passthrough=1" in cmdline:
        return DoctorFinding("iommu", OK, f"IOMMU on in passthrough mode ({f.iommu_groups} groups)")
    return DoctorFinding("iommu", WARNING, f"IOMMU translating DMA ({f.iommu_groups} groups, no iommu=pt)",
                         "boot with iommu=pt (or disable the IOMMU) for GPU P2P: translation slows or breaks it")


def check_infiniband(f: NodeFacts) -> DoctorFinding:
    if not f.ib_ports:
        return DoctorFinding("infiniband", INFO, "no InfiniBand devices")
    down = [f"{p.device}/{p.port} {p.state}" for p in f.ib_ports if p.state != "ACTIVE"]
    if down:
        return DoctorFinding("infiniband", WARNING, "InfiniBand ports not active: " + ", ".join(down),
                             "bring the ports up (subnet manager, cable), or set NCCL_IB_DISABLE=1 for jobs here")
    return DoctorFinding("infiniband", OK, f"{counted(len(f.ib_ports), 'InfiniBand port')} active")


def check_interfaces(f: NodeFacts) -> DoctorFinding:
    if f.interfaces is None:
        return DoctorFinding("network", UNKNOWN, "the network interfaces could not be read")
    up = [i.name for i in f.interfaces if i.up and i.name != "lo"]
    return DoctorFinding("network", INFO if up else WARNING, f"interfaces up: {', '.join(up) or 'none but lo'}")


NODE_CHECKS: dict[str, Callable[[NodeFacts], DoctorFinding]] = {
    "driver": check_driver, "gpu_models": check_mixed_models, "persistence_mode": check_persistence,
    "kernel": check_kernel, "p2p": check_p2p, "topology": check_topology, "pcie_link": check_pcie,
    "gpu_memory": check_gpu_memory, "nvlink": check_nvlink, "pcie_acs": check_acs, "iommu": check_iommu,
    "infiniband": check_infiniband,
    "network": check_interfaces,
}


# -- job checks --------------------------------------------------------------------------------------
def examine(facts: NodeFacts, ranks: Sequence[RankInfo] = ()) -> list[DoctorFinding]:
    """Every node check, then every job check over the ranks given; worst first."""
    findings = [check(facts) for check in NODE_CHECKS.values()]
    if ranks:
        findings.extend(job_findings(ranks, facts))
    return sorted(findings, key=lambda d: ORDER[d.severity])


def top_finding(findings: Sequence[DoctorFinding]) -> DoctorFinding | None:
    """The finding worth quoting in an alert: the worst warning or error, if any."""
    return next((d for d in findings if d.severity in (ERROR, WARNING)), None)
