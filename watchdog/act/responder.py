"""The responder: what is done about a hang once it is critical, off the sampling loop.

critical   once it has lasted actions.after_seconds: the actions policy (act/policy.py) decides; before
           anything is done the job's evidence is taken again (stacks, Flight Recorder, NCCL RAS) and
           written into the bundle with the decision and each step (act/actions.py); the alert says it

Each tick `consider` looks at the open incidents (act/incidents.py keeps them, with their bundles and alerts)
with what is already known, and hands at most one to its worker, which proves each job on the episode's GPUs
(act/membership.py), decides again on fresh evidence and the fleet's answer, and acts. Nodes it drained are
resumed once the node has been calm for actions.slurm.resume_after_seconds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from watchdog.act import fleet, membership, policy
from watchdog.act.actions import DONE, SKIPPED, Actions, Step, Target
from watchdog.act.actions import problems as action_problems
from watchdog.act.bundles import BundleStore
from watchdog.act.open_incident import OpenIncident, bundle_on_disk, on_gpus
from watchdog.config import Config
from watchdog.plumbing import logfmt
from watchdog.plumbing.counters import Counters
from watchdog.sample.ranks import RankDiscovery, job_of
from watchdog.stacks.capture import StackCapturer
from watchdog.stacks.picture import StackPicture, capture_job
from watchdog.vocabulary.model import EpisodeEvent, NodeSnapshot, Severity
from watchdog.vocabulary.words import duration_text

LEDGER_NAME = "actions-ledger.json"
_RECONSIDER_SECONDS = 30.0  # a decision that held an action back (paused, cooldown...) is looked at again


def ledger_path(config: Config) -> Path:
    """Where the actions ledger is kept: beside the incident bundles (it outlives a restart of the daemon)."""
    return Path(config.bundles.directory) / LEDGER_NAME


class Incidents(Protocol):
    """What the responder needs of the incident handler: the open incidents, their alerts and looks."""

    config: Config
    bundles: BundleStore
    capturer: StackCapturer
    discovery: RankDiscovery
    node: str
    stopping: threading.Event

    def open_states(self) -> list[tuple[str, OpenIncident]]: ...

    def alert(self, event: EpisodeEvent, state: OpenIncident, resolved: bool = False, action: str = "") -> None: ...

    def rewrite(self, state: OpenIncident, event: EpisodeEvent) -> None: ...

    def recheck(self, keys: Sequence[str], snapshot: NodeSnapshot) -> None: ...

    def count(self, pictures: Sequence[StackPicture]) -> None: ...

    def work_done(self, future: Future[Any]) -> None: ...


class Responder:
    def __init__(self, incidents: Incidents, counters: Counters, actions: Actions,
                 monotonic: Callable[[], float] = time.monotonic):
        self.incidents = incidents
        self.counters = counters
        self.actions = actions
        self.monotonic = monotonic
        self.ledger = policy.Ledger(ledger_path(incidents.config))
        if self.ledger.problem:
            logfmt.event("ledger_unreadable", level=logfmt.WARNING, problem=self.ledger.problem)
        self.acting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="action")
        self.state = "observe"  # for /metrics: observe, armed, unready, acting, held, paused
        # what makes a configured action fail every time (act/actions.py problems), for the config it reads now
        self.unready: list[str] = action_problems(incidents.config.actions)
        self._calm_since: float | None = None  # monotonic: no critical episode open since

    def reconfigure(self) -> None:
        """After a reload handed the incident side a new configuration: its actions' problems found again."""
        self.unready = action_problems(self.config.actions)

    def say_unready(self) -> None:
        """Log each configured action that would fail when due (at start, and after a reload)."""
        for problem in self.unready:
            logfmt.event("action_unready", level=logfmt.WARNING, problem=problem)

    @property
    def config(self) -> Config:
        """The configuration the incident side holds (a reload hands it there)."""
        return self.incidents.config

    def consider(self, snapshot: NodeSnapshot) -> None:
        """On the loop, each tick: the open critical episodes the policy may act on go to the action worker
        (one at a time). Cheap: the decision here uses what is already known; the worker decides again on
        fresh evidence and the fleet's answer."""
        cfg = self.config.actions
        self.actions.cfg = cfg
        if cfg.mode == "observe":
            self.state = "observe"
            return
        now = self.monotonic()
        states = self.incidents.open_states()
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
                self.incidents.recheck([key], snapshot)
            if cheap.name in ("wait", "observe", "unconfirmed"):
                continue
            state.acting, busy = True, True
            self.acting.submit(self._act, state, snapshot, now).add_done_callback(self.incidents.work_done)
        self._resume_when_calm(states, now)
        self.state = "acting" if busy else "paused" if paused or policy.paused(cfg) else \
            "held" if held else "unready" if self.unready else "armed"

    def _resume_when_calm(self, states: list[tuple[str, OpenIncident]], now: float) -> None:
        """Nodes this daemon drained are resumed once no critical episode has been open for
        actions.slurm.resume_after_seconds (0: never; a person resumes them)."""
        after = self.config.actions.slurm.resume_after_seconds
        if any(state.severity is Severity.CRITICAL for _, state in states) or self._calm_since is None:
            self._calm_since = now
            return
        if after and self.actions.drained and now - self._calm_since >= after:
            self._calm_since = now
            self.acting.submit(self._resume).add_done_callback(self.incidents.work_done)

    def _resume(self) -> None:
        for node in self.actions.resume_drained():
            logfmt.event("node_resumed", node=node, reason="no critical episode since it was drained")

    def _hang(self, state: OpenIncident, now: float, pictures: Sequence[StackPicture] | None = None) -> policy.Hang:
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

    def _stop_reason(self, state: OpenIncident) -> str | None:
        """Why an action under way must stop now: paused, reloaded out of act mode, the evidence gone."""
        cfg = self.config.actions
        if cfg.mode != "act":
            return f"actions.mode is now {cfg.mode}"
        why = policy.paused(cfg)
        if why is not None:
            return why
        if not bundle_on_disk(state):
            return "the incident bundle is no longer on disk"
        return None

    def _act(self, state: OpenIncident, snapshot: NodeSnapshot, submitted: float) -> None:
        """Off the loop: the processes on the episode's GPUs, each job among them proven (act/membership.py) and
        its evidence taken again (every rank's stacks, the Flight Recorder asked and read back, NCCL RAS); then
        one decision per job, the evidence on disk before any step, each action in order; all of it recorded in
        the bundle, counted, and said in the alert."""
        cfg = self.config.actions
        try:
            self._wait_for_bundle(state)
            event = state.event
            assert event is not None
            here = {pid for gpu in on_gpus(state, snapshot).gpus for pid in gpu.pids}
            capture = self.config.bundles.capture_stacks
            node_ranks = self.incidents.discovery.from_snapshot(snapshot) if capture else []
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
            conflicts = membership.conflicts(jobs)
            for job in jobs:
                decided = state.decisions.get(job.key)
                if decided is not None and decided.final:
                    continue
                results.append(self._act_on(state, job, here, now, replace(base, conflict=conflicts.get(job.key))))
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
                state.action = action_text(loud, now - base.onset)
                self.incidents.rewrite(state, event)
                self.incidents.alert(event, state, action=name)
        finally:
            state.decided_at = self.monotonic()
            state.acting = False

    def _act_on(self, state: OpenIncident, job: membership.ProvenJob, here: set[int], now: float,
                base: policy.Hang) -> tuple[str, policy.Decision, list[Step]]:
        """One proven job of the episode: its evidence, its decision, its steps."""
        cfg = self.config.actions
        desk = self.incidents
        picture = capture_job(job_of(job.key, job.ranks), desk.capturer, desk.discovery, self.config.stacks, desk.node)
        self.incidents.count([picture])
        hang = replace(base, job=job.durable, also=job.ledger_keys[1:], restarted=job.restarted(), now=now,
                       confirmed=policy.confirmed_by([picture]), kept=bundle_on_disk(state),
                       alive=policy.sign_of_life(picture))
        decision = policy.decide(cfg, hang, self.ledger)
        if decision.name in ("act", "dry_run") and cfg.fleet.prometheus_url:  # the fleet, asked last
            elsewhere, why = fleet.actions_elsewhere(cfg.fleet, *job.ledger_keys)
            share = fleet.acted_ratio(cfg.fleet) if elsewhere is not None else (None, why)
            decision = policy.decide(cfg, hang, self.ledger, share, elsewhere or ())
        if decision.name not in ("act", "dry_run"):
            return job.key, decision, []
        evidence = None
        if decision.name == "act":
            try:  # nothing is done without the evidence on disk
                evidence = self.incidents.bundles.keep_evidence(state.bundle or "", [picture])
            except OSError as exc:
                return job.key, policy.Decision("no_evidence", "the evidence could not be kept before acting "
                                                   f"({exc.strerror or exc}): nothing is done"), []
        event = state.event
        target = Target(job.name(), tuple(r for r in job.ranks if r.pid in here), job.workload,
                        event.to_json() if event else {}, state.bundle, self.incidents.node, job.pod_uid)
        steps = self.actions.run(target, dry=decision.name == "dry_run", stop=lambda: self._stop_reason(state))
        if evidence is not None:
            state.evidence[job.key] = evidence
        if any(st.result == DONE for st in steps):
            self.ledger.record(now, *job.ledger_keys)
        for step in steps:
            self.counters.inc("actions_total", step.action, step.result)
        return job.key, decision, steps

    def _record(self, state: OpenIncident, record: dict[str, object]) -> None:
        if state.bundle is None:
            return
        try:
            self.incidents.bundles.record_action(state.bundle, record)
        except (OSError, ValueError) as exc:
            logfmt.event("action_not_recorded", level=logfmt.ERROR, bundle=state.bundle,
                         error=f"{type(exc).__name__}: {exc}")

    def _wait_for_bundle(self, state: OpenIncident) -> None:
        """The incident bundle is written when the episode fires; an action waits for it (a bounded while)."""
        deadline = self.monotonic() + self.config.stacks.timeout_seconds + 30
        while state.bundle is None and self.monotonic() < deadline and not self.incidents.stopping.is_set():
            time.sleep(0.2)

    def close(self) -> None:
        """Actions not yet started are dropped; one under way stops at its next step (the handler is stopping)."""
        self.acting.shutdown(wait=False, cancel_futures=True)


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


def action_text(results: Sequence[tuple[str, policy.Decision, Sequence[Step]]], lasted: float) -> str:
    """What was done once the policy decided, one clause per job: 'ACTED: terminated ranks 0-3 of job run:x
    after 2 min 10 s of hang'. ACTED only where the job's ranks were ended; a step that failed makes it
    'NOT ACTED (failed: ...)' with the cause. The alert and the bundle say it before the episode's sentence
    (watchdog/vocabulary/telling.py), with where the evidence is."""
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
    return " / ".join(heads)
