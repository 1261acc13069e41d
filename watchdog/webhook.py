"""What a dump request names: `{"training_job": "..."}`, or an Alertmanager webhook (version 4), or
nothing (every training job on the node).

Alertmanager posts `{"version": "4", "groupLabels": {...}, "commonLabels": {...}, "alerts": [{"labels":
{...}}...]}`; the jobs are the `training_job` labels it carries (group, common and each alert's).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

LABEL = "training_job"
MAX_JOB_NAME = 512


class PayloadError(ValueError):
    """A request body that names no job in a form we read; the message says why (answered with 400)."""


def _job(value: object, where: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_JOB_NAME or any(ord(c) < 32 for c in value):
        raise PayloadError(f"{where}: expected a training job name (a non-empty string of at most "
                           f"{MAX_JOB_NAME} printable characters)")
    return value


def training_jobs(body: bytes) -> tuple[str, ...]:
    """The training jobs a request names, in order, each once; () for an empty body or `{}` (all jobs)."""
    if not body.strip():
        return ()
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise PayloadError(f"the body is not JSON ({exc})") from None
    if not isinstance(payload, dict):
        raise PayloadError("expected a JSON object: {\"training_job\": \"...\"} or an Alertmanager webhook")
    if "alerts" in payload or "version" in payload:
        return _from_alertmanager(payload)
    unknown = sorted(set(payload) - {LABEL})
    if unknown:
        raise PayloadError(f"unknown field {unknown[0]!r}: expected only {LABEL!r} (or an Alertmanager webhook)")
    return (_job(payload[LABEL], LABEL),) if LABEL in payload else ()


def _from_alertmanager(payload: Mapping[str, object]) -> tuple[str, ...]:
    if str(payload.get("version")) != "4":
        raise PayloadError(f"Alertmanager webhook version {payload.get('version')!r}: only version 4 is read")
    alerts = payload.get("alerts")
    if not isinstance(alerts, list):
        raise PayloadError("alerts: expected a list")
    found: list[str] = []
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
            if job not in found:
                found.append(job)
    if not found:
        raise PayloadError(f"the Alertmanager webhook names no {LABEL} label: route the job-level alerts "
                           f"with group_by: [{LABEL}]")
    return tuple(found)
