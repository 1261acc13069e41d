"""`stall-watchdog coordinate`: the HTTP service Alertmanager posts the job-level alerts to.

    POST /v1/alerts   an Alertmanager webhook (version 4) naming training jobs, or {"training_job": "..."}
                      with "slurm_job_id", or "namespace" and "pod", where known (a node's own page: the
                      alerts receiver of type coordinator): answered 202 at once; each job is investigated
                      in the background
    GET  /v1/jobs     the latest job verdict per job (JSON)
    GET  /healthz     ok (the only path open without credentials)

Investigating a job: find its nodes, POST /v1/dump to all of them at once, merge the answers into one job
verdict, write the job bundle, log one line. A job's nodes are its scheduler's word where the request names its
Slurm job or a pod of it and the coordinator may ask that scheduler (`slurm_instance`, `kubernetes.api_url`;
scheduler.py: no wait for a scrape, and Prometheus may be down), else the instances Prometheus says export its
proven ranks (Prometheus is asked too where the scheduler cannot answer).
A job investigated less than `cooldown_seconds` ago (Alertmanager repeats its notifications) or still being
investigated is not investigated again. Stateless apart from the bundles: any node or a pod can run it.

The coordinator holds the node token, so it is a door to every node's stacks: holding it, or off loopback,
it does not start without credentials for its callers (a bearer token, basic auth, or both: every local
user reaches loopback), and with them every path but /healthz needs them. It asks only the instances of
the daemons' scrape job (and of the allow-list): the token goes to no other exporter. A request names at
most MAX_JOBS_PER_REQUEST jobs; at most `max_per_minute` investigations start a minute (a request that
starts none costs nothing of that budget); the latest verdicts kept are the newest MAX_JOBS_KEPT.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from watchdog.boundary.http_server import Auth, HardenedServer, QuietHandler, is_loopback, read_body
from watchdog.boundary.webhook import PayloadError, SchedulerIds, job_requests
from watchdog.config import DAEMON_SCRAPE_JOB
from watchdog.plumbing import logfmt

from . import job_bundle
from .job_verdict import JobEvidence, JobVerdict
from .nodes import NodeClient, Placement, PrometheusError, collector_paused, placement_of
from .scheduler import KubernetesNodes, SchedulerError, SlurmNodes

MAX_BODY_BYTES = 4 * 2**20
MAX_JOBS_PER_REQUEST = 16
MAX_JOBS_KEPT = 256
NO_IDS = SchedulerIds()  # a page that says nothing of the job's scheduler


class CoordinatorError(Exception):
    """The coordinator cannot serve as configured (the message says what to give)."""


class Coordinator:
    def __init__(self, prometheus: str | None, out: str | Path, client: NodeClient, cooldown_seconds: float = 120.0,
                 monotonic: Callable[[], float] = time.monotonic, auth: Auth | None = None,
                 max_per_minute: int = 30, scrape_job: str = DAEMON_SCRAPE_JOB, slurm: SlurmNodes | None = None,
                 kubernetes: KubernetesNodes | None = None):
        self.auth = auth or Auth()
        self.scrape_job = scrape_job
        self.max_per_minute = max_per_minute
        self._minute: list[float] = []
        self.prometheus = prometheus
        self.slurm = slurm
        self.kubernetes = kubernetes
        self.out = Path(out)
        self.client = client
        self.cooldown_seconds = cooldown_seconds
        self.monotonic = monotonic
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="job")
        self.latest: dict[str, dict[str, object]] = {}
        self._started: dict[str, float] = {}
        self._running: set[str] = set()
        self._futures: set[Future[None]] = set()  # investigations queued or under way
        self._lock = threading.Lock()

    def locate(self, job: str, ids: SchedulerIds = NO_IDS) -> tuple[Placement, str | None]:
        """Where the job runs, and what kept it from being known (None: found). Its scheduler first where it may
        be asked of this job (Slurm, Kubernetes); Prometheus where neither can say, or is not asked."""
        problems = []
        if ids.slurm_job_id is not None and self.slurm is not None:
            try:
                return self.slurm.placement(ids.slurm_job_id), None
            except SchedulerError as exc:
                problems.append(f"Slurm: {exc}")
        if ids.namespace is not None and ids.pod is not None and self.kubernetes is not None:
            try:
                return self.kubernetes.placement(ids.namespace, ids.pod), None
            except SchedulerError as exc:
                problems.append(str(exc))
        if self.prometheus is not None:
            try:
                placement = placement_of(self.prometheus, job, self.scrape_job)
            except PrometheusError as exc:
                problems.append(str(exc))
            else:
                if placement.instances:
                    return placement, None
                problems.append(f"Prometheus knows no instance of scrape job {self.scrape_job!r} exporting ranks "
                                f"of training job {job!r}")
        elif not problems:
            problems.append("no scheduler id came with it that the coordinator may ask (a Slurm job with "
                            "--slurm-instance, a pod with --kubernetes-api), and no Prometheus is given to ask")
        return Placement([], source="none"), "; ".join(problems)

    def investigate(self, job: str, ids: SchedulerIds = NO_IDS) -> JobVerdict:
        started = time.monotonic()
        placement, problem = self.locate(job, ids)
        instances = placement.instances
        evidence = JobEvidence(job)
        with collector_paused():
            answers = self.client.ask_all(instances, job, evidence.keep)
            result = evidence.verdict(answers, placement, problem)
        result.seconds = time.monotonic() - started
        try:
            bundle: str | None = str(job_bundle.write(self.out, result))
        except OSError as exc:
            bundle = None
            logfmt.event("job_bundle_failed", level=logfmt.ERROR, job=job, error=exc.strerror or str(exc))
        writing = time.monotonic() - started - result.seconds
        odd = result.odd[0] if result.odd else None
        logfmt.event("job_verdict", level=logfmt.WARNING if result.verdict.severity else logfmt.INFO, job=job,
                     kind=result.verdict.kind, verdict=result.verdict.headline,
                     odd_rank=odd["member"] if odd else None, node=odd["node"] if odd else None,
                     nodes=len(instances), answered=sum(a.answered for a in answers), placed_by=placement.source,
                     bundle=bundle,
                     seconds=round(result.seconds, 2), problem=problem)
        with self._lock:
            self.latest.pop(job, None)
            self.latest[job] = {**result.to_json(), "bundle": bundle, "bundle_seconds": round(writing, 3)}
            while len(self.latest) > MAX_JOBS_KEPT:
                self.latest.pop(next(iter(self.latest)))
        return result

    def accept(self, body: bytes) -> tuple[int, dict[str, object]]:
        try:
            jobs = job_requests(body)
        except PayloadError as exc:
            return 400, {"error": str(exc)}
        if not jobs:
            return 400, {"error": "name a training job: {\"training_job\": \"...\"} or an Alertmanager webhook"}
        if len(jobs) > MAX_JOBS_PER_REQUEST:
            return 400, {"error": f"the request names {len(jobs)} training jobs; at most {MAX_JOBS_PER_REQUEST} "
                                  "per request"}
        accepted, skipped, limited = [], [], []
        now = self.monotonic()
        with self._lock:
            self._started = {j: t for j, t in self._started.items() if now - t < self.cooldown_seconds}
            self._minute = [t for t in self._minute if now - t < 60]
            for job in jobs:
                last = self._started.get(job)
                if job in self._running or (last is not None and now - last < self.cooldown_seconds):
                    skipped.append(job)
                    continue
                if len(self._minute) >= self.max_per_minute:
                    limited.append(job)
                    continue
                self._minute.append(now)
                self._started[job] = now
                self._running.add(job)
                accepted.append(job)
        for job in accepted:
            future = self.pool.submit(self._run, job, jobs[job])
            self._futures.add(future)
            future.add_done_callback(self._futures.discard)
        if limited and not accepted:
            return 429, {"error": f"over {self.max_per_minute} investigations a minute", "rate_limited": limited,
                         "skipped": skipped}
        return 202, {"accepted": accepted, "skipped": skipped, **({"rate_limited": limited} if limited else {})}

    def _run(self, job: str, ids: SchedulerIds) -> None:
        try:
            self.investigate(job, ids)
        except Exception as exc:  # one job's failure is a log line, never the service
            logfmt.event("job_failed", level=logfmt.ERROR, job=job, error=f"{type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._running.discard(job)

    def stop(self) -> tuple[int, int]:
        """No more investigations: those queued are dropped, those under way finish (each within its own
        timeouts: the process waits for them as it exits). How many are under way, and how many were dropped."""
        dropped = sum(future.cancel() for future in list(self._futures))
        self.pool.shutdown(wait=False)
        return sum(not future.done() for future in list(self._futures)), dropped

    def serve(self, host: str, port: int) -> HardenedServer:
        if not self.auth.configured and (self.client.token or not is_loopback(host)):
            why = ("it holds the node token (--node-token-file), so any caller could have it dump any job, and "
                   "every local user reaches loopback" if self.client.token else f"it listens on {host}, off loopback")
            raise CoordinatorError(f"credentials for its callers are required: {why}. Give --token-file FILE "
                                   "(Alertmanager sends the same token: http_config.authorization.credentials_file) "
                                   "and/or --basic-auth-user with --basic-auth-password-file")
        coordinator = self

        class Handler(QuietHandler):
            def _refused(self) -> bool:
                if not coordinator.auth.configured or coordinator.auth.allows(self.headers.get("Authorization")):
                    return False
                self.reply_json(401, {"error": "credentials required"},
                                {"WWW-Authenticate": 'Bearer realm="stall-watchdog coordinate"'})
                return True

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                if path == "/healthz":
                    self.reply_json(200, {"ok": True})
                elif self._refused():
                    return
                elif path == "/v1/jobs":
                    with coordinator._lock:
                        self.reply_json(200, dict(coordinator.latest))
                else:
                    self.reply_json(404, {"error": "GET /v1/jobs, GET /healthz, POST /v1/alerts"})

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                if self._refused():
                    return
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
