"""What happens around an episode, all off the sampling loop:

suspected  look at the affected job's stacks (py-spy, host activity) and hand the verdict back to the
           detectors, so the episode's severity is decided with it before anything is alerted; a look
           that shows a hang is followed by a second one stacks.confirm_seconds later, which confirms it
           (stacks/confirm.py) and makes the episode critical once it has lasted stacks.confirm_min_seconds
(open)     look again every stacks.recheck_seconds while the episode is not critical
fired      write the incident bundle (the stacks already captured, the doctor's findings, the telemetry)
           and alert with the episode's severity and sentence, as the detectors decided them
escalated  rewrite the bundle's verdict and alert again as critical
resolved   send the resolve
critical   once it has lasted actions.after_seconds: the actions policy (act/policy.py) decides; before
           anything is done the job's evidence is taken again (stacks, Flight Recorder, NCCL RAS) and
           written into the bundle with the decision and each step (act/actions.py); the alert says it

The severity is never changed here: it is the episode's state, decided in detect/. A bounded pool runs
the work; when it is full an incident is still alerted, without stacks. On shutdown, work not yet started
is written as a partial bundle.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from watchdog import logfmt
from watchdog.act import fleet, membership, policy
from watchdog.act.actions import DONE, SKIPPED, Actions, Step, Target
from watchdog.act.alerts import Alert, AlertDispatcher
from watchdog.act.bundles import BundleStore, Incident
from watchdog.config import Config
from watchdog.counters import Counters
from watchdog.doctor.checks import examine, top_finding
from watchdog.doctor.facts import gather
from watchdog.model import (
    PER_GPU_SIGNATURES,
    AlertIdentity,
    EpisodeEvent,
    EventKind,
    NodeSnapshot,
    Severity,
    Verdict,
    Workload,
    duration_text,
    gpu_list,
    runbook_url,
)
from watchdog.sample.nvml_inventory import Inventory
from watchdog.sample.ranks import Job, RankDiscovery, RankInfo, job_of
from watchdog.sample.workload import common
from watchdog.stacks.capture import StackCapturer
from watchdog.stacks.confirm import BLOCKED, confirm
from watchdog.stacks.picture import StackPicture, capture_job

_MAX_PENDING = 4
# A job's end (its ranks killed) often resolves its episode before the scheduler's epilog asks for a last
# dump: the episodes resolved this recently are still asked.
_ENDED_KEPT_SECONDS = 900.0
_ENDED_KEPT = 64
LEDGER_NAME = "actions-ledger.json"
_RECONSIDER_SECONDS = 30.0  # a decision that held an action back (paused, cooldown...) is looked at again


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


def ledger_path(config: Config) -> Path:
    """Where the actions ledger is kept: beside the incident bundles (it outlives a restart of the daemon)."""
    return Path(config.bundles.directory) / LEDGER_NAME


@dataclass
class _Open:
    gpus: tuple[int, ...]
    severity: Severity | None = None  # None while only suspected
    bundle: str | None = None
    rewrite: EpisodeEvent | None = None  # an escalation or relapse that came before the bundle was written
    job: str = "unknown"
    workload: Workload = Workload()  # the pod or Slurm job the affected ranks share
    identity: AlertIdentity | None = None  # its alert's name and labels, fixed when it first fires
    culprit: str = ""  # "GPU 4 (rank 4, pid 812)", from the last event and the ranks seen
    alerted: Severity | None = None  # the severity last alerted
    ended: bool = False  # resolved: a firing alert still on its way is not sent
    looked_at: float | None = None  # monotonic time of the last look at the stacks
    look: Future[None] | None = None
    pictures: list[StackPicture] = field(default_factory=list)
    ranks: list[RankInfo] = field(default_factory=list)
    event: EpisodeEvent | None = None  # the last firing event (an action's alert repeats it, with what was done)
    summary: str = ""  # the sentence the episode alerted with
    critical_since: float | None = None  # wall seconds it turned critical
    decision: policy.Decision | None = None  # the actions policy's last decision, over all its jobs
    decisions: dict[str, policy.Decision] = field(default_factory=dict)  # per proven job (membership key; "": none)
    evidence: dict[str, str] = field(default_factory=dict)  # per proven job: its before-action folder
    decided_at: float | None = None  # monotonic
    acting: bool = False
    stall_since: float | None = None  # wall seconds a relapse began


class IncidentHandler:
    def __init__(self, config: Config, counters: Counters, dispatcher: AlertDispatcher, bundles: BundleStore,
                 capturer: StackCapturer, discovery: RankDiscovery,
                 inventory: Callable[[], Inventory] | None = None,
                 on_verdict: Callable[[str, Verdict], None] | None = None,
                 monotonic: Callable[[], float] = time.monotonic):
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
        self.open: dict[str, _Open] = {}
        self.resolved: deque[tuple[float, _Open]] = deque(maxlen=_ENDED_KEPT)  # (monotonic time, state)
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self.actions = Actions(config.actions)
        self.ledger = policy.Ledger(ledger_path(config))
        if self.ledger.problem:
            logfmt.event("ledger_unreadable", level=logfmt.WARNING, problem=self.ledger.problem)
        self.acting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="action")
        self.action_state = "observe"  # for /metrics: observe, armed, unready, acting, held, paused
        self.unready: list[str] = []  # what makes a configured action fail every time (act/actions.py problems)
        self._calm_since: float | None = None  # monotonic: no critical episode open since

    # -- on the loop: only enqueue -----------------------------------------------------------------
    def handle(self, event: EpisodeEvent, snapshot: NodeSnapshot, telemetry: Sequence[NodeSnapshot]) -> None:
        key = event.key
        gpus = tuple(sorted(set(event.gpus) | set(event.culprit_gpus)))
        with self._lock:
            state = self.open.setdefault(key, _Open(gpus))
        if event.event not in (EventKind.RESOLVED, EventKind.SUSPECTED):
            state.event = event
            if event.severity is Severity.CRITICAL and state.critical_since is None:
                state.critical_since = event.at_seconds
        if event.event is EventKind.SUSPECTED:
            self._look(key, state, snapshot)
        elif event.event is EventKind.FIRED:
            state.severity = event.severity
            if not self._submit(self._investigate, event, state, snapshot, tuple(telemetry)):
                self.counters.inc("bundles_total", "skipped")
                self._alert(event, state)
        elif event.event is EventKind.ESCALATED:
            state.severity = event.severity
            self._rewrite(state, event)
            self._alert(event, state)
        elif event.event is EventKind.RELAPSED:  # the same incident: its bundle says so, no new page
            state.stall_since = event.at_seconds  # an action counts this stall on its own clock
            self._rewrite(state, event)
            self._look(key, state, snapshot)
        else:
            self._alert(event, state, resolved=True)
            if state.bundle is not None:
                self._submit(self.bundles.record_end, state.bundle, event)
            with self._lock:
                gone = self.open.pop(key, None)
                if gone is not None:
                    self._retire(gone)

    def _rewrite(self, state: _Open, event: EpisodeEvent) -> None:
        """The bundle's verdict rewritten for this event: now, or once the bundle is written."""
        with self._lock:
            bundle = state.bundle
            if bundle is None:
                state.rewrite = event
        if bundle is not None:
            self._submit(self.bundles.rewrite_verdict, bundle, event)

    def forget(self, open_keys: set[str]) -> None:
        """Move on what is held for episodes that ended without ever alerting (suspected only: a pause that
        passed, a spin seen early that went): nothing will resolve them. Like resolved ones, they are kept
        for a last look (Slurm's epilog) for _ENDED_KEPT_SECONDS, at most _ENDED_KEPT of them."""
        with self._lock:
            for key in [k for k, state in self.open.items() if k not in open_keys and state.severity is None]:
                self._retire(self.open.pop(key))

    def _retire(self, state: _Open) -> None:
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
        future.add_done_callback(self._done)
        return True

    def _look(self, key: str, state: _Open, snapshot: NodeSnapshot) -> None:
        if not self.config.bundles.capture_stacks:
            return
        state.looked_at = self.monotonic()
        future: Future[None] = Future()
        state.look = future
        if not self._submit(self._capture, key, state, self._on_gpus(state, snapshot), future):
            future.set_result(None)

    @staticmethod
    def _on_gpus(state: _Open, snapshot: NodeSnapshot) -> NodeSnapshot:
        return NodeSnapshot(snapshot.time_seconds, tuple(g for g in snapshot.gpus if g.index in state.gpus))

    def _done(self, future: Future[Any]) -> None:
        with self._lock:
            self.pending.discard(future)
        error = future.exception()
        if error is not None:
            self.counters.inc("component_errors_total", "act")
            logfmt.event("incident_failed", level=logfmt.ERROR, error=f"{type(error).__name__}: {error}")

    # -- off the loop ------------------------------------------------------------------------------
    def _capture(self, key: str, state: _Open, on_gpus: NodeSnapshot, done: Future[None]) -> None:
        try:
            read_at = time.monotonic()  # the ranks' host activity is read now: a second look counts from here
            ranks = self.discovery.from_snapshot(on_gpus)
            s = self.config.stacks
            jobs = membership.pictured(ranks, self.actions.slurm_job_runs_as)
            pictures = [capture_job(job, self.capturer, self.discovery, s, self.node) for job in jobs]
            self._count(pictures)
            state.ranks, state.pictures = ranks, pictures
            if ranks:
                state.job = ranks[0].job_key
                state.workload = common(r.workload for r in ranks)
            if pictures and pictures[0].verdict.kind in BLOCKED and s.confirm_seconds > 0:
                # A first look's hang is only a candidate: the second look decides what is handed back (a
                # confirmed hang, or what it saw instead: a rank that moved meanwhile was not hung).
                if self.stopping.wait(s.confirm_seconds):
                    return
                pictures = [self._look_again(jobs[0], pictures[0], read_at), *pictures[1:]]
                state.pictures = pictures
            if pictures and self.on_verdict is not None:
                self.on_verdict(key, pictures[0].verdict)
        finally:
            done.set_result(None)

    def _look_again(self, job: Job, first: StackPicture, read_at: float) -> StackPicture:
        """The second look at a hang (stacks/confirm.py): the stacks only, the host activity counted since
        the first look read it. The first look's picture with the confirmed verdict, or with the second
        look's own verdict when it does not confirm."""
        again = self.config.stacks.model_copy(update={"observe_seconds": 0.0, "flight_recorder": False,
                                                      "nccl_ras": False})
        second = capture_job(job, self.capturer, self.discovery, again, self.node, read_at=read_at)
        self._count([second])
        verdict = confirm(first, second, time.monotonic() - read_at)
        return replace(first, verdict=verdict if verdict is not None else second.verdict)

    def _count(self, pictures: Sequence[StackPicture]) -> None:
        for picture in pictures:
            for capture in picture.captures:
                self.counters.inc("stack_captures_total", capture.result)

    def _investigate(self, event: EpisodeEvent, state: _Open, snapshot: NodeSnapshot,
                     telemetry: Sequence[NodeSnapshot]) -> None:
        window = self.config.bundles.telemetry_window_seconds
        incident = Incident(event, [s for s in telemetry if s.time_seconds >= event.onset_seconds - window])
        if self.config.bundles.capture_stacks:
            if self.stopping.is_set():
                pass  # no new capture while stopping; what the looks already saw is kept below
            elif state.look is None:  # never suspected (a source that jumps straight to firing): look here
                state.looked_at = self.monotonic()
                state.look = Future()
                self._capture(event.key, state, self._on_gpus(state, snapshot), state.look)
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
        incident.sentence = event.summary + (f". Doctor: {top.evidence}" + (f"; {top.fix}" if top.fix else "")
                                             if top is not None else "")
        incident.severity = event.severity
        path = self.bundles.write(incident)
        with self._lock:
            state.bundle = str(path) if path else None
            later, state.rewrite = state.rewrite, None
        if later is not None and state.bundle is not None:  # escalated or relapsed while this was written
            self.bundles.rewrite_verdict(state.bundle, later)
        logfmt.event("incident", signature=event.signature.value, severity=event.severity.value,
                     bundle=state.bundle, verdict=event.headline)
        self._alert(event, state, summary=incident.sentence)

    def _alert(self, event: EpisodeEvent, state: _Open, resolved: bool = False, summary: str | None = None,
               action: str = "") -> None:
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
            if not resolved and summary is not None and not action:
                state.summary = summary
            identity = state.identity
            self.dispatcher.submit(Alert(
                key=event.key, status="resolved" if resolved else "firing", identity=identity,
                severity=event.severity, gpus=event.gpus, culprit_gpus=event.culprit_gpus,
                summary=summary or event.summary, onset=event.onset_seconds, at=event.at_seconds,
                culprit=state.culprit, bundle=state.bundle,
                runbook_url=runbook_url(identity.signature, self.config.alerts.runbook_url), action=action))

    # -- the actions policy ------------------------------------------------------------------------
    def consider(self, snapshot: NodeSnapshot) -> None:
        """On the loop, each tick: the open critical episodes the policy may act on go to the action worker
        (one at a time). Cheap: the decision here uses what is already known; the worker decides again on
        fresh evidence and the fleet's answer."""
        cfg = self.config.actions
        self.actions.cfg = cfg
        if cfg.mode == "observe":
            self.action_state = "observe"
            return
        now = self.monotonic()
        with self._lock:
            states = list(self.open.items())
        busy = any(state.acting for _, state in states)
        held = paused = False
        for key, state in states:
            decision = state.decision
            held |= decision is not None and decision.said and decision.name != "dry_run"
            paused |= decision is not None and decision.name == "paused"
            if (busy or state.acting or state.event is None or (decision is not None and decision.final)
                    or (state.decided_at is not None and now - state.decided_at < _RECONSIDER_SECONDS)):
                continue
            cheap = policy.decide(cfg, self._hang(state, snapshot.time_seconds), self.ledger)
            if cheap.name == "unconfirmed":  # the stacks may confirm it yet: look again now and then
                self.recheck([key], snapshot)
            if cheap.name in ("wait", "observe", "unconfirmed"):
                continue
            state.acting, busy = True, True
            self.acting.submit(self._act, state, snapshot, now).add_done_callback(self._done)
        self._resume_when_calm(states, now)
        self.action_state = "acting" if busy else "paused" if paused or policy.paused(cfg) else \
            "held" if held else "unready" if self.unready else "armed"

    def _resume_when_calm(self, states: list[tuple[str, _Open]], now: float) -> None:
        """Nodes this daemon drained are resumed once no critical episode has been open for
        actions.slurm.resume_after_seconds (0: never; a person resumes them)."""
        after = self.config.actions.slurm.resume_after_seconds
        if any(state.severity is Severity.CRITICAL for _, state in states) or self._calm_since is None:
            self._calm_since = now
            return
        if after and self.actions.drained and now - self._calm_since >= after:
            self._calm_since = now
            self.acting.submit(self._resume).add_done_callback(self._done)

    def _resume(self) -> None:
        for node in self.actions.resume_drained():
            logfmt.event("node_resumed", node=node, reason="no critical episode since it was drained")

    def _hang(self, state: _Open, now: float, pictures: Sequence[StackPicture] | None = None) -> policy.Hang:
        """What the policy weighs about the episode as a whole (the cheap look on the loop)."""
        event = state.event
        assert event is not None
        onset = max(event.onset_seconds, state.stall_since or 0.0)
        critical = state.critical_since
        if critical is not None:
            critical = max(critical, onset)
        return policy.Hang(state.job, state.severity or event.severity, onset, now, critical,
                           policy.confirmed_by(state.pictures if pictures is None else pictures),
                           kept=pictures is None or state.bundle is not None)

    def _stop_reason(self, state: _Open) -> str | None:
        """Why an action under way must stop now: paused, reloaded out of act mode, the evidence gone."""
        cfg = self.config.actions
        if cfg.mode != "act":
            return f"actions.mode is now {cfg.mode}"
        why = policy.paused(cfg)
        if why is not None:
            return why
        if not _bundle_on_disk(state):
            return "the incident bundle is no longer on disk"
        return None

    def _act(self, state: _Open, snapshot: NodeSnapshot, submitted: float) -> None:
        """Off the loop: the processes on the episode's GPUs, each job among them proven (act/membership.py) and
        its evidence taken again (every rank's stacks, the Flight Recorder asked and read back, NCCL RAS); then
        one decision per job, the evidence on disk before any step, each action in order; all of it recorded in
        the bundle, counted, and said in the alert."""
        cfg = self.config.actions
        try:
            self._wait_for_bundle(state)
            event = state.event
            assert event is not None
            on_gpus = self._on_gpus(state, snapshot)
            here = {pid for gpu in on_gpus.gpus for pid in gpu.pids}
            node_ranks = self.discovery.from_snapshot(snapshot) if self.config.bundles.capture_stacks else []
            base = self._hang(state, snapshot.time_seconds)
            proven, left = membership.prove(node_ranks, base.onset, self.actions.slurm_job_runs_as)
            jobs = [job for job in proven if any(r.pid in here for r in job.ranks)]
            left = [alone for alone in left if alone.rank.pid in here]
            now = snapshot.time_seconds + (self.monotonic() - submitted)
            results: list[tuple[str, policy.Decision, list[Step]]] = []  # (proven job's key, decision, steps)
            names = {job.key: job.name() for job in jobs}
            if not jobs:
                unproven = "; ".join(alone.text() for alone in left[:8]) or "no live process seen on them"
                hang = replace(self._hang(state, now), target=None, unproven=unproven)
                results.append(("", policy.decide(cfg, hang, self.ledger), []))
            for job in jobs:
                decided = state.decisions.get(job.key)
                if decided is not None and decided.final:
                    continue
                results.append(self._act_on(state, job, here, now, base))
            if jobs:
                state.decisions.pop("", None)  # a proven job came: "no target" is no longer the episode's word
            changed = []
            for key, decision, steps in results:
                before = state.decisions.get(key)
                state.decisions[key] = decision
                if steps or before is None or before.name != decision.name:
                    changed.append((key, decision, steps))
            state.decision = _overall(list(state.decisions.values()))
            # Recorded, logged and alerted when it changes: the same decision for another clause (a sign of life
            # of other bytes, a cooldown a minute older) adds nothing new, and an episode held for a week is
            # reconsidered every 30 s.
            said = [(key, d, steps) for key, d, steps in changed if d.name not in ("wait", "unconfirmed")]
            for key, decision, steps in said:
                record: dict[str, object] = {
                    "job": names.get(key), "evidence": state.evidence.get(key), "decision": decision.name,
                    "reason": decision.reason, "at": now, "hang_seconds": round(now - base.onset, 1),
                    "acted": decision.name == "act" and acted(steps), "steps": [st.to_json() for st in steps],
                    "left_alone": [alone.text() for alone in left]}
                self._record(state, record)
                logfmt.event("action", level=logfmt.WARNING, decision=decision.name, reason=decision.reason,
                             job=names.get(key, state.job),
                             steps="; ".join(f"{st.action}={st.result}" for st in steps) or None, bundle=state.bundle)
            loud = [(key, d, steps) for key, d, steps in said if d.said or d.name == "act"]
            if loud:
                name = _overall([d for _, d, _ in loud]).name
                if name == "act" and not all(acted(steps) for _, d, steps in loud if d.name == "act"):
                    name = "act_failed"
                self._alert(event, state, summary=action_text(loud, now - base.onset, state.bundle, state.summary),
                            action=name)
        finally:
            state.decided_at = self.monotonic()
            state.acting = False

    def _act_on(self, state: _Open, job: membership.ProvenJob, here: set[int], now: float,
                base: policy.Hang) -> tuple[str, policy.Decision, list[Step]]:
        """One proven job of the episode: its evidence, its decision, its steps."""
        cfg = self.config.actions
        picture = capture_job(job_of(job.key, job.ranks), self.capturer, self.discovery, self.config.stacks,
                              self.node)
        self._count([picture])
        hang = replace(base, job=job.durable, now=now, confirmed=policy.confirmed_by([picture]),
                       kept=_bundle_on_disk(state),
                       alive=policy.sign_of_life(picture))
        decision = policy.decide(cfg, hang, self.ledger)
        if decision.name in ("act", "dry_run") and cfg.fleet.prometheus_url:  # the fleet, asked last
            elsewhere, why = fleet.actions_elsewhere(cfg.fleet, job.durable)
            share = fleet.acted_ratio(cfg.fleet) if elsewhere is not None else (None, why)
            decision = policy.decide(cfg, hang, self.ledger, share, elsewhere or ())
        if decision.name not in ("act", "dry_run"):
            return job.key, decision, []
        evidence = None
        if decision.name == "act":
            try:  # nothing is done without the evidence on disk
                evidence = self.bundles.keep_evidence(state.bundle or "", [picture])
            except OSError as exc:
                return job.key, policy.Decision("no_evidence", "the evidence could not be kept before acting "
                                                   f"({exc.strerror or exc}): nothing is done"), []
        event = state.event
        target = Target(job.name(), tuple(r for r in job.ranks if r.pid in here), job.workload,
                        event.to_json() if event else {}, state.bundle, self.node, job.pod_uid)
        steps = self.actions.run(target, dry=decision.name == "dry_run", stop=lambda: self._stop_reason(state))
        if evidence is not None:
            state.evidence[job.key] = evidence
        if any(st.result == DONE for st in steps):
            self.ledger.record(now, job.durable)
        for step in steps:
            self.counters.inc("actions_total", step.action, step.result)
        return job.key, decision, steps

    def _record(self, state: _Open, record: dict[str, object]) -> None:
        if state.bundle is None:
            return
        try:
            self.bundles.record_action(state.bundle, record)
        except (OSError, ValueError) as exc:
            logfmt.event("action_not_recorded", level=logfmt.ERROR, bundle=state.bundle,
                         error=f"{type(exc).__name__}: {exc}")

    def _wait_for_bundle(self, state: _Open) -> None:
        """The incident bundle is written when the episode fires; an action waits for it (a bounded while)."""
        deadline = self.monotonic() + self.config.stacks.timeout_seconds + 30
        while state.bundle is None and self.monotonic() < deadline and not self.stopping.is_set():
            time.sleep(0.2)

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
        self.acting.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            pending = list(self.pending)
        futures_wait(pending, timeout=timeout)


def culprit_text(gpus: Sequence[int], ranks: Sequence[RankInfo]) -> str:
    """'GPU 4 (rank 4, pid 812)', 'GPUs 3, 5 (ranks 3, 5)': the GPUs the others wait on, with the ranks on them
    where they were seen; '' when no GPU is named."""
    if not gpus:
        return ""
    on = [r for r in ranks if set(r.gpus) & set(gpus)]
    if len(on) == 1 and len(gpus) == 1:
        rank = on[0].rank
        return f"GPU {gpus[0]} ({'rank ' + str(rank) + ', ' if rank is not None else ''}pid {on[0].pid})"
    named = sorted({r.rank for r in on if r.rank is not None})
    who = f" ({'rank' if len(named) == 1 else 'ranks'} {', '.join(map(str, named))})" if named else ""
    return gpu_list(tuple(gpus)) + who



def _bundle_on_disk(state: _Open) -> bool:
    """Whether the episode's incident bundle is there now (written, and not rotated away)."""
    return state.bundle is not None and os.path.isdir(state.bundle)


def _overall(decisions: Sequence[policy.Decision]) -> policy.Decision:
    """One decision for an episode's jobs: one still open to change if any is (so it is looked at again),
    else the one that did most (act, then dry_run, then the rest)."""
    if not decisions:
        return policy.Decision("wait", "no decision yet")
    open_ = [d for d in decisions if not d.final]
    if open_:
        return open_[0]
    order = {"act": 0, "dry_run": 1}
    return min(decisions, key=lambda d: order.get(d.name, 2))


def acted(steps: Sequence[Step]) -> bool:
    """Whether the steps ended the job: one that ends it done (a drain or a taint alone does not), none failed,
    timed out or stopped."""
    return any(st.ended for st in steps) and all(st.result in (DONE, SKIPPED) for st in steps)


def action_text(results: Sequence[tuple[str, policy.Decision, Sequence[Step]]], lasted: float, bundle: str | None,
                summary: str) -> str:
    """The alert's summary once the policy decided, one clause per job: 'ACTED: terminated ranks 0-3 of job
    run:x after 2 min 10 s of hang; evidence: <bundle>. <the episode's sentence>'. ACTED only where the job's
    ranks were ended; a step that failed makes it 'NOT ACTED (failed: ...)' with the cause."""
    evidence = f"; evidence: {bundle}" if bundle else ""
    after = f"after {duration_text(lasted)} of hang"
    heads = []
    for _, decision, steps in results:
        done = [st.detail for st in steps if st.result == DONE]
        if decision.name == "act" and acted(steps):
            heads.append("ACTED: " + "; ".join(done) + f" {after}")
        elif decision.name == "act":
            failed = [f"{st.action} {st.result}: {st.detail}" for st in steps if st.result not in (DONE, SKIPPED)]
            skipped = [f"{st.action} skipped: {st.detail}" for st in steps if st.result == SKIPPED]
            heads.append("NOT ACTED (failed: " + "; ".join(failed or skipped or ["nothing to do"]) + ")"
                         + (f", though {'; '.join(done)}" if done else "") + f" {after}")
        elif decision.name == "dry_run":
            heads.append("DRY RUN: " + "; ".join(st.detail for st in steps) + f" {after}")
        else:
            heads.append(f"NOT ACTED ({decision.name}): {decision.reason}")
    return f"{' / '.join(heads)}{evidence}. {summary}".rstrip(". ") + "."
