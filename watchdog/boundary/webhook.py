"""What a dump request names: `{"training_job": "..."}`, `{"slurm_job_id": "..."}` (a Slurm epilog), an
Alertmanager webhook (version 4), or nothing (every training job on the node); and what a request to the
coordinator names: training jobs, each with the Slurm job it runs as where that is known.

Alertmanager posts `{"version": "4", "groupLabels": {...}, "commonLabels": {...}, "alerts": [{"labels":
{...}}...]}`; the jobs are the `training_job` labels it carries (group, common and each alert's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from watchdog.boundary import untrusted_data
from watchdog.vocabulary.model import K8S_NAME, SLURM_JOB_ID

LABEL = "training_job"
SLURM_JOB = "slurm_job_id"
MAX_JOB_NAME = 512
BODY_BUILT_BYTES = 16 * 2**20  # the objects a request's body may build (thousands of alerts take a fraction)


class PayloadError(ValueError):
    """A request body that names no job in a form we read; the message says why (answered with 400)."""


def _job(value: object, where: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_JOB_NAME or any(ord(c) < 32 for c in value):
        raise PayloadError(f"{where}: expected a training job name (a non-empty string of at most "
                           f"{MAX_JOB_NAME} printable characters)")
    return value


@dataclass(frozen=True)
class SchedulerIds:
    """What a page says of where a training job runs in its scheduler's words: the Slurm job it runs as, or the
    namespace and pod of one of its ranks (a node's own page: what its daemon proved)."""

    slurm_job_id: str | None = None
    namespace: str | None = None
    pod: str | None = None


def job_requests(body: bytes) -> dict[str, SchedulerIds]:
    """What a request to the coordinator names: each training job (in order, each once) with the scheduler's
    ids for it where the request says them. `{"training_job": "...", "slurm_job_id": "..."}` or with
    "namespace" and "pod" (a node's own page: the ids its daemon proved, from slurmstepd's cgroup or the kubelet)
    or an Alertmanager webhook whose alerts carry those labels. An id a job's alerts give two values of (or
    give and leave out) is not kept: which one is not the coordinator's guess, so its scheduler is not asked."""
    payload = _payload(body)
    if payload is None:
        return {}
    if "alerts" in payload or "version" in payload:
        return _from_alertmanager(payload)
    unknown = sorted(set(payload) - {LABEL, *_READERS})
    if unknown:
        raise PayloadError(f"unknown field {unknown[0]!r}: expected {LABEL!r}, with {SLURM_JOB!r} or 'namespace' "
                           "and 'pod' where known (or an Alertmanager webhook)")
    if LABEL not in payload:
        raise PayloadError(f"name the training job: {LABEL!r} (with {SLURM_JOB!r} where known)")
    return {_job(payload[LABEL], LABEL): _ids(payload, strict=True)}


def _ids(labels: Mapping[str, object], strict: bool) -> SchedulerIds:
    """The scheduler ids in a page (`strict`: a malformed one is a PayloadError; else it is left out)."""
    found: dict[str, str] = {}
    for key, read in _READERS.items():
        if labels.get(key) is not None:
            try:
                found[key] = read(labels[key], key)
            except PayloadError:
                if strict:
                    raise
    if strict and ("pod" in found) != ("namespace" in found):
        raise PayloadError("namespace and pod go together")
    return SchedulerIds(found.get(SLURM_JOB), found.get("namespace"), found.get("pod"))


def _k8s_name(value: object, key: str) -> str:
    if not isinstance(value, str) or not K8S_NAME.match(value):
        raise PayloadError(f"{key}: expected a Kubernetes name (lower-case letters, digits, '-' and '.')")
    return value


def _payload(body: bytes) -> dict[str, object] | None:
    if not body.strip():
        return None
    try:
        payload = untrusted_data.loads_json(body, "the body", BODY_BUILT_BYTES)
    except untrusted_data.TooMuchData as exc:
        raise PayloadError(str(exc)) from None
    except (ValueError, RecursionError) as exc:
        raise PayloadError(f"the body is not JSON ({exc})") from None
    if not isinstance(payload, dict):
        raise PayloadError("expected a JSON object: {\"training_job\": \"...\"} or an Alertmanager webhook")
    return payload


def _slurm_id(value: object, key: str = SLURM_JOB) -> str:
    if not isinstance(value, str) or not SLURM_JOB_ID.match(value):
        raise PayloadError(f"{key}: expected a Slurm job id (digits, as a string)")
    return value


_READERS = {SLURM_JOB: _slurm_id, "namespace": _k8s_name, "pod": _k8s_name}  # the scheduler ids a page may give


def dump_target(body: bytes, slurm: bool = True) -> tuple[tuple[str, ...], str | None]:
    """(training jobs, Slurm job id) a request names; `slurm`: whether `{"slurm_job_id": "..."}` is read."""
    payload = _payload(body)
    if payload is None:
        return (), None
    if "alerts" in payload or "version" in payload:
        return tuple(_from_alertmanager(payload)), None
    known = {LABEL, SLURM_JOB} if slurm else {LABEL}
    unknown = sorted(set(payload) - known)
    if unknown:
        expected = " or ".join(repr(k) for k in sorted(known))
        raise PayloadError(f"unknown field {unknown[0]!r}: expected {expected} (or an Alertmanager webhook)")
    if len(payload) > 1:
        raise PayloadError(f"name either {LABEL!r} or {SLURM_JOB!r}, not both")
    if SLURM_JOB in payload:
        return (), _slurm_id(payload[SLURM_JOB])
    return ((_job(payload[LABEL], LABEL),) if LABEL in payload else ()), None


def _from_alertmanager(payload: Mapping[str, object]) -> dict[str, SchedulerIds]:
    if str(payload.get("version")) != "4":
        raise PayloadError(f"Alertmanager webhook version {payload.get('version')!r}: only version 4 is read")
    alerts = payload.get("alerts")
    if not isinstance(alerts, list):
        raise PayloadError("alerts: expected a list")
    found: dict[str, None] = {}  # ordered, each once, in linear time
    ids: dict[str, set[SchedulerIds]] = {}  # each job's ids as its alerts give them
    sources: list[tuple[str, object]] = [("groupLabels", payload.get("groupLabels")),
                                         ("commonLabels", payload.get("commonLabels"))]
    sources += [(f"alerts[{n}].labels", a.get("labels") if isinstance(a, dict) else None) for n, a in enumerate(alerts)]
    for where, labels in sources:
        if labels is None:
            continue
        if not isinstance(labels, dict):
            raise PayloadError(f"{where}: expected an object of labels")
        if LABEL in labels:
            job = _job(labels[LABEL], f"{where}.{LABEL}")
            found[job] = None
            if where.startswith("alerts["):
                ids.setdefault(job, set()).add(_ids(labels, strict=False))
    if not found:
        raise PayloadError(f"the Alertmanager webhook names no {LABEL} label: route the job-level alerts "
                           f"with group_by: [{LABEL}]")
    return {job: _agreed(ids.get(job, set())) for job in found}


def _agreed(said: set[SchedulerIds]) -> SchedulerIds:
    """Each id every alert of a job gives the same value of; None where they differ or one leaves it out."""
    def one(name: str) -> str | None:
        values = {getattr(ids, name) for ids in said}
        return values.pop() if len(values) == 1 else None
    namespace, pod = one("namespace"), one("pod")
    return SchedulerIds(one(SLURM_JOB), namespace if pod else None, pod if namespace else None)
