"""The doctor: the environment faults behind most stalls, each a small named check with a severity, the
evidence, and the fix in one sentence. Pure functions of the node's facts and the job's ranks.

Claims stay within what was checked: a fact that could not be read makes a check "unknown", never ok.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from watchdog.doctor.facts import Interface, NodeFacts, kernel_version_tuple
from watchdog.sample.ranks import RankInfo
from watchdog.words import counted, gpu_list


class Level(str, enum.Enum):
    """How bad a doctor's finding is (a scale of its own: a node fact is not an episode's severity)."""

    OK = "ok"
    INFO = "info"
    UNKNOWN = "unknown"
    WARNING = "warning"
    ERROR = "error"


OK, INFO, UNKNOWN, WARNING, ERROR = Level.OK, Level.INFO, Level.UNKNOWN, Level.WARNING, Level.ERROR
_ORDER = {ERROR: 0, WARNING: 1, UNKNOWN: 2, INFO: 3, OK: 4}

# GPUs on which P2P is reported available but hangs in practice (NCCL_P2P_DISABLE=1 is the known fix).
KNOWN_P2P_TROUBLE = ("H20", "L20", "RTX 4090", "RTX 3090")


@dataclass(frozen=True)
class DoctorFinding:
    check: str
    severity: Level
    evidence: str
    fix: str = ""

    def to_json(self) -> dict[str, str]:
        return {"check": self.check, "severity": self.severity.value, "evidence": self.evidence, "fix": self.fix}


def _model_short(name: str | None) -> str:
    return (name or "unknown").replace("NVIDIA ", "")


# -- node checks -----------------------------------------------------------------------------------
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
    models = Counter(_model_short(g.name) for g in f.gpus)
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
    read = _p2p_read(f)
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


def _p2p_read(f: NodeFacts) -> dict[tuple[int, int], str]:
    """The P2P pairs NVML answered for: an "unknown" pair was not read, and is neither OK nor broken."""
    return {pair: status for pair, status in f.p2p.items() if status != "unknown"}


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
def interface_matches(spec: str, interfaces: Sequence[Interface]) -> list[str]:
    """NCCL_SOCKET_IFNAME syntax: comma-separated prefixes; '=' for exact names; a leading '^' excludes."""
    spec = spec.strip()
    exclude = spec.startswith("^")
    body = spec[1:] if exclude else spec
    exact = body.startswith("=")
    names = [n.strip() for n in (body[1:] if exact else body).split(",") if n.strip()]

    def match(iface: str) -> bool:
        return any(iface == n if exact else iface.startswith(n) for n in names)

    up = [i.name for i in interfaces if i.up]
    if exclude:
        return [name for name in up if not match(name)]
    return [name for name in up if match(name)]


def check_socket_ifname(ranks: Sequence[RankInfo], f: NodeFacts) -> list[DoctorFinding]:
    out = []
    for variable in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        specs = {r.env[variable] for r in ranks if variable in r.env}
        for spec in sorted(specs):
            if f.interfaces is None:
                out.append(DoctorFinding("socket_ifname", UNKNOWN, f"{variable}={spec}: the network interfaces "
                                         "could not be read"))
                continue
            found = interface_matches(spec, f.interfaces)
            if not found:
                existing = ", ".join(i.name + ("" if i.up else " (down)") for i in f.interfaces)
                out.append(DoctorFinding("socket_ifname", ERROR, f"{variable}={spec} matches no interface that is up "
                                         f"on this host (have: {existing})", f"set {variable} to an interface "
                                         "that exists here, or unset it to let NCCL choose"))
            else:
                out.append(DoctorFinding("socket_ifname", OK, f"{variable}={spec} -> {', '.join(found)}"))
    return out


def check_ib_disable(ranks: Sequence[RankInfo], f: NodeFacts) -> list[DoctorFinding]:
    values = {r.env.get("NCCL_IB_DISABLE") for r in ranks}
    if not f.ib_ports:
        return []
    active = any(p.state == "ACTIVE" for p in f.ib_ports)
    if "1" in values and active:
        return [DoctorFinding("ib_disable", WARNING, "NCCL_IB_DISABLE=1 while InfiniBand ports are active",
                              "unset NCCL_IB_DISABLE: NCCL falls back to TCP sockets, far slower")]
    if "1" not in values and not active:
        return [DoctorFinding("ib_disable", WARNING, "InfiniBand devices present but no port active, and "
                              "NCCL_IB_DISABLE is unset", "set NCCL_IB_DISABLE=1 (or bring the ports up): NCCL "
                              "will try IB and can hang")]
    return [DoctorFinding("ib_disable", OK, f"NCCL_IB_DISABLE={'1' if '1' in values else 'unset'}; IB "
                                            f"{'active' if active else 'down'}")]


def check_p2p_settings(ranks: Sequence[RankInfo], f: NodeFacts) -> list[DoctorFinding]:
    disabled = any(r.env.get("NCCL_P2P_DISABLE") == "1" for r in ranks)
    level = {r.env["NCCL_P2P_LEVEL"] for r in ranks if "NCCL_P2P_LEVEL" in r.env}
    read = _p2p_read(f)
    broken = [pair for pair, status in read.items() if status != "ok"]
    troubled = sorted({_model_short(g.name) for g in f.gpus if g.name and any(k in g.name for k in KNOWN_P2P_TROUBLE)})
    if broken and not disabled and not level:
        return [DoctorFinding("p2p_settings", WARNING, f"P2P unavailable on {counted(len(broken), 'GPU pair')} but "
                              "NCCL_P2P_DISABLE is unset", "set NCCL_P2P_DISABLE=1 for this job")]
    if troubled and read and not broken and not disabled and not level:
        return [DoctorFinding("p2p_settings", WARNING, f"P2P reported OK but NCCL_P2P_DISABLE unset on "
                              f"{'/'.join(troubled)} GPUs, which have a known P2P issue",
                              "if collectives hang at 100% util, set NCCL_P2P_DISABLE=1 (costs 7-10% speed)")]
    if disabled and read and not broken:
        return [DoctorFinding("p2p_settings", INFO, "NCCL_P2P_DISABLE=1 although P2P is reported OK",
                              "P2P off costs throughput: drop it unless it was set to work around a hang")]
    if not f.gpus:  # no GPU seen (NVML did not start): nothing to agree with
        return [DoctorFinding("p2p_settings", UNKNOWN, "no GPU seen, so the NCCL P2P settings cannot be checked")]
    if len(f.gpus) == 1:
        return [DoctorFinding("p2p_settings", OK, "one GPU: no P2P between GPUs for the NCCL settings to agree with")]
    if not read:  # the matrix was not read: nothing to agree with
        return [DoctorFinding("p2p_settings", UNKNOWN, "the P2P matrix was not read, so the NCCL P2P settings "
                              "cannot be checked against it")]
    return [DoctorFinding("p2p_settings", OK, "NCCL P2P settings agree with the P2P matrix")]


def check_diagnosis_settings(ranks: Sequence[RankInfo], f: NodeFacts) -> list[DoctorFinding]:
    if not ranks:
        return [DoctorFinding("diagnosis_settings", UNKNOWN, "no rank to read the settings of")]
    env = ranks[0].env
    out = []
    if "NCCL_DEBUG" not in env:
        out.append(DoctorFinding("nccl_debug", INFO, "NCCL_DEBUG unset", "NCCL_DEBUG=WARN costs nothing and names "
                                 "the failing link when a collective breaks"))
    else:
        out.append(DoctorFinding("nccl_debug", OK, f"NCCL_DEBUG={env['NCCL_DEBUG']}"))
    handling = env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", env.get("NCCL_ASYNC_ERROR_HANDLING"))
    blocking = env.get("TORCH_NCCL_BLOCKING_WAIT", env.get("NCCL_BLOCKING_WAIT"))
    if handling == "0":
        out.append(DoctorFinding("timeouts", WARNING, "TORCH_NCCL_ASYNC_ERROR_HANDLING=0: a timed-out collective "
                                 "is not torn down, so a hang burns the GPUs forever",
                                 "leave it at the default (3) so PyTorch aborts after the process group timeout"))
    else:
        out.append(DoctorFinding("timeouts", INFO, "a hang burns until the process group timeout (NCCL default "
                                 "10 min; set in init_process_group) before PyTorch aborts"
                                 + (" (blocking wait on)" if blocking == "1" else "")))
    # Older PyTorch reads the TORCH_NCCL_* names, newer the TORCH_FR_* ones; either enables the feature.
    wanted = (("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"), ("TORCH_NCCL_DUMP_ON_TIMEOUT",),
              ("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "TORCH_FR_DEBUG_INFO_PIPE_FILE"))
    missing = [" or ".join(names) for names in wanted if not any(n in env for n in names)]
    if not missing:
        found = [next(f"{n}={env[n]}" for n in names if n in env) for names in wanted]
        out.append(DoctorFinding("flight_recorder", OK, f"Flight Recorder enabled ({', '.join(found)})"))
    else:
        out.append(DoctorFinding("flight_recorder", INFO, f"Flight Recorder not fully enabled ({', '.join(missing)} "
                                 "unset)", "set TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 "
                                 "TORCH_NCCL_DEBUG_INFO_PIPE_FILE=/tmp/nccl_pipe_ (newer PyTorch: "
                                 "TORCH_FR_BUFFER_SIZE, TORCH_FR_DEBUG_INFO_PIPE_FILE) so a stall shows the last "
                                 "collectives of every rank"))
    return out


def check_visible_devices(ranks: Sequence[RankInfo], f: NodeFacts) -> list[DoctorFinding]:
    out = []
    numa = {g.index: g.numa_node for g in f.gpus}
    for spec in sorted({r.env["CUDA_VISIBLE_DEVICES"] for r in ranks if "CUDA_VISIBLE_DEVICES" in r.env}):
        devices = [d.strip() for d in spec.split(",") if d.strip()]
        if not all(d.isdigit() for d in devices):
            continue  # UUIDs or MIG: order says nothing
        indexes = [int(d) for d in devices]
        nodes = {n for n in (numa.get(i) for i in indexes) if n is not None}
        if len(nodes) > 1:
            out.append(DoctorFinding("visible_devices", WARNING, f"CUDA_VISIBLE_DEVICES={spec} spans NUMA nodes "
                                     f"{sorted(nodes)}", "pick GPUs on one NUMA node (the 'devices used by this "
                                     "process are currently unknown' barrier warning and cross-socket hangs)"))
        elif indexes != list(range(min(indexes), min(indexes) + len(indexes))):
            out.append(DoctorFinding("visible_devices", WARNING, f"CUDA_VISIBLE_DEVICES={spec} is not contiguous",
                                     "use contiguous GPUs: NCCL rings across gaps cross more PCIe switches"))
    return out


def check_job_consistency(ranks: Sequence[RankInfo], f: NodeFacts) -> list[DoctorFinding]:
    out = []
    names = {g.index: _model_short(g.name) for g in f.gpus}
    models = {names.get(i) for r in ranks for i in r.gpus} - {None}
    if len(models) > 1:
        out.append(DoctorFinding("job_gpu_models", WARNING, f"the job's ranks run on different GPU models: "
                                 f"{', '.join(sorted(m for m in models if m))}", "run the job on one GPU model"))
    variables = sorted({k for r in ranks for k in r.env if k.startswith(("NCCL_", "TORCH_NCCL_"))})
    differing = [v for v in variables if len({r.env.get(v) for r in ranks}) > 1]
    if differing:
        out.append(DoctorFinding("job_nccl_settings", WARNING, "ranks of one job disagree on "
                                 + ", ".join(differing[:6]), "give every rank the same NCCL settings"))
    return out


JOB_CHECKS: dict[str, Callable[[Sequence[RankInfo], NodeFacts], list[DoctorFinding]]] = {
    "socket_ifname": check_socket_ifname, "ib_disable": check_ib_disable, "p2p_settings": check_p2p_settings,
    "diagnosis_settings": check_diagnosis_settings, "visible_devices": check_visible_devices,
    "job_consistency": check_job_consistency,
}


def job_findings(ranks: Sequence[RankInfo], facts: NodeFacts) -> list[DoctorFinding]:
    """Every job check over the ranks whose environments were read (what the checks look at). One more finding
    names the ranks not read and why; with none read, each check says unknown, never ok and never "unset"."""
    read = [r for r in ranks if r.env_read]
    unread = [r for r in ranks if not r.env_read]
    findings = [finding for check in JOB_CHECKS.values() for finding in check(read, facts)] if read else [
        DoctorFinding(name, UNKNOWN, "not checked: no rank's environment could be read") for name in JOB_CHECKS]
    if unread:
        why = "; ".join(f"pid {r.pid}: {'; '.join(r.problems) or 'not read'}" for r in unread[:3]) + (
            f"; {len(unread) - 3} more" if len(unread) > 3 else "")
        said = f"the job checks read {len(read)} of {len(ranks)} ranks' environments" if read else (
            "no rank's environment could be read")
        findings.append(DoctorFinding("job_environment", UNKNOWN, f"{said}; not read: {why}", "run the doctor as "
                                      "the job's user, or with CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH (as the "
                                      "shipped units do)"))
    return findings


def examine(facts: NodeFacts, ranks: Sequence[RankInfo] = ()) -> list[DoctorFinding]:
    """Every node check, then every job check over the ranks given; worst first."""
    findings = [check(facts) for check in NODE_CHECKS.values()]
    if ranks:
        findings.extend(job_findings(ranks, facts))
    return sorted(findings, key=lambda d: _ORDER[d.severity])


def top_finding(findings: Sequence[DoctorFinding]) -> DoctorFinding | None:
    """The finding worth quoting in an alert: the worst warning or error, if any."""
    return next((d for d in findings if d.severity in (ERROR, WARNING)), None)
