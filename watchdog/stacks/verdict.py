"""The stacks' verdict from one look: a suspected hang, waiting, remote, or not a stall (all warnings at most).

One look shows where the ranks were, not whether they move: a healthy job spends much of every step inside a
collective, so one look that finds every rank in all_reduce is what a fast job looks like as often as a hung
one. A hang is critical only when a second look agrees with nothing moving between (stacks/confirm.py), or
when the evidence itself spans the time (a NCCL watchdog's timeout, stacks/timeout_verdict.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from watchdog.sample.proc_counters import HostActivity
from watchdog.stacks.analysis import Analysis
from watchdog.stacks.classify import (
    BACKWARD,
    CHECKPOINT_IO,
    COLLECTIVE,
    COMPILE,
    DATA_LOADING,
    EVALUATION,
    FORWARD,
    GENERATION,
    IDLE_WAIT,
    UNKNOWN,
)
from watchdog.vocabulary.model import Severity, Verdict
from watchdog.vocabulary.words import plural

_PROGRESS_BYTES = 64 * 1024  # written during the observation: a checkpoint writer makes progress
_PROGRESS_CPU = 0.2  # CPU seconds per second: real host work (compute on the host, decoding, copying)
_IDLE_ACTIVITIES = {DATA_LOADING, IDLE_WAIT, UNKNOWN}
_HOST_WORK = {CHECKPOINT_IO, EVALUATION, GENERATION, COMPILE, FORWARD, BACKWARD}


def _suspected(reason: str, headline: str) -> Verdict:
    """A hang as far as one look can tell: a warning until a second look confirms it (stacks/confirm.py)."""
    return Verdict("hang", Severity.WARNING, reason, headline)


def _headline(analysis: Analysis, stuck: bool) -> str:
    """'rank 4 (pid 8358, GPU 4) is stuck in DataLoader.__next__ -> Queue.get; the other 7 ranks wait for
    it in all_reduce': the odd ones first, then what the rest do."""
    odd = set(analysis.outliers)
    verb = "is stuck in" if stuck else "is in"
    parts = [f"{analysis.member_label.get(m, m)} {verb} {g.where}" for g in analysis.groups for m in g.members
             if m in odd]
    rest = [g for g in analysis.groups if not odd & set(g.members)]
    if rest:
        count = sum(g.count for g in rest)
        verb = plural(count, "waits", "wait") if rest[0].activity.name == COLLECTIVE else plural(count, "is", "are")
        if odd:
            others = "the other rank" if count == 1 else f"the other {count} ranks"
            them = f" for {plural(len(odd), 'it', 'them')}" if rest[0].activity.name == COLLECTIVE else ""
            parts.append(f"{others} {verb}{them} in {rest[0].where}")
        else:
            (first, *_) = rest[0].members
            who = analysis.member_label.get(first, first) if count == 1 else \
                f"{'all ' if len(rest) == 1 else ''}{count} ranks"
            parts.append(f"{who} {verb} in {rest[0].where}" + (" and elsewhere" if len(rest) > 1 else ""))
    return "; ".join(parts[:4]) or "no stacks"


def verdict(analysis: Analysis, host: Mapping[str, HostActivity] | None = None, observed_seconds: float = 1.0,
            spans_other_nodes: bool = False) -> Verdict:
    """Refine a stall with the stacks: a rank making host progress in a checkpoint or evaluation is a
    wait (warning); a rank idle in a queue or lock, or every rank in one collective, is a hang."""
    saved = host is None  # saved stacks: where the ranks were, not whether they moved
    host = host or {}
    groups = analysis.groups
    odd = set(analysis.outliers)

    def progressing(member: str) -> bool:
        delta = host.get(member)
        if delta is None:
            return False
        return (delta.write_bytes or 0) >= _PROGRESS_BYTES or delta.cpu_seconds >= _PROGRESS_CPU * observed_seconds

    if odd and saved and not any(g.activity.name == COLLECTIVE for g in groups):
        return Verdict("unknown", None,
                       f"{analysis.summary}. No rank is in a collective, so none is seen waiting on another; saved "
                       "stacks show where the processes were, not whether they move", _headline(analysis, stuck=False))
    if odd:
        one = len(odd) == 1
        odd_activities = {analysis.member_activity[m].name for m in odd}
        busy = [m for m in odd if progressing(m)]
        if busy and len(busy) == len(odd) and not odd_activities & _IDLE_ACTIVITIES - {UNKNOWN}:
            written = sum(host[m].write_bytes or 0 for m in busy)
            cpu = sum(host[m].cpu_seconds for m in busy)
            evidence = f"wrote {written / 2**20:.1f} MiB" if written >= _PROGRESS_BYTES else f"used {cpu:.1f} CPU s"
            return Verdict("waiting", Severity.WARNING,
                           f"{analysis.summary}. The odd {'rank is' if one else 'ranks are'} busy on the host "
                           f"({evidence} in {observed_seconds:.1f} s): the others wait on {'it' if one else 'them'}",
                           _headline(analysis, stuck=False))
        if odd_activities == {COLLECTIVE}:
            return _suspected(f"{analysis.summary}. The odd {'rank is' if one else 'ranks are'} in another collective "
                           "than the rest: the two will never match", _headline(analysis, stuck=True))
        if saved and odd_activities <= {CHECKPOINT_IO, EVALUATION}:
            return Verdict("waiting", Severity.WARNING,
                           f"{analysis.summary}. The odd {'rank is' if one else 'ranks are'} writing a checkpoint or "
                           "evaluating, which takes a while; saved stacks cannot tell whether it moves: look again "
                           "in a minute (`stall-watchdog stacks dump`), a hang if it is still there",
                           _headline(analysis, stuck=False))
        if not host:  # saved stacks: where the odd rank is, not whether it moves
            return _suspected(f"{analysis.summary}. The odd {'rank is' if one else 'ranks are'} not where the others "
                           f"are, and they wait on {plural(len(odd), 'it', 'them')}; whether "
                           f"{plural(len(odd), 'it moves', 'they move')} was not measured (saved stacks)",
                           _headline(analysis, stuck=True))
        return _suspected(f"{analysis.summary}. Nothing on the odd {'rank' if one else 'ranks'} is moving (no CPU or "
                       f"I/O progress in {observed_seconds:.1f} s): the others will wait forever",
                       _headline(analysis, stuck=True))
    collectives = [g for g in groups if g.activity.name == COLLECTIVE]
    if collectives and sum(g.count for g in collectives) == analysis.total:
        kinds = {g.activity.collective for g in collectives}
        moving = sorted((m for m, delta in host.items() if delta.io_bytes >= _PROGRESS_BYTES),
                        key=lambda m: -host[m].io_bytes)
        if moving:  # bytes through the ranks' sockets or files while they sat there: the collectives complete
            moved = host[moving[0]].io_bytes
            return Verdict("no_stall", None,
                           f"{analysis.summary}, but {analysis.member_label.get(moving[0], moving[0])} moved "
                           f"{moved / 2**20:.1f} MiB of I/O in {observed_seconds:.1f} s"
                           + (f" ({len(moving)} ranks moved)" if len(moving) > 1 else "")
                           + ": the collectives complete; a healthy job spends much of each step inside one",
                           _headline(analysis, stuck=False) + ", moving")
        if spans_other_nodes:
            return Verdict("remote", Severity.WARNING,
                           f"{analysis.summary}. Every local rank waits, and the job has ranks on other nodes: the "
                           "culprit is likely there; look at the other nodes' verdicts",
                           _headline(analysis, stuck=False) + ": the culprit is likely on another node")
        if analysis.total == 1:
            return _suspected(f"{analysis.summary}. One process's stack, in a collective: it waits on peers whose "
                           "stacks are not here; theirs show which one never arrived",
                           _headline(analysis, stuck=True) + "; the peers' stacks are not here")
        if len(kinds) == 1:
            return _suspected(f"{analysis.summary}. Every rank is in the same collective and none returns: a peer "
                           "never arrived (network, P2P or a rank stuck in C code; py-spy --native shows more)",
                           _headline(analysis, stuck=True) + " and none returns")
        return _suspected(f"{analysis.summary}. Every rank waits in a collective",
                       _headline(analysis, stuck=True))
    members = list(analysis.member_activity)
    if members and all(analysis.member_activity[m].name in _HOST_WORK for m in members) and all(
            progressing(m) for m in members):
        return Verdict("waiting", Severity.WARNING,
                       f"{analysis.summary}. Every rank is busy on the host (a checkpoint, an evaluation): no rank "
                       "waits on another", _headline(analysis, stuck=False))
    if saved:  # one picture shows where the ranks were; only two looks (or host activity) show them move
        alone = "One process's stack shows where it was" if analysis.total == 1 else \
            "Saved stacks show where they were"
        return Verdict("unknown", None,
                       f"{analysis.summary}. {alone}, "
                       "not whether anything moves; no rank here waits on another in a collective. Give every "
                       "rank's stack, or run `stall-watchdog stacks dump` twice a few seconds apart",
                       _headline(analysis, stuck=False) + ": cannot tell from saved stacks")
    return Verdict("no_stall", None, f"{analysis.summary}. The stacks show no rank waiting on another",
                   _headline(analysis, stuck=False))
