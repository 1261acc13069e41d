"""Whether to act on a hang, and why not: the actions policy's one rule, used by the daemon before it
acts and by bench/accuracy.py to count what it would have done on a corpus.

The checks run in this order, and the first that holds is the decision:

    observe        mode observe: nothing is ever done (and nothing is said)
    wait           not critical yet, or critical for less than after_seconds
    unconfirmed    no live evidence (stacks blocked, host progress still) and on_telemetry_only is off
    no_evidence    the incident bundle is not on disk: nothing is done without the evidence kept
    deterministic  the job was acted on and hung again within deterministic_within_seconds: notify only
    budget         max_per_job actions on this job within budget_window_seconds
    cooldown       this node acted less than cooldown_seconds ago
    paused         actions.paused, or the pause file exists
    breaker        too many nodes of the fleet acted lately (or the fleet could not be asked)
    dry_run        mode dry_run: say what would be done
    act            do it

A decision is final for its episode when it is act, dry_run or deterministic; the others are looked at
again while the episode lasts (a pause lifted, a cooldown over, evidence that arrived).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from watchdog.config import ActionsConfig
from watchdog.model import Severity, duration_text
from watchdog.stacks.picture import StackPicture

FINAL = frozenset({"act", "dry_run", "deterministic"})
# Decisions said in an alert (the first time they are reached): what a person would want to know.
SAID = frozenset({"dry_run", "deterministic", "budget", "cooldown", "paused", "breaker", "no_evidence"})
_KEPT = 256  # actions remembered (per node: a handful a day at most)
_STILL_CPU_RATIO = 0.02  # a rank using less CPU than this over the observation makes no host progress
_STILL_IO_BYTES = 64 * 1024


@dataclass(frozen=True)
class Hang:
    """What the policy weighs about one open episode."""

    job: str
    severity: Severity
    onset: float  # wall seconds
    now: float
    critical_since: float | None  # wall seconds the episode turned critical; None while not critical
    confirmed: bool  # the live evidence shows the ranks blocked
    kept: bool = True  # the incident bundle (the evidence) is on disk


@dataclass(frozen=True)
class Decision:
    name: str  # one of the list above
    reason: str  # a clause a person reads: "paused by /run/stall-watchdog/actions.pause"

    @property
    def final(self) -> bool:
        return self.name in FINAL

    @property
    def said(self) -> bool:
        return self.name in SAID


class Ledger:
    """The actions this node took: (wall time, job). Bounded; thread-safe (the loop reads, a worker writes)."""

    def __init__(self) -> None:
        self._done: deque[tuple[float, str]] = deque(maxlen=_KEPT)
        self._lock = threading.Lock()

    def record(self, at: float, job: str) -> None:
        with self._lock:
            self._done.append((at, job))

    def on_job(self, job: str) -> list[float]:
        with self._lock:
            return [at for at, who in self._done if who == job]

    def last(self) -> float | None:
        with self._lock:
            return self._done[-1][0] if self._done else None


def confirmed_by(pictures: Sequence[StackPicture]) -> bool:
    """Whether the live evidence shows a job's ranks blocked: the stacks' verdict is a hang (every rank in a
    collective that does not return, or the others waiting on an odd rank that does not move), or the job
    spans nodes and its ranks here all wait in a collective; or every rank's host progress was still over the
    observation (no CPU, no I/O)."""
    for picture in pictures:
        if picture.verdict.kind in ("hang", "remote"):
            return True
        observed = max(picture.observed_seconds, 0.1)
        if picture.host and all(h.cpu_seconds <= _STILL_CPU_RATIO * observed
                                and (h.read_bytes or 0) + (h.write_bytes or 0) < _STILL_IO_BYTES
                                for h in picture.host.values()):
            return True
    return False


def paused(cfg: ActionsConfig) -> str | None:
    """Why actions are paused, or None."""
    if cfg.paused:
        return "paused by actions.paused"
    if cfg.pause_file and os.path.lexists(cfg.pause_file):
        return f"paused by {cfg.pause_file}"
    return None


def decide(cfg: ActionsConfig, hang: Hang, ledger: Ledger, fleet: tuple[float | None, str] = (0.0, "")) -> Decision:
    """The decision for `hang` now. `fleet` is (the share of the fleet's nodes that acted lately, or None when
    it could not be learnt; why) from fleet.py, asked only when everything else says act."""
    if cfg.mode == "observe":
        return Decision("observe", "actions.mode is observe")
    if hang.severity is not Severity.CRITICAL or hang.critical_since is None:
        return Decision("wait", "not critical")
    lasted = hang.now - hang.onset
    if lasted < cfg.after_seconds:
        return Decision("wait", f"critical for {lasted:.0f} s of {cfg.after_seconds:g} s")
    if not hang.confirmed and not cfg.on_telemetry_only:
        return Decision("unconfirmed", "no live evidence confirms the hang (actions.on_telemetry_only is off)")
    if not hang.kept:
        return Decision("no_evidence", "the incident bundle could not be written: nothing is done without the "
                        "evidence on disk")
    before = [at for at in ledger.on_job(hang.job) if at <= hang.onset]
    if before and hang.onset - max(before) < cfg.deterministic_within_seconds:
        return Decision("deterministic", f"the job hung again {duration_text(hang.onset - max(before))} after it "
                        "was restarted: a restart would hang again, so it is left to a person")
    recent = [at for at in ledger.on_job(hang.job) if hang.now - at < cfg.budget_window_seconds]
    if len(recent) >= cfg.max_per_job:
        return Decision("budget", f"{len(recent)} actions on this job within "
                        f"{duration_text(cfg.budget_window_seconds)} (actions.max_per_job)")
    last = ledger.last()
    if last is not None and hang.now - last < cfg.cooldown_seconds:
        return Decision("cooldown", f"this node acted {duration_text(hang.now - last)} ago "
                        f"(actions.cooldown_seconds {cfg.cooldown_seconds:g})")
    why = paused(cfg)
    if why is not None:
        return Decision("paused", why)
    share, problem = fleet
    if share is None:
        return Decision("breaker", f"the fleet's actions could not be learnt ({problem}): not acting blind")
    if share > cfg.fleet.max_ratio:
        return Decision("breaker", f"{share:.0%} of the fleet's nodes acted lately (actions.fleet.max_ratio "
                        f"{cfg.fleet.max_ratio:.0%})")
    if cfg.mode == "dry_run":
        return Decision("dry_run", "actions.mode is dry_run")
    return Decision("act", f"critical for {duration_text(lasted)}")
