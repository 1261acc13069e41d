"""Where a rank runs, in the words of the scheduler that started it: its Kubernetes namespace, pod and
container, or its Slurm job, step and user. An on-call engineer goes from an alert to `kubectl -n NS
describe pod POD` or `scontrol show job ID` with these.

Slurm: the rank's own environment (SLURM_JOB_ID, SLURM_STEP_ID, SLURM_JOB_USER), else its cgroup path
(`.../job_<id>/step_<n>/...`, cgroup v1 and v2).
Kubernetes: the kubelet's pod-resources API maps each GPU to the pod and container holding it
(sample/kubelet.py); without it, the cgroup path (`kubepods...pod<uid>...`) says the process is in a pod,
and the pod's name is the HOSTNAME Kubernetes gives it (POD_NAME and POD_NAMESPACE where the pod sets
them from the downward API).
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
    """The Slurm job of a process: its environment first, its cgroup path where the environment is silent
    (a process that cleared its environment, or one Slurm started without srun's variables)."""
    job, step, user = env.get("SLURM_JOB_ID"), env.get("SLURM_STEP_ID"), env.get("SLURM_JOB_USER")
    found = _SLURM_CGROUP.search(cgroup)
    if found:
        job = job or found.group(1)
        step = step or found.group(2)
        if user is None and (uid := _SLURM_UID.search(cgroup)):
            user = f"uid {uid.group(1)}"
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
    return Workload(namespace=_bounded(env.get("POD_NAMESPACE")),
                    pod=_bounded(env.get("POD_NAME") or env.get("HOSTNAME")))


def merged(first: Workload, then: Workload) -> Workload:
    """`first`'s fields, with `then`'s where `first` is silent."""
    return Workload(*(getattr(first, name) or getattr(then, name) for name in WORKLOAD_LABELS))


def common(workloads: Iterable[Workload]) -> Workload:
    """What every one of these says alike (the ranks of one incident): a field that differs is None."""
    values: dict[str, set[str | None]] = {name: set() for name in WORKLOAD_LABELS}
    for workload in workloads:
        for name in WORKLOAD_LABELS:
            values[name].add(getattr(workload, name))
    return Workload(*(next(iter(found)) if len(found) == 1 else None for found in values.values()))


def _bounded(value: str | None) -> str | None:
    """A name fit for a label: printable, bounded; anything else is dropped rather than exported."""
    if not value or len(value) > _LABEL_MAX or not value.isprintable():
        return None
    return value
