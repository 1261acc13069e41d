"""Whether to act on a hang, and why not: the actions policy's one rule, used by the daemon before it
acts and by bench/accuracy.py to count what it would have done on a corpus.

The checks run in this order, and the first that holds is the decision:

    observe        mode observe: nothing is ever done (and nothing is said)
    wait           not critical yet, or critical for less than after_seconds
    no_target      no process on the episode's GPUs is proven a rank of a job (act/membership.py)
    conflict       another proven job on the episode's GPUs claims the same job name: the names cannot say
                   which is which, so neither is acted on (a claim may hold an action back, never cause one)
    alive          a rank of the job shows a sign of life (its host I/O moves, its stacks are not blocked)
    unconfirmed    no live evidence (stacks blocked, host progress still) and on_telemetry_only is off
    no_evidence    the incident bundle is not on disk: nothing is done without the evidence kept
    deterministic  the job hung again within deterministic_within_seconds of an action on it (this node's,
                   or another's through the fleet), or of its launcher restarting its ranks: notify only
    budget         max_per_job actions on this job within budget_window_seconds
    cooldown       this job was acted on less than cooldown_seconds ago
    paused         actions.paused, or the pause file exists
    breaker        too many nodes of the fleet acted lately (or the fleet could not be asked)
    dry_run        mode dry_run: say what would be done
    act            do it

A decision is made for each proven job of an episode (one episode over two jobs is two decisions) and is
final for it when it is act, dry_run or deterministic; the others are looked at again while the episode
lasts (a pause lifted, a cooldown over, evidence that arrived). The ledger of actions is keyed on what
survives a job's restart and relaunch (its Slurm job, its pod, its user and program without arguments:
ProvenJob.ledger_keys; an action under any key holds the others) and kept on disk, so a daemon's restart
forgets nothing. Another node's actions reach the ledger through the fleet (fleet.py) where
actions.fleet.prometheus_url is set; without it, a job whose launcher restarted its ranks (torchrun's
TORCHELASTIC_RESTART_COUNT, Slurm's SLURM_RESTART_COUNT) is still known as restarted on every node.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from watchdog.boundary import private_files, rank_files
from watchdog.config import ActionsConfig
from watchdog.stacks.picture import StackPicture
from watchdog.vocabulary.model import Severity
from watchdog.vocabulary.words import duration_text

FINAL = frozenset({"act", "dry_run", "deterministic"})
# Decisions said in an alert (the first time they are reached): what a person would want to know.
SAID = frozenset({"dry_run", "deterministic", "budget", "cooldown", "paused", "breaker", "no_evidence",
                  "no_target", "conflict"})
_KEPT = 256  # actions remembered (per node: a handful a day at most)
_LEDGER_MAX_BYTES = 256 * 1024
_LEDGER_FUTURE_SECONDS = 86400.0
_STILL_CPU_RATIO = 0.02  # a rank using less CPU than this over the observation makes no host progress
_STILL_IO_BYTES = 64 * 1024
_LIVE_IO_BYTES_PER_SECOND = 64 * 1024  # a rank moving more than this is doing something (a checkpoint: MB/s)


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
    alive: str | None = None  # a sign of life of any rank of the job, said as a clause
    target: str | None = ""  # None: no proven job on the GPUs, and why in `unproven`
    unproven: str = ""
    also: tuple[str, ...] = ()  # the job's other ledger keys (ProvenJob.ledger_keys)
    restarted: tuple[int, float] | None = None  # (restarts, wall seconds the ranks started): its launcher's word
    conflict: str | None = None  # another proven job claims this one's name, said as a clause

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.job, *self.also)


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
    """The actions this node took: (wall time, durable job key). Bounded; thread-safe (the loop reads, a worker
    writes). With a `path`, kept on disk (one private file, replaced whole at each action) and read back at
    start: a daemon that restarts still knows what it did."""

    def __init__(self, path: str | Path | None = None) -> None:
        self._done: deque[tuple[float, str]] = deque(maxlen=_KEPT)
        self._lock = threading.Lock()
        self.path = Path(path) if path is not None else None
        self.problem: str | None = None  # why the file could not be read or written, said once
        if self.path is not None:
            self._load(self.path)

    def _load(self, path: Path) -> None:
        try:
            raw = rank_files.read_given(path, _LEDGER_MAX_BYTES, timeout_seconds=5.0)
        except rank_files.RankFileError as exc:
            if not exc.missing:
                self.problem = str(exc)
            return
        try:
            entries = json.loads(raw)
            loaded = [(float(at), str(job)) for at, job in entries if isinstance(job, str)]
        except (ValueError, TypeError, RecursionError, OverflowError):
            self.problem = f"{path}: not a ledger of actions; starting an empty one"
            return
        latest = time.time() + _LEDGER_FUTURE_SECONDS  # an action from the future would hold its job for ever
        self._done.extend((at, job) for at, job in loaded if math.isfinite(at) and 0 < at < latest)

    def record(self, at: float, *jobs: str) -> None:
        """An action at `at` on the job known by `jobs` (its ledger keys)."""
        with self._lock:
            self._done.extend((at, job) for job in dict.fromkeys(jobs))
            entries = list(self._done)
        if self.path is not None:
            try:
                private_files.write_json(self.path, entries, replace=True)
            except OSError as exc:
                self.problem = f"{self.path}: {exc.strerror or exc}"

    def on_job(self, jobs: str | Sequence[str], elsewhere: Sequence[float] = ()) -> list[float]:
        """When this node acted on the job known by `jobs` (one action under several keys counted once), with
        `elsewhere`: the last action of each other node on it (the fleet's ledgers, fleet.py), a time within a
        second of one of ours being ours."""
        keys = {jobs} if isinstance(jobs, str) else set(jobs)
        with self._lock:
            here = sorted({at for at, who in self._done if who in keys})
        return sorted(here + [at for at in elsewhere if all(abs(at - mine) > 1.0 for mine in here)])

    def summary(self) -> list[tuple[str, float, int]]:
        """(job, its last action, how many actions) for each job in the ledger: the series the fleet reads."""
        found: dict[str, tuple[float, int]] = {}
        with self._lock:
            for at, job in self._done:
                last, count = found.get(job, (at, 0))
                found[job] = (max(last, at), count + 1)
        return sorted((job, last, count) for job, (last, count) in found.items())


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
                                and h.io_bytes < _STILL_IO_BYTES
                                for h in picture.host.values()):
            return True
    return False


def sign_of_life(picture: StackPicture) -> str | None:
    """A rank of the job whose host I/O moved over the observation (a checkpoint being written, a data loader
    reading), said as a clause; None when none did. CPU alone is no sign: a rank spinning in a collective
    burns it."""
    observed = max(picture.observed_seconds, 0.1)
    limit = max(_STILL_IO_BYTES, _LIVE_IO_BYTES_PER_SECOND * observed)
    for member, h in sorted(picture.host.items()):
        moved = h.io_bytes
        if moved >= limit:
            return f"{member} moved {moved / 1e6:.1f} MB of I/O in {observed:.1f} s"
    return None


def paused(cfg: ActionsConfig) -> str | None:
    """Why actions are paused, or None."""
    if cfg.paused:
        return "paused by actions.paused"
    if cfg.pause_file and os.path.lexists(cfg.pause_file):
        return f"paused by {cfg.pause_file}"
    return None


def decide(cfg: ActionsConfig, hang: Hang, ledger: Ledger, fleet: tuple[float | None, str] = (0.0, ""),
           elsewhere: Sequence[float] = ()) -> Decision:
    """The decision for `hang` now. `fleet` is (the share of the fleet's nodes that acted lately, or None when
    it could not be learnt; why) from fleet.py, asked only when everything else says act; `elsewhere`, the
    other nodes' last actions on the same job (fleet.py), so that a job requeued to this node is known."""
    if cfg.mode == "observe":
        return Decision("observe", "actions.mode is observe")
    if hang.severity is not Severity.CRITICAL or hang.critical_since is None:
        return Decision("wait", "not critical")
    lasted = hang.now - hang.onset
    if lasted < cfg.after_seconds:
        return Decision("wait", f"critical for {lasted:.0f} s of {cfg.after_seconds:g} s")
    if hang.target is None:
        return Decision("no_target", f"no process on the episode's GPUs is proven a rank of a job ({hang.unproven})")
    if hang.conflict is not None:
        return Decision("conflict", hang.conflict)
    if hang.alive is not None:
        return Decision("alive", f"the job shows a sign of life: {hang.alive}")
    if not hang.confirmed and not cfg.on_telemetry_only:
        return Decision("unconfirmed", "no live evidence confirms the hang (actions.on_telemetry_only is off)")
    if not hang.kept:
        return Decision("no_evidence", "the incident bundle could not be written: nothing is done without the "
                        "evidence on disk")
    done = ledger.on_job(hang.keys, elsewhere)
    before = [at for at in done if at <= hang.onset]
    if before and hang.onset - max(before) < cfg.deterministic_within_seconds:
        return Decision("deterministic", f"the job hung again {duration_text(hang.onset - max(before))} after it "
                        "was restarted: a restart would hang again, so it is left to a person")
    if hang.restarted is not None and 0 <= hang.onset - hang.restarted[1] < cfg.deterministic_within_seconds:
        count, started = hang.restarted
        return Decision("deterministic", f"the job hung again {duration_text(hang.onset - started)} after its "
                        f"launcher restarted it ({count} {'restart' if count == 1 else 'restarts'}): a restart "
                        "would hang again, so it is left to a person")
    recent = [at for at in done if hang.now - at < cfg.budget_window_seconds]
    if len(recent) >= cfg.max_per_job:
        return Decision("budget", f"{len(recent)} actions on this job within "
                        f"{duration_text(cfg.budget_window_seconds)} (actions.max_per_job)")
    last = max(done, default=None)
    if last is not None and hang.now - last < cfg.cooldown_seconds:
        return Decision("cooldown", f"this job was acted on {duration_text(hang.now - last)} ago "
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
