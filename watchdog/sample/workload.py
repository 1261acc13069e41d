"""Where a rank runs, in the words of the scheduler that started it: its Kubernetes namespace, pod and
container, or its Slurm job, step and user. An on-call engineer goes from an alert to `kubectl -n NS
describe pod POD` or `scontrol show job ID` with these.

The kernel and the kubelet are believed before the rank: a rank's environment is its own to set.
Slurm: the rank's cgroup path in slurmstepd's own hierarchy, anchored at the root of the tree (cgroup v1
`/slurm[_<node>]/uid_<uid>/job_<id>/step_<n>/...`, v2 `[/system.slice]/slurmstepd.scope/job_<id>/step_<n>/...`),
which only root can make and the rank cannot leave; a `job_<id>` anywhere else (a user's delegated subtree, a
container's scope) names nothing. The environment (SLURM_JOB_ID, SLURM_STEP_ID, SLURM_JOB_USER) only where
the cgroup names no job, and then marked as `claimed`. act/membership.py asks Slurm to confirm the job before
anything is done to it.
Kubernetes: the kubelet's pod-resources API maps each GPU to the pod and container holding it
(sample/kubelet.py); without it, the cgroup path (`kubepods...pod<uid>...`) says the process is in a pod,
and the pod's name is the HOSTNAME Kubernetes gives it (POD_NAME and POD_NAMESPACE where the pod sets
them from the downward API), marked as `claimed`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from watchdog.vocabulary.model import WORKLOAD_LABELS, Workload

# The variables read from a rank's environment for this (also kept for the bundle's environment.json).
WORKLOAD_VARIABLES = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_JOB_USER", "HOSTNAME", "POD_NAME", "POD_NAMESPACE")

_JOB = r"job_([1-9]\d{0,11})(?:/step_([A-Za-z0-9_]+))?(?:/|$)"  # no leading zeros: one job, one spelling
_SLURM_V1 = re.compile(r"^/slurm(?:_[A-Za-z0-9._-]+)?/uid_(\d+)/" + _JOB)
_SLURM_V2 = re.compile(r"^(?:/system\.slice)?/slurmstepd\.scope/" + _JOB)
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_LABEL_MAX = 253  # a Kubernetes name is at most 253 characters; anything longer is not one


def slurm_cgroup(cgroup: str, uid: int | None = None) -> tuple[str, str | None, str | None] | None:
    """(job id, step, uid in the path) that slurmstepd's own cgroup names for a process, or None. `uid`: the
    process's own user, which a v1 path must name."""
    for line in cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        v1 = _SLURM_V1.match(parts[2])
        if v1 and (uid is None or int(v1.group(1)) == uid):
            return v1.group(2), v1.group(3), v1.group(1)
        v2 = _SLURM_V2.match(parts[2]) if parts[0] == "0" else None
        if v2:
            return v2.group(1), v2.group(2), None
    return None


def slurm(env: Mapping[str, str], cgroup: str, uid: int | None = None) -> Workload:
    """The Slurm job of a process: its cgroup path first (the kernel's word), the environment where the
    cgroup names no job (then marked `claimed`). The user's name comes from the environment only when it
    names the job the cgroup names."""
    job, step, user = env.get("SLURM_JOB_ID"), env.get("SLURM_STEP_ID"), env.get("SLURM_JOB_USER")
    found = slurm_cgroup(cgroup, uid)
    if not found:
        claimed = tuple(n for n, v in (("slurm_job_id", job), ("slurm_step", step), ("slurm_user", user)) if v)
        return Workload(slurm_job_id=_bounded(job), slurm_step=_bounded(step), slurm_user=_bounded(user),
                        claimed=claimed)
    agrees = job == found[0]
    job = found[0]
    step = found[1] or (step if agrees else None)
    if not agrees or user is None:
        user = f"uid {found[2]}" if found[2] else None
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
