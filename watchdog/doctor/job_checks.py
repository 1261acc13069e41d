"""The doctor's job checks: the NCCL and launcher settings of the job's ranks against the node (its
interfaces, its GPUs, InfiniBand). Pure functions of the ranks whose environments were read and the node's facts.

Claims stay within what was checked: a rank whose environment could not be read makes a check "unknown".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from watchdog.doctor.facts import Interface, NodeFacts
from watchdog.doctor.finding import ERROR, INFO, KNOWN_P2P_TROUBLE, OK, UNKNOWN, WARNING, DoctorFinding, model_short
from watchdog.sample.ranks import RankInfo
from watchdog.vocabulary.words import counted


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
    read = f.p2p_read()
    broken = [pair for pair, status in read.items() if status != "ok"]
    troubled = sorted({model_short(g.name) for g in f.gpus if g.name and any(k in g.name for k in KNOWN_P2P_TROUBLE)})
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
    names = {g.index: model_short(g.name) for g in f.gpus}
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
