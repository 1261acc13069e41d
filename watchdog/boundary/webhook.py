"""What a dump request names: `{"training_job": "..."}`, `{"slurm_job_id": "..."}` (a Slurm epilog), an
Alertmanager webhook (version 4), or nothing (every training job on the node).

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


def training_jobs(body: bytes) -> tuple[str, ...]:
    """The training jobs a request names, in order, each once; () for an empty body or `{}` (all jobs)."""
    return dump_target(body, slurm=False)[0]


def dump_target(body: bytes, slurm: bool = True) -> tuple[tuple[str, ...], str | None]:
    """(training jobs, Slurm job id) a request names; `slurm`: whether `{"slurm_job_id": "..."}` is read."""
    if not body.strip():
        return (), None
    try:
        payload = untrusted_data.loads_json(body, "the body", BODY_BUILT_BYTES)
    except untrusted_data.TooMuchData as exc:
        raise PayloadError(str(exc)) from None
    except (ValueError, RecursionError) as exc:
        raise PayloadError(f"the body is not JSON ({exc})") from None
    if not isinstance(payload, dict):
        raise PayloadError("expected a JSON object: {\"training_job\": \"...\"} or an Alertmanager webhook")
    if "alerts" in payload or "version" in payload:
        return _from_alertmanager(payload), None
    known = {LABEL, SLURM_JOB} if slurm else {LABEL}
    unknown = sorted(set(payload) - known)
    if unknown:
        expected = " or ".join(repr(k) for k in sorted(known))
        raise PayloadError(f"unknown field {unknown[0]!r}: expected {expected} (or an Alertmanager webhook)")
    if len(payload) > 1:
        raise PayloadError(f"name either {LABEL!r} or {SLURM_JOB!r}, not both")
    if SLURM_JOB in payload:
        job = payload[SLURM_JOB]
        if not isinstance(job, str) or not job.isdigit() or len(job) > 20:
            raise PayloadError(f"{SLURM_JOB}: expected a Slurm job id (digits, as a string)")
        return (), job
    return ((_job(payload[LABEL], LABEL),) if LABEL in payload else ()), None


def _from_alertmanager(payload: Mapping[str, object]) -> tuple[str, ...]:
    if str(payload.get("version")) != "4":
        raise PayloadError(f"Alertmanager webhook version {payload.get('version')!r}: only version 4 is read")
    alerts = payload.get("alerts")
    if not isinstance(alerts, list):
        raise PayloadError("alerts: expected a list")
    found: dict[str, None] = {}  # ordered, each once, in linear time
    sources: list[tuple[str, object]] = [("groupLabels", payload.get("groupLabels")),
                                         ("commonLabels", payload.get("commonLabels"))]
    sources += [(f"alerts[{n}].labels", a.get("labels") if isinstance(a, dict) else None) for n, a in enumerate(alerts)]
    for where, labels in sources:
        if labels is None:
            continue
        if not isinstance(labels, dict):
            raise PayloadError(f"{where}: expected an object of labels")
        if LABEL in labels:
            found[_job(labels[LABEL], f"{where}.{LABEL}")] = None
    if not found:
        raise PayloadError(f"the Alertmanager webhook names no {LABEL} label: route the job-level alerts "
                           f"with group_by: [{LABEL}]")
    return tuple(found)
