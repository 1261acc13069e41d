"""What happens when an episode fires, escalates or resolves, all off the sampling loop:

fired     find the affected job's ranks, capture and analyse their stacks, refine the severity with
          the stack verdict (an odd rank idle in a queue is a hang now, not in 15 minutes; a rank busy
          writing a checkpoint is a wait), write the incident bundle, send the alert
escalated send the alert again as critical, pointing at the same bundle
resolved  send the resolve

A bounded pool runs the work; when it is full an incident is still alerted, without stacks.
On shutdown, work not yet started is written as a partial bundle.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass

from watchdog import logfmt
from watchdog.act.alerts import Alert, AlertDispatcher
from watchdog.act.bundles import BundleStore, Incident
from watchdog.config import Config
from watchdog.counters import Counters
from watchdog.doctor.checks import examine, top_finding
from watchdog.doctor.facts import gather
from watchdog.model import EpisodeEvent, EventKind, NodeSnapshot, Severity
from watchdog.sample.nvml_inventory import Inventory
from watchdog.sample.ranks import RankDiscovery, group_jobs
from watchdog.stacks.capture import StackCapturer
from watchdog.stacks.picture import capture_job

_MAX_PENDING = 4


@dataclass
class _Open:
    bundle: str | None = None
    severity: Severity = Severity.WARNING
    job: str = "unknown"


class IncidentHandler:
    def __init__(self, config: Config, counters: Counters, dispatcher: AlertDispatcher, bundles: BundleStore,
                 capturer: StackCapturer, discovery: RankDiscovery,
                 inventory: Callable[[], Inventory] | None = None):
        self.config = config
        self.counters = counters
        self.dispatcher = dispatcher
        self.bundles = bundles
        self.capturer = capturer
        self.discovery = discovery
        self.inventory = inventory
        self.instance = config.alerts.instance or socket.gethostname()
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="incident")
        self.pending: set[Future[None]] = set()
        self.open: dict[str, _Open] = {}
        self.stopping = threading.Event()
        self._lock = threading.Lock()

    def _key(self, event: EpisodeEvent) -> str:
        return f"{event.signature.value}@{event.onset_seconds:.0f}"

    def handle(self, event: EpisodeEvent, snapshot: NodeSnapshot, telemetry: Sequence[NodeSnapshot]) -> None:
        """Called on the loop: only enqueues."""
        key = self._key(event)
        if event.event is EventKind.FIRED:
            with self._lock:
                self.open[key] = _Open(severity=event.severity)
                busy = len(self.pending) >= _MAX_PENDING
            if busy or self.stopping.is_set():
                self.counters.inc("bundles_total", "skipped")
                self._alert(event, key, event.severity, event.summary)
                return
            future = self.pool.submit(self._investigate, event, key, snapshot, tuple(telemetry))
            with self._lock:
                self.pending.add(future)
            future.add_done_callback(self._done)
            return
        with self._lock:
            state = self.open.get(key)
        if event.event is EventKind.ESCALATED:
            severity = Severity.CRITICAL
            if state is not None:
                state.severity = severity
            self._alert(event, key, severity, event.summary)
        else:
            self._alert(event, key, state.severity if state else event.severity, event.summary,
                        resolved=True)
            with self._lock:
                self.open.pop(key, None)

    def _done(self, future: Future[None]) -> None:
        with self._lock:
            self.pending.discard(future)
        error = future.exception()
        if error is not None:
            self.counters.inc("component_errors_total", "act")
            logfmt.event("incident_failed", level=logfmt.ERROR, error=f"{type(error).__name__}: {error}")

    def _investigate(self, event: EpisodeEvent, key: str, snapshot: NodeSnapshot,
                     telemetry: Sequence[NodeSnapshot]) -> None:
        window = self.config.bundles.telemetry_window_seconds
        incident = Incident(event, [s for s in telemetry if s.time_seconds >= event.onset_seconds - window])
        severity, sentence = event.severity, event.summary
        affected = set(event.gpus) | set(event.culprit_gpus)
        on_gpus = NodeSnapshot(snapshot.time_seconds, tuple(g for g in snapshot.gpus if g.index in affected))
        if self.stopping.is_set():
            incident.partial = True
            incident.notes.append("stopping: stacks not captured")
        elif self.config.bundles.capture_stacks:
            incident.ranks = self.discovery.from_snapshot(on_gpus)
            if not incident.ranks:
                incident.notes.append("no live process found on the affected GPUs; no stacks")
            s = self.config.stacks
            for job in group_jobs(incident.ranks):
                report = capture_job(job, self.capturer, self.discovery, s.observe_seconds, s.flight_recorder)
                incident.reports.append(report)
                for capture in report.captures:
                    self.counters.inc("stack_captures_total", capture.result)
            if incident.reports:
                verdict = incident.reports[0].verdict
                if verdict.severity is not None:  # hang: critical; waiting or remote: warning
                    severity = verdict.severity
                sentence = f"{event.summary}. Stacks: {verdict.sentence}"
        # The doctor costs milliseconds: it runs even while stopping.
        facts = gather(self.inventory, self.discovery.proc_root.parent / "sys", self.discovery.proc_root)
        incident.doctor = examine(facts, incident.ranks)
        top = top_finding(incident.doctor)
        if top is not None:
            sentence = f"{sentence}. Doctor: {top.evidence}" + (f"; {top.fix}" if top.fix else "")
        incident.sentence, incident.severity = sentence, severity
        path = self.bundles.write(incident)
        with self._lock:
            state = self.open.get(key)
            if state is not None:
                state.bundle = str(path) if path else None
                state.severity = severity
                state.job = incident.ranks[0].job_key if incident.ranks else "unknown"
        logfmt.event("incident", signature=event.signature.value, severity=severity.value,
                     bundle=str(path) if path else None, verdict=sentence)
        self._alert(event, key, severity, sentence)

    def _alert(self, event: EpisodeEvent, key: str, severity: Severity, summary: str, resolved: bool = False) -> None:
        state = self.open.get(key)
        self.dispatcher.submit(Alert(
            key=key, status="resolved" if resolved else "firing", signature=event.signature.value,
            severity=severity, gpus=event.gpus, culprit_gpus=event.culprit_gpus, summary=summary,
            onset=event.onset_seconds, at=event.at_seconds, instance=self.instance,
            job=state.job if state else "unknown", bundle=state.bundle if state else None))

    def close(self, timeout: float) -> None:
        """Finish in-flight incidents within `timeout`; those not started are written as partial."""
        self.stopping.set()
        self.pool.shutdown(wait=False, cancel_futures=False)
        with self._lock:
            pending = list(self.pending)
        futures_wait(pending, timeout=timeout)
