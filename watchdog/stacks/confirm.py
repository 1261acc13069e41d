"""Two looks at a suspected hang: one look is never a verdict.

A look at a job's stacks shows where its ranks were, not whether they move: it may catch a fast healthy job
inside its all_reduce, or a rank between two writes of a checkpoint. When a look shows a hang, the ranks are
looked at again `stacks.confirm_seconds` later. The hang is confirmed (critical) when the second look shows it
too, every rank of the job on this node was captured at both looks and is where it was, and no rank read or
wrote between them (the second look's host activity counts from the first look's end: what the ranks wrote
for the first look's own questions, a Flight Recorder dump or NCCL RAS's answers, is not movement). Ranks
that moved between the looks (I/O, or elsewhere at the second) are no hang, whatever one
look said; a look that missed a rank leaves a suspicion (a warning). A rank burning CPU at the same place
(CUDA's spin-wait in a sync, a host-side wait loop) is not moving; one whose I/O moved is. Every local rank
in the same collective, the job's other ranks on other nodes ("remote"), confirmed the same way, is a hang of
this node's ranks. The daemon, `stacks dump` and `/v1/dump` all look this way (look_twice). In the daemon a
confirmed hang makes the episode critical once the stall has lasted stacks.confirm_min_seconds
(detect/episodes.py): the evidence is taken while the job is still there to look at, before a framework
aborts the step (TorchTitan after 100 s, Megatron's in-process restart after 60-90 s).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from watchdog.config import StacksConfig
from watchdog.sample.ranks import Job, RankDiscovery
from watchdog.stacks.analysis import Analysis
from watchdog.stacks.capture import OK, StackCapturer
from watchdog.stacks.picture import StackPicture, capture_job
from watchdog.vocabulary.model import Severity, Verdict

BLOCKED = ("hang", "remote")  # "remote": every local rank in one collective, the job's other ranks elsewhere
_MOVED_BYTES = 64 * 1024  # read or written across the two looks: a data loader or a checkpoint at work
ONE_LOOK = ("One look: where the ranks were, not whether they move (a healthy job spends much of each step in a "
            "collective); a hang is confirmed by a second look that finds them where they were with nothing moving")


def _places(analysis: Analysis) -> dict[str, str]:
    """Where each rank is: its group's place (functions and files, not lines)."""
    return {member: group.where for member, group in analysis.group_by_member().items()}


def decide(first: StackPicture, second: StackPicture, seconds_apart: float) -> Verdict:
    """What two looks at a suspected hang say together: the hang confirmed (critical); no hang, when a rank
    moved between them (its I/O, or its place); or the second look's own verdict, saying why it does not
    confirm the first (a look that missed a rank, a look that shows something else). What only the first look
    asked (the Flight Recorder, NCCL RAS) stays in the notes."""
    if first.verdict.kind not in BLOCKED:
        return second.verdict
    apart, asked = f"{seconds_apart:.0f} s", list(first.verdict.notes)
    mover = _moved_bytes(second)
    if mover is not None:  # CPU alone is no sign (a spin-wait burns a core); I/O is
        moved = second.host[mover].io_bytes
        return Verdict("no_stall", None, f"{second.analysis.summary}. Not a hang: {mover} read or wrote "
                       f"{moved / 2**20:.1f} MiB between two looks {apart} apart", "the ranks move").noted(asked)
    if not first.captures or any(c.result != OK for c in (*first.captures, *second.captures)):
        return _one_look(second.verdict.noted(asked)).noted([f"Not confirmed: a rank's stack was missed at one "
                                                             f"of two looks {apart} apart, and it may be the one "
                                                             "that moves"])
    before, after = _places(first.analysis), _places(second.analysis)
    if not before or before != after:
        return Verdict("no_stall", None, f"{second.analysis.summary}. Not a hang: the ranks were elsewhere at a "
                       f"second look {apart} later", "the ranks move").noted(asked)
    if second.verdict.kind != first.verdict.kind:
        return _one_look(second.verdict.noted(asked)).noted([f"A second look {apart} later did not show the same"])
    # Every local rank in one collective, twice, nothing moved: this node's ranks are blocked whoever the
    # culprit is (a rank on another node, the transport): a hang here, its headline still pointing there.
    return replace(second.verdict, kind="hang", confirmed=True, severity=Severity.CRITICAL,
                   headline=first.verdict.headline).noted(
        [*asked, f"The same at a second look {apart} later, with no rank's I/O moving"])


def confirm(first: StackPicture, second: StackPicture, seconds_apart: float) -> Verdict | None:
    """The second look's verdict, confirmed; None when the two looks do not agree on a hang."""
    decided = decide(first, second, seconds_apart)
    return decided if decided.confirmed else None


def _one_look(decided: Verdict) -> Verdict:
    """A verdict from one look, said as one: a suspected hang stays a warning and says why."""
    return decided.noted([ONE_LOOK]) if decided.kind in BLOCKED else decided


def _sleep(seconds: float) -> bool:
    time.sleep(seconds)
    return False


def look_twice(job: Job, capturer: StackCapturer, discovery: RankDiscovery, cfg: StacksConfig, node: str = "",
               wait: Callable[[float], bool] = _sleep,
               seen: Callable[[StackPicture], None] = lambda picture: None) -> StackPicture:
    """A job's picture as the daemon, `stacks dump` and `/v1/dump` all take it: one look, and where it shows a
    hang, a second `cfg.confirm_seconds` later (the stacks only, the host activity counted from the first look's
    end) that decides. `wait(seconds)` returns True to stop early (the first look's verdict is kept);
    `seen` is handed each look, to count its captures."""
    first = capture_job(job, capturer, discovery, cfg, node)
    seen(first)
    if first.verdict.kind not in BLOCKED:
        return first
    # The second look counts the ranks' I/O from the first look's end: what they wrote for its own questions
    # (a Flight Recorder dump, NCCL RAS's answers) is not a sign that they move.
    read_at = time.monotonic()
    job = replace(job, ranks=tuple(discovery.describe(r.pid, r.gpus, expect_create_time=r.create_time) or r
                                   for r in job.ranks))
    if cfg.confirm_seconds <= 0 or wait(cfg.confirm_seconds):
        return replace(first, verdict=_one_look(first.verdict))
    again = cfg.model_copy(update={"observe_seconds": 0.0, "flight_recorder": False, "nccl_ras": False})
    second = capture_job(job, capturer, discovery, again, node, read_at=read_at)
    seen(second)
    return replace(first, verdict=decide(first, second, time.monotonic() - read_at))


def _moved_bytes(picture: StackPicture) -> str | None:
    """A rank whose host I/O moved between the looks (the second look's activity counts from the first's end)."""
    return next((member for member, activity in picture.host.items() if activity.io_bytes >= _MOVED_BYTES), None)
