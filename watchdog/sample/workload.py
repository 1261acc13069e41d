"""Where a rank runs, in the words of the scheduler that started it: its Kubernetes namespace, pod and
container, or its Slurm job, step and user. An on-call engineer goes from an alert to `kubectl -n NS
describe pod POD` or `scontrol show job ID` with these.

The kernel and the kubelet are believed before the rank: a rank's environment is its own to set.
Slurm: the rank's cgroup path (`.../job_<id>/step_<n>/...`, cgroup v1 and v2), which Slurm sets and the
rank cannot leave; the environment (SLURM_JOB_ID, SLURM_STEP_ID, SLURM_JOB_USER) only where the cgroup
names no job, and then marked as `claimed`.
Kubernetes: the kubelet's pod-resources API maps each GPU to the pod and container holding it
(sample/kubelet.py); without it, the cgroup path (`kubepods...pod<uid>...`) says the process is in a pod,
and the pod's name is the HOSTNAME Kubernetes gives it (POD_NAME and POD_NAMESPACE where the pod sets
them from the downward API), marked as `claimed`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from watchdog.model import WORKLOAD_LABELS, Workload

# The variables read from a rank's environment for this (also kept for the bundle's environment.json).
WORKLOAD_VARIABLES = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_JOB_USER", "HOSTNAME", "POD_NAME", "POD_NAMESPACE")

_SLURM_CGROUP = re.compile(r"/job_(\d+)(?:/step_([A-Za-z0-9_]+))?")
_SLURM_UID = re.compile(r"/uid_(\d+)/")
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_LABEL_MAX = 253  # a Kubernetes name is at most 253 characters; anything longer is not one


def slurm(env: Mapping[str, str], cgroup: str) -> Workload:
    """The Slurm job of a process: its cgroup path first (the kernel's word), the environment where the
    cgroup names no job (then marked `claimed`). The user's name comes from the environment only when it
    names the job the cgroup names."""
    job, step, user = env.get("SLURM_JOB_ID"), env.get("SLURM_STEP_ID"), env.get("SLURM_JOB_USER")
    found = _SLURM_CGROUP.search(cgroup)
    if not found:
        claimed = tuple(n for n, v in (("slurm_job_id", job), ("slurm_step", step), ("slurm_user", user)) if v)
        return Workload(slurm_job_id=_bounded(job), slurm_step=_bounded(step), slurm_user=_bounded(user),
                        claimed=claimed)
    agrees = job == found.group(1)
    job = found.group(1)
    step = found.group(2) or (step if agrees else None)
    if not agrees or user is None:
        uid = _SLURM_UID.search(cgroup)
        user = f"uid {uid.group(1)}" if uid else None
    return Workload(slurm_job_id=_bounded(job), slurm_step=_bounded(step), slurm_user=_bounded(user))


def pod_uid(cgroup: str) -> str | None:
    """The pod UID in a kubepods cgroup path (cgroupfs `pod<uid>` or systemd `pod<uid_with_underscores>`)."""
    if "kubepods" not in cgroup:
        return None
    found = _POD_UID.search(cgroup)
    return found.group(1).replace("_", "-") if found else None


def pod_from_cgroup(env: Mapping[str, str], cgroup: str) -> Workload:
    """A process in a pod, named without the kubelet: the pod's HOSTNAME (or POD_NAME), POD_NAMESPACE if
    the pod sets it. The container's name is not known this way."""
    if pod_uid(cgroup) is None:
        return Workload()
    found = Workload(namespace=_bounded(env.get("POD_NAMESPACE")),
                     pod=_bounded(env.get("POD_NAME") or env.get("HOSTNAME")))
    return Workload(found.namespace, found.pod, claimed=tuple(n for n in ("namespace", "pod") if getattr(found, n)))


def merged(first: Workload, then: Workload) -> Workload:
    """`first`'s fields, with `then`'s where `first` is silent (a claim goes along with its field)."""
    values = {name: getattr(first, name) or getattr(then, name) for name in WORKLOAD_LABELS}
    claimed = tuple(n for n in WORKLOAD_LABELS if values[n] is not None and (
        (getattr(first, n) and n in first.claimed) or (not getattr(first, n) and n in then.claimed)))
    return Workload(**values, claimed=claimed)


def common(workloads: Iterable[Workload]) -> Workload:
    """What every one of these says alike (the ranks of one incident): a field that differs is None."""
    values: dict[str, set[str | None]] = {name: set() for name in WORKLOAD_LABELS}
    claimed: set[str] = set()
    for workload in workloads:
        claimed.update(workload.claimed)
        for name in WORKLOAD_LABELS:
            values[name].add(getattr(workload, name))
    alike = {name: next(iter(found)) if len(found) == 1 else None for name, found in values.items()}
    return Workload(**alike, claimed=tuple(n for n in WORKLOAD_LABELS if n in claimed and alike[n]))


def _bounded(value: str | None) -> str | None:
    """A name fit for a label: printable, bounded; anything else is dropped rather than exported."""
    if not value or len(value) > _LABEL_MAX or not value.isprintable():
        return None
    return value
