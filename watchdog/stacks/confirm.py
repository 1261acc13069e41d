"""A second look at a hang, to confirm it before the episode's signature has held for its for_seconds.

The first look at a stall's stacks (when it is suspected) may catch the ranks at a moment that passes: a
rank between two writes of a checkpoint, a collective about to return. When that look shows a hang, the ranks are
looked at again `stacks.confirm_seconds` later. The hang is confirmed when the second look shows it
too, every rank of the job on this node was captured at both looks and is where it was, and no rank the
others wait for made progress on the host across both looks (the second look's host activity counts from the first's
reading, so its verdict weighs the whole time). A look that shows no hang is what the detectors get instead.
A rank burning CPU at the same place (CUDA's spin-wait in a sync, a host-side wait loop) is not moving; one
whose I/O moved is. Every local rank in the same collective, the job's other ranks on other nodes ("remote"),
confirmed the same way, is a hang of this node's ranks. A confirmed hang makes the episode critical once
the stall has lasted stacks.confirm_min_seconds
(detect/episodes.py): the evidence is taken while the job is still there to look at, before a framework
aborts the step (TorchTitan after 100 s, Megatron's in-process restart after 60-90 s).
"""

from __future__ import annotations

from dataclasses import replace

from watchdog.model import Severity, Verdict
from watchdog.stacks.analysis import Analysis
from watchdog.stacks.capture import OK
from watchdog.stacks.picture import StackPicture

BLOCKED = ("hang", "remote")  # "remote": every local rank in one collective, the job's other ranks elsewhere
_MOVED_BYTES = 64 * 1024  # read or written across the two looks: a data loader or a checkpoint at work


def _places(analysis: Analysis) -> dict[str, str]:
    """Where each rank is: its group's place (functions and files, not lines)."""
    return {member: group.where for member, group in analysis.group_by_member().items()}


def confirm(first: StackPicture, second: StackPicture, seconds_apart: float) -> Verdict | None:
    """The second look's verdict, confirmed; None when the two looks do not agree on a hang."""
    if first.verdict.kind not in BLOCKED or second.verdict.kind != first.verdict.kind:
        return None
    if _moved_bytes(second) is not None:
        return None  # a rank read or wrote meanwhile: CPU alone is no sign (a spin-wait burns a core), I/O is
    if not first.captures or any(c.result != OK for c in (*first.captures, *second.captures)):
        return None  # a rank not seen at one of the looks may be the one that moves
    before, after = _places(first.analysis), _places(second.analysis)
    if not before or before != after:
        return None
    # Every local rank in one collective, twice, nothing moved: this node's ranks are blocked whoever the
    # culprit is (a rank on another node, the transport): a hang here, its headline still pointing there.
    return replace(second.verdict, kind="hang", confirmed=True,
                   severity=second.verdict.severity if second.verdict.kind == "hang" else Severity.CRITICAL
                   ).noted([f"The same at a second look {seconds_apart:.0f} s later, with no rank's I/O moving"])


def _moved_bytes(picture: StackPicture) -> str | None:
    """A rank whose host I/O moved across both looks (the second look's activity counts from the first's)."""
    return next((member for member, activity in picture.host.items() if activity.io_bytes >= _MOVED_BYTES), None)
