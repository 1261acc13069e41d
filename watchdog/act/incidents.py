"""What happens around an episode, all off the sampling loop:

suspected  look at the affected job's stacks (py-spy, host activity) and hand the verdict back to the
           detectors, so the episode's severity is decided with it before anything is alerted; a look
           that shows a hang is followed by a second one stacks.confirm_seconds later, which confirms it
           (stacks/confirm.py) and makes the episode critical once it has lasted stacks.confirm_min_seconds
(open)     look again every stacks.recheck_seconds while the episode is not critical
fired      write the incident bundle (the stacks already captured, the doctor's findings, the telemetry)
           and alert with the episode's severity and sentence, as the detectors decided them; the incident
           keeps the doctor's top finding and what could not be gathered as fields, and every alert and
           bundle verdict is rendered from them by watchdog/vocabulary/telling.py
escalated  rewrite the bundle's verdict and alert again as critical
resolved   send the resolve
critical   act/responder.py takes it from here: the actions policy, the job's evidence taken again, the steps
           (it alerts again through alert(), with what was done)

The severity is never changed here: it is the episode's state, decided in detect/. A bounded pool runs
the work; when it is full an incident is still alerted, without stacks. On shutdown, work not yet started
is written as a partial bundle.
"""

from __future__ import annotations

import copy
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

from watchdog.act import membership
from watchdog.act.alerts import Alert, AlertDispatcher
from watchdog.act.bundles import BundleStore, Incident
from watchdog.act.kept_telemetry import kept_since
from watchdog.act.open_incident import OpenIncident, culprit_text, on_gpus, telling
from watchdog.config import Config
from watchdog.doctor.checks import examine, top_finding
from watchdog.doctor.facts import gather
from watchdog.plumbing import logfmt
from watchdog.plumbing.counters import Counters
from watchdog.sample.nvml_inventory import Inventory
from watchdog.sample.ranks import RankDiscovery, RankInfo
from watchdog.sample.workload import common
from watchdog.stacks.capture import StackCapturer
from watchdog.stacks.confirm import look_twice
from watchdog.stacks.picture import StackPicture, capture_job
from watchdog.vocabulary.alert_identity import PER_GPU_SIGNATURES, AlertIdentity, runbook_url
from watchdog.vocabulary.model import EpisodeEvent, EventKind, NodeSnapshot, Severity, Verdict

_MAX_PENDING = 4
# A job's end (its ranks killed) often resolves its episode before the scheduler's epilog asks for a last
# dump: the episodes resolved this recently are still asked.
_ENDED_KEPT_SECONDS = 900.0
_ENDED_KEPT = 64


def node_name(config: Config) -> str:
    """The `node` label on alerts: alerts.node, else the variable alerts.node_env names, else the host name
    (a missing variable is said once, then the host name is used)."""
    cfg = config.alerts
    if cfg.node:
        return cfg.node
    if cfg.node_env:
        found = os.environ.get(cfg.node_env, "").strip()
        if found:
            return found
        logfmt.event("node_env_unset", level=logfmt.WARNING, variable=cfg.node_env,
                     action="alerts carry this host's name as their node")
    return socket.gethostname()


class IncidentHandler:
    def __init__(self, config: Config, counters: Counters, dispatcher: AlertDispatcher, bundles: BundleStore,
                 capturer: StackCapturer, discovery: RankDiscovery,
                 inventory: Callable[[], Inventory] | None = None,
                 on_verdict: Callable[[str, Verdict], None] | None = None,
                 monotonic: Callable[[], float] = time.monotonic,
                 slurm_check: membership.SlurmCheck = membership.no_slurm):
        """`slurm_check`: Slurm's word on a job and its user (act/actions.py), which proves a Slurm job's ranks
        before their stacks are pictured."""
        self.config = config
        self.counters = counters
        self.dispatcher = dispatcher
        self.bundles = bundles
        self.capturer = capturer
        self.discovery = discovery
        self.inventory = inventory
        self.on_verdict = on_verdict
        self.monotonic = monotonic
        self.node = node_name(config)
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="incident")
        self.pending: set[Future[Any]] = set()
        self.open: dict[str, OpenIncident] = {}
        self.resolved: deque[tuple[float, OpenIncident]] = deque(maxlen=_ENDED_KEPT)  # (monotonic time, state)
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self.slurm_check = slurm_check

    # -- on the loop: only enqueue -----------------------------------------------------------------
    def handle(self, event: EpisodeEvent, snapshot: NodeSnapshot, telemetry: Iterable[NodeSnapshot]) -> None:
        key = event.key
        gpus = tuple(sorted(set(event.gpus) | set(event.culprit_gpus)))
        with self._lock:
            state = self.open.setdefault(key, OpenIncident(gpus))
        if event.event not in (EventKind.RESOLVED, EventKind.SUSPECTED):
            state.event = event
            if event.severity is Severity.CRITICAL and state.critical_since is None:
                state.critical_since = event.at_seconds
        if event.event is EventKind.SUSPECTED:
            self._look(key, state, snapshot)
        elif event.event is EventKind.FIRED:
            state.severity = event.severity
            if not self._submit(self._investigate, event, state, snapshot, copy.copy(telemetry)):
                self.counters.inc("bundles_total", "skipped")
                self.alert(event, state)
        elif event.event is EventKind.ESCALATED:
            state.severity = event.severity
            self.rewrite(state, event)
            self.alert(event, state)
        elif event.event is EventKind.RELAPSED:  # the same incident: its bundle says so, no new page
            state.stall_since = event.at_seconds  # an action counts this stall on its own clock
            self.rewrite(state, event)
            self._look(key, state, snapshot)
        else:
            self.alert(event, state, resolved=True)
            if state.bundle is not None:
                self._submit(self.bundles.record_end, state.bundle, event)
            with self._lock:
                gone = self.open.pop(key, None)
                if gone is not None:
                    self._retire(gone)

    def rewrite(self, state: OpenIncident, event: EpisodeEvent) -> None:
        """The bundle's verdict rewritten for this event, in the words the alert says: now, or once the bundle
        is written."""
        with self._lock:
            bundle = state.bundle
            if bundle is None:
                state.rewrite = event
            said = telling(state, event)
        if bundle is not None:
            self._submit(self.bundles.rewrite_verdict, bundle, event, said)

    def forget(self, open_keys: set[str]) -> None:
        """Move on what is held for episodes that ended without ever alerting (suspected only: a pause that
        passed, a spin seen early that went): nothing will resolve them. Like resolved ones, they are kept
        for a last look (Slurm's epilog) for _ENDED_KEPT_SECONDS, at most _ENDED_KEPT of them."""
        with self._lock:
            for key in [k for k, state in self.open.items() if k not in open_keys and state.severity is None]:
                self._retire(self.open.pop(key))

    def _retire(self, state: OpenIncident) -> None:
        """An ended incident, kept for a scheduler's last look (last_look) while it may still ask: at most
        _ENDED_KEPT of them, none older than _ENDED_KEPT_SECONDS. Under the lock."""
        now = self.monotonic()
        self.resolved.append((now, state))
        while now - self.resolved[0][0] > _ENDED_KEPT_SECONDS:
            self.resolved.popleft()

    def recheck(self, keys: Sequence[str], snapshot: NodeSnapshot) -> None:
        """Look again at the stacks of these open, not yet critical episodes when their last look is old."""
        now = self.monotonic()
        for key in keys:
            state = self.open.get(key)
            if state is None or state.looked_at is None or (state.look is not None and not state.look.done()):
                continue
            if now - state.looked_at >= self.config.stacks.recheck_seconds:
                self._look(key, state, snapshot)

    def last_look(self, slurm_job_id: str) -> list[tuple[StackPicture, tuple[RankInfo, ...]]]:
        """The stacks last captured of each training job that ran in this Slurm job, with its ranks, from the
        open episodes first, then the lately resolved ones, newest first (one picture per training job: two
        episodes on the same GPUs looked at the same ranks)."""
        now = self.monotonic()
        with self._lock:
            states = list(self.open.values()) + [state for at, state in reversed(self.resolved)
                                                 if now - at <= _ENDED_KEPT_SECONDS]
        found: dict[str, tuple[StackPicture, tuple[RankInfo, ...]]] = {}
        for state in states:
            ranks = [r for r in state.ranks if r.workload.slurm_job_id == slurm_job_id]
            for picture in state.pictures:
                members = tuple(r for r in ranks if r.job_key == picture.job)
                if members and picture.job not in found:
                    found[picture.job] = (picture, members)
        return list(found.values())

    def _submit(self, work: Callable[..., object], *args: object) -> bool:
        with self._lock:
            if len(self.pending) >= _MAX_PENDING or self.stopping.is_set():
                return False
            future = self.pool.submit(work, *args)
            self.pending.add(future)
        future.add_done_callback(self.work_done)
        return True

    def _look(self, key: str, state: OpenIncident, snapshot: NodeSnapshot) -> None:
        if not self.config.bundles.capture_stacks:
            return
        state.looked_at = self.monotonic()
        future: Future[None] = Future()
        state.look = future
        if not self._submit(self._capture, key, state, on_gpus(state, snapshot), future):
            future.set_result(None)

    def work_done(self, future: Future[Any]) -> None:
        with self._lock:
            self.pending.discard(future)
        error = future.exception()
        if error is not None:
            self.counters.inc("component_errors_total", "act")
            logfmt.event("incident_failed", level=logfmt.ERROR, error=f"{type(error).__name__}: {error}")

    # -- off the loop ------------------------------------------------------------------------------
    def _capture(self, key: str, state: OpenIncident, on_gpus: NodeSnapshot, done: Future[None]) -> None:
        try:
            self.discovery.settle_pods(g.uuid for g in on_gpus.gpus if g.pids and g.uuid)
            ranks = self.discovery.from_snapshot(on_gpus)
            s = self.config.stacks
            jobs = membership.pictured(ranks, self.slurm_check)
            # The first job's look is the episode's: a hang there is only a candidate until a second look
            # decides what is handed back (a confirmed hang, or what it saw instead: ranks that moved were not hung).
            pictures = [look_twice(job, self.capturer, self.discovery, s, self.node, wait=self.stopping.wait,
                                   seen=lambda picture: self.count([picture])) if n == 0 else
                        capture_job(job, self.capturer, self.discovery, s, self.node) for n, job in enumerate(jobs)]
            self.count(pictures[1:])
            state.ranks, state.pictures = ranks, pictures
            if ranks:
                state.job = ranks[0].job_key
                state.workload = common(r.workload for r in ranks)
            if pictures and self.on_verdict is not None and not self.stopping.is_set():
                self.on_verdict(key, pictures[0].verdict)
        finally:
            done.set_result(None)

    def count(self, pictures: Sequence[StackPicture]) -> None:
        for picture in pictures:
            for capture in picture.captures:
                self.counters.inc("stack_captures_total", capture.result)

    def _investigate(self, event: EpisodeEvent, state: OpenIncident, snapshot: NodeSnapshot,
                     telemetry: Iterable[NodeSnapshot]) -> None:
        window = self.config.bundles.telemetry_window_seconds
        incident = Incident(event, kept_since(telemetry, event.onset_seconds - window))
        if self.config.bundles.capture_stacks:
            if self.stopping.is_set():
                pass  # no new capture while stopping; what the looks already saw is kept below
            elif state.look is None:  # never suspected (a source that jumps straight to firing): look here
                state.looked_at = self.monotonic()
                state.look = Future()
                self._capture(event.key, state, on_gpus(state, snapshot), state.look)
            else:  # the look started when the episode was suspected, ahead of this in the pool's queue
                futures_wait([state.look], timeout=self.config.stacks.timeout_seconds + 10)
            complete = state.look is not None and state.look.done()
            incident.ranks, incident.pictures = list(state.ranks), list(state.pictures)
            if self.stopping.is_set() and not (complete and incident.pictures):
                incident.partial = True
                incident.notes.append("stopping: stack captures cut short" if incident.pictures
                                      else "stopping: stacks not captured")
            elif not incident.ranks:
                incident.notes.append("no live process found on the affected GPUs; no stacks")
        # The doctor costs milliseconds: it runs even while stopping.
        facts = gather(self.inventory, self.discovery.proc_root.parent / "sys", self.discovery.proc_root)
        incident.doctor = examine(facts, incident.ranks)
        top = top_finding(incident.doctor)
        with self._lock:
            state.doctor = (top.evidence + (f"; {top.fix}" if top.fix else "")) if top is not None else ""
            state.notes = tuple(incident.notes)
            incident.telling = telling(state, event)
        incident.severity = event.severity
        path = self.bundles.write(incident)
        with self._lock:
            state.bundle = str(path) if path else None
            later, state.rewrite = state.rewrite, None
            later_said = telling(state, later) if later is not None else None
        if later is not None and later_said is not None and state.bundle is not None:  # escalated or relapsed
            self.bundles.rewrite_verdict(state.bundle, later, later_said)               # while this was written
        logfmt.event("incident", signature=event.signature.value, severity=event.severity.value,
                     bundle=state.bundle, verdict=event.headline, summary=incident.telling.sentence())
        self.alert(event, state)

    def alert(self, event: EpisodeEvent, state: OpenIncident, resolved: bool = False, action: str = "") -> None:
        """Under the lock, so an episode's firing (sent from a worker once its bundle is written) and its
        resolve (from the loop) reach the receivers in the order they happened: an episode that ended before
        it alerted sends neither, one that alerted always sends its resolve."""
        with self._lock:
            if resolved:
                state.ended = True
                if state.identity is None:
                    return
            elif state.ended or (state.alerted is Severity.CRITICAL and event.severity is not Severity.CRITICAL):
                return  # ended, or a late first alert after its escalation went out
            else:
                state.alerted = event.severity
            if state.identity is None:
                gpu = event.gpus[0] if event.signature in PER_GPU_SIGNATURES and event.gpus else None
                state.identity = AlertIdentity(event.signature, self.node, state.job, state.workload, gpu)
            state.culprit = culprit_text(event.culprit_gpus, state.ranks)
            identity = state.identity
            self.dispatcher.submit(Alert(
                key=event.key, status="resolved" if resolved else "firing", identity=identity,
                severity=event.severity, gpus=event.gpus, culprit_gpus=event.culprit_gpus,
                summary=telling(state, event).sentence(), onset=event.onset_seconds, at=event.at_seconds,
                culprit=state.culprit, bundle=state.bundle,
                runbook_url=runbook_url(identity.signature, self.config.alerts.runbook_url), action=action))

    def open_states(self) -> list[tuple[str, OpenIncident]]:
        """The open incidents, by episode key, as they are now."""
        with self._lock:
            return list(self.open.items())

    def alerting(self) -> list[tuple[AlertIdentity, Severity, str]]:
        """Each open episode that has alerted: its identity, severity and culprit (the episode_alert_info series,
        from which the shipped rules make the same alert)."""
        with self._lock:
            return [(state.identity, state.severity, state.culprit) for state in self.open.values()
                    if state.identity is not None and state.severity is not None]

    def close(self, timeout: float) -> None:
        """Finish in-flight incidents within `timeout`; those not started are written as partial. Running
        stack captures are killed: a capture hung on a wedged rank must not outlast systemd's stop timeout."""
        self.stopping.set()
        self.capturer.abort()
        self.pool.shutdown(wait=False, cancel_futures=False)
        with self._lock:
            pending = list(self.pending)
        futures_wait(pending, timeout=timeout)
