"""An open incident, the record the incident handler (act/incidents.py) and the responder (act/responder.py)
share: its GPUs and severity, its bundle and alert, the looks at its stacks, and the actions policy's decisions."""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from watchdog.act import policy
from watchdog.sample.ranks import RankInfo
from watchdog.stacks.picture import StackPicture
from watchdog.vocabulary.alert_identity import AlertIdentity
from watchdog.vocabulary.model import EpisodeEvent, NodeSnapshot, Severity, Workload
from watchdog.vocabulary.telling import Telling
from watchdog.vocabulary.words import gpu_list


@dataclass
class OpenIncident:
    """One episode as the incident handler and the responder both see it: what was looked at, bundled and
    alerted (act/incidents.py), and what the actions policy decided and did (act/responder.py)."""

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
    doctor: str = ""  # the doctor's top finding (its evidence; its fix), once investigated
    notes: tuple[str, ...] = ()  # what the investigation could not gather
    action: str = ""  # what the responder last said it did (ACTED: ..., NOT ACTED (...), DRY RUN: ...)
    critical_since: float | None = None  # wall seconds it turned critical
    decision: policy.Decision | None = None  # the actions policy's last decision, over all its jobs
    decisions: dict[str, policy.Decision] = field(default_factory=dict)  # per proven job (membership key; "": none)
    evidence: dict[str, str] = field(default_factory=dict)  # per proven job: its before-action folder
    decided_at: float | None = None  # monotonic
    acting: bool = False
    stall_since: float | None = None  # wall seconds a relapse began


def telling(state: OpenIncident, event: EpisodeEvent) -> Telling:
    """What is said about the episode at this event: the event's summary with the incident's fields (the one
    renderer, watchdog/vocabulary/telling.py, writes the sentence every reader gets)."""
    return Telling(event.summary, state.doctor, state.notes, state.action,
                   (state.bundle or "") if state.action else "")


def on_gpus(state: OpenIncident, snapshot: NodeSnapshot) -> NodeSnapshot:
    """The snapshot of the incident's GPUs only."""
    return NodeSnapshot(snapshot.time_seconds, tuple(g for g in snapshot.gpus if g.index in state.gpus))


def bundle_on_disk(state: OpenIncident) -> bool:
    """Whether the episode's incident bundle is there now (written, and not rotated away)."""
    return state.bundle is not None and os.path.isdir(state.bundle)


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
