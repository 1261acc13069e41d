"""Group identical stacks and name the outliers: the ranks the others wait on.

Identical stacks (line numbers and install prefixes aside) are grouped; the outliers are the ranks
outside a collective others wait in (whatever their number: in a two-rank job one is enough), the few
still in a collective where most show no known place (a wait in C code shows only the training loop's
line), or those in a different collective than a clear majority. The result is one sentence a person can
act on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from watchdog.stacks.classify import COLLECTIVE, UNKNOWN, Activity, classify, normalized, where_text
from watchdog.vocabulary.stack_model import Frame, StackDump


@dataclass(frozen=True)
class Group:
    members: tuple[str, ...]
    count: int  # processes, counting the ones a dump stands for
    activity: Activity
    where: str
    state: str | None
    frames: tuple[Frame, ...]


@dataclass(frozen=True)
class Analysis:
    groups: tuple[Group, ...]
    outliers: tuple[str, ...]
    summary: str
    total: int
    member_activity: Mapping[str, Activity] = field(default_factory=dict)
    member_label: Mapping[str, str] = field(default_factory=dict)  # 'rank 4 (pid 8358, GPU 4)'

    def group_by_member(self) -> dict[str, Group]:
        """Each member's group (where it is and what it does)."""
        return {m: g for g in self.groups for m in g.members}

    def to_json(self) -> dict[str, object]:
        return {
            "groups": [{
                "members": list(g.members), "count": g.count, "activity": g.activity.name,
                "collective": g.activity.collective, "where": g.where, "state": g.state,
                "frames": [{"function": f.function, "file": f.file, "line": f.line} for f in g.frames],
            } for g in self.groups],
            "outliers": list(self.outliers),
            "summary": self.summary,
        }


def _plural(count: int, total: int, noun: str) -> str:
    return f"{count} of {total} {_nouns(noun)}" if total > 1 else f"the {noun}"


def _nouns(noun: str) -> str:
    return noun + ("es" if noun.endswith("s") else "s")


def analyze(dumps: Sequence[StackDump], idle_seconds: Mapping[str, float] | None = None) -> Analysis:
    """Group the ranks' main-thread stacks and name the outliers."""
    by_key: dict[tuple[tuple[str, str], ...], list[StackDump]] = {}
    seen: dict[int, tuple[tuple[str, str], ...]] = {}  # by frames: a job's ranks share a few stacks, read once
    for dump in dumps:
        thread = dump.main_thread
        if thread is None:
            key: tuple[tuple[str, str], ...] = ()
        elif (key := seen.get(id(thread.frames), ())) == ():
            key = seen[id(thread.frames)] = normalized(thread)
        by_key.setdefault(key, []).append(dump)
    groups = []
    activity_of: dict[str, Activity] = {}
    for members in by_key.values():
        thread = members[0].main_thread
        activity = classify(thread)
        for m in members:
            activity_of[m.member] = activity
        groups.append(Group(tuple(m.member for m in members), sum(m.count for m in members), activity,
                            where_text(thread, activity), thread.state if thread else None,
                            thread.frames if thread else ()))
    groups.sort(key=lambda g: -g.count)
    total = sum(g.count for g in groups)
    weight = {d.member: d.count for d in dumps}
    outliers = _outliers(groups, total)
    noun = "rank" if any(d.rank is not None for d in dumps) else "process"
    label = {d.member: _member_label(d) for d in dumps}
    return Analysis(tuple(groups), outliers, _sentence(groups, outliers, total, noun, activity_of, weight,
                                                       idle_seconds or {}, label), total, activity_of, label)


def _outliers(groups: Sequence[Group], total: int) -> tuple[str, ...]:
    in_collective = [g for g in groups if g.activity.name == COLLECTIVE]
    outside = [g for g in groups if g.activity.name != COLLECTIVE]
    n_in = sum(g.count for g in in_collective)
    if in_collective and outside:
        # A rank inside a collective waits on the ranks outside it, whatever their number: one in its data
        # loader, a queue, an evaluation or a checkpoint is the one the others wait on (two-rank jobs too).
        # Only a stack that shows no known place (a wait in C code looks like the training loop's line)
        # may be a rank already past: there the smaller side is the odd one, the outside on a tie.
        known = [g for g in outside if g.activity.name != UNKNOWN]
        n_unknown = sum(g.count for g in outside) - sum(g.count for g in known)
        if n_unknown > n_in:
            return tuple(m for g in in_collective for m in g.members) if not known else \
                tuple(m for g in known for m in g.members)
        return tuple(m for g in outside for m in g.members)
    by_kind: Counter[str] = Counter()
    for g in groups:
        by_kind[g.activity.key] += g.count
    if len(by_kind) < 2:
        return ()
    (top, top_count), = by_kind.most_common(1)
    if top_count * 2 <= total:
        return ()  # no clear majority: e.g. pipeline stages legitimately in different collectives
    return tuple(m for g in groups if g.activity.key != top for m in g.members)


def _sentence(groups: Sequence[Group], outliers: Sequence[str], total: int, noun: str,
              activity_of: Mapping[str, Activity], weight: Mapping[str, int], idle: Mapping[str, float],
              label: Mapping[str, str]) -> str:
    if not groups:
        return "no stacks"
    odd = set(outliers)
    main = [g for g in groups if not odd & set(g.members)]
    parts = []
    if main:
        count = sum(g.count for g in main)
        lead = main[0]
        single = count == 1  # "the process is in", "1 of 4 ranks waits in"
        verb = ("waits in" if single else "wait in") if lead.activity.name == COLLECTIVE else \
            ("is in" if single else "are in")
        sites = {g.where for g in main}
        more = f" and {len(sites) - 1} other call site{'s' if len(sites) > 2 else ''}" if len(sites) > 1 else ""
        parts.append(f"{_plural(count, total, noun)} {verb} {lead.where}{more}")
    for g in groups:
        for member in g.members:
            if member not in odd:
                continue
            state = f", {g.state}" if g.state else ""
            if member in idle:
                state += f" for {idle[member]:.0f} s"
            parts.append(f"{label[member]}{' x' + str(weight[member]) if weight[member] > 1 else ''} "
                         f"is in {g.where}{state}")
    if not odd and len(main) > 1 and main[0].activity.key != main[1].activity.key:
        split = ", ".join(f"{g.count} in {g.where}" for g in main[:4])
        return f"{total} {_nouns(noun)} split with no clear odd one out: {split}"
    return "; ".join(parts)


def _member_label(dump: StackDump) -> str:
    bits = []
    if dump.rank is not None and dump.pid is not None:
        bits.append(f"pid {dump.pid}")
    if dump.gpus:
        bits.append(f"GPU {', '.join(map(str, dump.gpus))}")
    if dump.node:
        bits.append(f"on {dump.node}")
    return f"{dump.member} ({', '.join(bits)})" if bits else dump.member
