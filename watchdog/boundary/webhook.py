"""What a dump request names: `{"training_job": "..."}`, `{"slurm_job_id": "..."}` (a Slurm epilog), an
Alertmanager webhook (version 4), or nothing (every training job on the node); and what a request to the
coordinator names: training jobs, each with the Slurm job it runs as where that is known.

Alertmanager posts `{"version": "4", "groupLabels": {...}, "commonLabels": {...}, "alerts": [{"labels":
{...}}...]}`; the jobs are the `training_job` labels it carries (group, common and each alert's).
"""

from __future__ import annotations

from collections.abc import Mapping

from watchdog.boundary import untrusted_data

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


def job_requests(body: bytes) -> dict[str, str | None]:
    """What a request to the coordinator names: each training job (in order, each once) with the Slurm job it
    runs as where the request says so. `{"training_job": "...", "slurm_job_id": "..."}` (a node's own page:
    the id its daemon proved from slurmstepd's cgroup) or an Alertmanager webhook whose alerts carry both labels.
    A job named with two Slurm ids (or with and without one) has none: the scheduler is then not asked."""
    payload = _payload(body)
    if payload is None:
        return {}
    if "alerts" in payload or "version" in payload:
        return _from_alertmanager(payload)
    unknown = sorted(set(payload) - {LABEL, SLURM_JOB})
    if unknown:
        raise PayloadError(f"unknown field {unknown[0]!r}: expected {LABEL!r}, with {SLURM_JOB!r} where known (or "
                           "an Alertmanager webhook)")
    if LABEL not in payload:
        raise PayloadError(f"name the training job: {LABEL!r} (with {SLURM_JOB!r} where known)")
    return {_job(payload[LABEL], LABEL): _slurm_id(payload[SLURM_JOB]) if SLURM_JOB in payload else None}


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


def _slurm_id(value: object) -> str:
    if not isinstance(value, str) or not value.isdigit() or len(value) > 20:
        raise PayloadError(f"{SLURM_JOB}: expected a Slurm job id (digits, as a string)")
    return value


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


def _from_alertmanager(payload: Mapping[str, object]) -> dict[str, str | None]:
    if str(payload.get("version")) != "4":
        raise PayloadError(f"Alertmanager webhook version {payload.get('version')!r}: only version 4 is read")
    alerts = payload.get("alerts")
    if not isinstance(alerts, list):
        raise PayloadError("alerts: expected a list")
    found: dict[str, str | None] = {}  # ordered, each once, in linear time; a job's one Slurm id, or None
    ids: dict[str, set[str | None]] = {}
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
            said = labels.get(SLURM_JOB)
            slurm_id = said if isinstance(said, str) and said.isdigit() and len(said) <= 20 else None
            found.setdefault(job, slurm_id)
            if where.startswith("alerts["):
                ids.setdefault(job, set()).add(slurm_id)
    if not found:
        raise PayloadError(f"the Alertmanager webhook names no {LABEL} label: route the job-level alerts "
                           f"with group_by: [{LABEL}]")
    return {job: (next(iter(ids[job])) if len(ids.get(job, ())) == 1 else None) if job in ids else slurm_id
            for job, slurm_id in found.items()}
