"""`stall-watchdog coordinate`: the HTTP service Alertmanager posts the job-level alerts to.

    POST /v1/alerts   an Alertmanager webhook (version 4) naming training jobs, or {"training_job": "..."}:
                      answered 202 at once; each job is investigated in the background
    GET  /v1/jobs     the latest job verdict per job (JSON)
    GET  /healthz     ok

Investigating a job: ask Prometheus which instances export its ranks, POST /v1/dump to all of them at
once, merge the answers into one job verdict, write the job bundle, log one line. A job investigated
less than `cooldown_seconds` ago (Alertmanager repeats its notifications) or still being investigated
is not investigated again. Stateless apart from the bundles: any node or a pod can run it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from watchdog import logfmt
from watchdog.export.server import HardenedServer, QuietHandler, read_body
from watchdog.webhook import PayloadError, training_jobs

from . import job_bundle
from .job_verdict import JobVerdict, merge
from .nodes import NodeClient, PrometheusError, instances_of

MAX_BODY_BYTES = 4 * 2**20


class Coordinator:
    def __init__(self, prometheus: str, out: str | Path, client: NodeClient, cooldown_seconds: float = 120.0,
                 monotonic: Callable[[], float] = time.monotonic):
        self.prometheus = prometheus
        self.out = Path(out)
        self.client = client
        self.cooldown_seconds = cooldown_seconds
        self.monotonic = monotonic
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="job")
        self.latest: dict[str, dict[str, object]] = {}
        self._started: dict[str, float] = {}
        self._running: set[str] = set()
        self._lock = threading.Lock()

    def investigate(self, job: str) -> JobVerdict:
        started = time.monotonic()
        problem = None
        try:
            instances = instances_of(self.prometheus, job)
        except PrometheusError as exc:
            instances, problem = [], str(exc)
        if not instances and problem is None:
            problem = f"Prometheus knows no instance exporting ranks of training job {job!r}"
        answers = self.client.ask_all(instances, job)
        result = merge(job, answers, instances, problem)
        result.seconds = time.monotonic() - started
        try:
            bundle: str | None = str(job_bundle.write(self.out, result))
        except OSError as exc:
            bundle = None
            logfmt.event("job_bundle_failed", level=logfmt.ERROR, job=job, error=exc.strerror or str(exc))
        odd = result.odd[0] if result.odd else None
        logfmt.event("job_verdict", level=logfmt.WARNING if result.verdict.severity else logfmt.INFO, job=job,
                     kind=result.verdict.kind, verdict=result.verdict.headline,
                     odd_rank=odd["member"] if odd else None, node=odd["node"] if odd else None,
                     nodes=len(instances), answered=sum(a.answered for a in answers), bundle=bundle,
                     seconds=round(result.seconds, 2), problem=problem)
        with self._lock:
            self.latest[job] = {**result.to_json(), "bundle": bundle}
        return result

    def accept(self, body: bytes) -> tuple[int, dict[str, object]]:
        try:
            jobs = training_jobs(body)
        except PayloadError as exc:
            return 400, {"error": str(exc)}
        if not jobs:
            return 400, {"error": "name a training job: {\"training_job\": \"...\"} or an Alertmanager webhook"}
        accepted, skipped = [], []
        now = self.monotonic()
        with self._lock:
            for job in jobs:
                last = self._started.get(job)
                if job in self._running or (last is not None and now - last < self.cooldown_seconds):
                    skipped.append(job)
                    continue
                self._started[job] = now
                self._running.add(job)
                accepted.append(job)
        for job in accepted:
            self.pool.submit(self._run, job)
        return 202, {"accepted": accepted, "skipped": skipped}

    def _run(self, job: str) -> None:
        try:
            self.investigate(job)
        except Exception as exc:  # one job's failure is a log line, never the service
            logfmt.event("job_failed", level=logfmt.ERROR, job=job, error=f"{type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._running.discard(job)

    def serve(self, host: str, port: int) -> HardenedServer:
        coordinator = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                if path == "/healthz":
                    self.reply_json(200, {"ok": True})
                elif path == "/v1/jobs":
                    with coordinator._lock:
                        self.reply_json(200, dict(coordinator.latest))
                else:
                    self.reply_json(404, {"error": "GET /v1/jobs, GET /healthz, POST /v1/alerts"})

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?", 1)[0] not in ("/v1/alerts", "/v1/job"):
                    self.reply_json(404, {"error": "POST /v1/alerts (an Alertmanager webhook)"})
                    return
                body = read_body(self, MAX_BODY_BYTES, "the coordinator's limit")
                if isinstance(body, tuple):
                    self.reply_json(body[0], {"error": body[1]})
                    return
                status, answer = coordinator.accept(body)
                self.reply_json(status, answer)

        return HardenedServer((host, port), Handler, None)
