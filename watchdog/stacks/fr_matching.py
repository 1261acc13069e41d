"""Name the ranks a process group waits on, from every rank's Flight Recorder dump (read by fr_dumps.py).

Per process group, the collective furthest along is the one the group is in. Ranks that never enqueued
it are behind (they are the culprits: the others wait on them); ranks that enqueued another operation
under the same sequence number are in a different collective; ranks that enqueued it but never completed
it are stuck in it. PyTorch's own matcher (torch.distributed.flight_recorder) is run beside ours where
PyTorch is importable.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from watchdog.stacks.fr_dumps import RankTrace, collectives, group_key
from watchdog.stacks.fr_dumps import completed as _completed

# Ranks listed by name in a finding's JSON, in rank order; the count says how many there are. A node of a
# 4,096-node job holds 8 of the default group's 32,768 ranks: the others are missing from where it stands.
MAX_LISTED = 256


@dataclass(frozen=True)
class GroupFinding:
    group: str  # process group name (desc)
    seq: int  # the collective the group is in (its collective_seq_id)
    op: str  # its name, e.g. "nccl:all_reduce"
    waiting: tuple[int, ...]  # ranks that enqueued it and did not complete it
    completed: tuple[int, ...]  # ranks that completed it
    behind: Mapping[int, tuple[int, str]]  # rank -> (last seq, last op) for ranks that never enqueued it
    other_op: Mapping[int, str]  # rank -> the op it enqueued under the same seq, when not `op`
    missing: tuple[int, ...]  # members with no dump at all
    # rank -> (its oldest uncompleted seq, the others' oldest): with every member at the same work, a rank whose
    # work stopped completing before its peers' did (a GPU error, a rank holding the GIL) is the one they wait on
    stalled: Mapping[int, tuple[int, int]] = field(default_factory=dict)

    @property
    def stuck(self) -> bool:
        return bool(self.waiting) and (bool(self.behind) or bool(self.other_op) or not self.completed)

    @property
    def culprits(self) -> tuple[int, ...]:
        """The ranks the waiting ones wait on: behind, or in another collective; where the dumps show neither,
        the members whose dump never came (a rank tearing its group down, or hung in C code, never answers)."""
        named = {*self.behind, *self.other_op, *self.stalled}
        return tuple(sorted(named if named or not self.stuck else self.missing))

    def sentence(self) -> str:
        name = _short(self.op)
        parts = []
        if self.waiting:
            verb = "waits" if len(self.waiting) == 1 else "wait"
            parts.append(f"{_ranks(self.waiting)} {verb} in {name} #{self.seq}")
        for rank, (seq, op) in sorted(self.behind.items()):
            last = f"its last is {_short(op)} #{seq}" if seq > 0 else "it enqueued none"
            parts.append(f"rank {rank} never reached it ({last})")
        for rank, op in sorted(self.other_op.items()):
            parts.append(f"rank {rank} is in {_short(op)} #{self.seq} instead")
        for rank, (mine, theirs) in sorted(self.stalled.items()):
            parts.append(f"rank {rank} stopped completing work at #{mine}, its peers at #{theirs}")
        if self.missing:
            suspect = (f": the first suspect{'s' if len(self.missing) > 1 else ''}"
                       if self.stuck and not self.behind and not self.other_op else "")
            parts.append(f"no dump from {_ranks(self.missing)} (its absence is no sign of health){suspect}")
        if not self.stuck and not parts:
            parts.append(f"every rank completed {name} #{self.seq}")
        members = sorted({*self.waiting, *self.completed, *self.behind, *self.other_op, *self.missing})
        return f"process group {self.group} ({_ranks(members)}): " + "; ".join(parts)

    def to_json(self) -> dict[str, object]:
        return {"group": self.group, "seq": self.seq, "op": self.op, "stuck": self.stuck,
                "waiting": list(self.waiting), "completed": list(self.completed),
                "behind": {str(r): {"seq": s, "op": o} for r, (s, o) in sorted(self.behind.items())},
                "other_op": {str(r): o for r, o in sorted(self.other_op.items())},
                "missing": list(self.missing[:MAX_LISTED]), "missing_count": len(self.missing),
                "culprits": list(self.culprits[:MAX_LISTED]), "culprits_count": len(self.culprits),
                "sentence": self.sentence(),
                "stalled": {str(r): {"oldest_uncompleted": m, "peers": t}
                            for r, (m, t) in sorted(self.stalled.items())}}


@dataclass(frozen=True)
class FlightRecorderAnalysis:
    groups: tuple[GroupFinding, ...]
    ranks: tuple[int, ...]  # ranks with a dump
    analyzer: str = "stall-watchdog"

    @property
    def culprits(self) -> tuple[int, ...]:
        return tuple(sorted({r for g in self.groups if g.stuck for r in g.culprits}))

    @property
    def stuck(self) -> bool:
        return any(g.stuck for g in self.groups)

    @property
    def summary(self) -> str:
        stuck = [g for g in self.groups if g.stuck]
        if not stuck:
            return (f"Flight Recorder ({len(self.ranks)} ranks): no process group is stuck" if self.groups
                    else f"Flight Recorder ({len(self.ranks)} ranks): no collective recorded")
        # the groups that name a culprit first: a job of many groups is read from the ranks it waits on
        stuck.sort(key=lambda g: not g.culprits)
        more = f". And {len(stuck) - 4} more stuck groups" if len(stuck) > 4 else ""
        return "Flight Recorder: " + ". ".join(g.sentence() for g in stuck[:4]) + more

    def to_json(self) -> dict[str, object]:
        culprits = self.culprits
        return {"analyzer": self.analyzer, "ranks": list(self.ranks), "culprits": list(culprits[:MAX_LISTED]),
                "culprits_count": len(culprits),
                "summary": self.summary, "groups": [g.to_json() for g in self.groups]}


def _short(op: str) -> str:
    return op.split(":", 1)[-1] if op else "a collective"


def _ranks(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:12]))}{' ...' if len(ranks) > 12 else ''}"


def analyze(traces: Iterable[RankTrace]) -> FlightRecorderAnalysis:
    traces = sorted(traces, key=lambda t: t.rank)
    by_rank = {t.rank: t for t in traces}
    # group key -> rank -> entries of that rank in the group (collectives only, by sequence number)
    per_group: dict[tuple[str, str], dict[int, Mapping[int, Mapping[str, Any]]]] = {}
    for trace in traces:
        for group, seqs in collectives(trace).items():
            per_group.setdefault(group, {})[trace.rank] = seqs
    declared: dict[str, set[int]] = {}
    merged: set[tuple[str, int]] = set()
    for trace in traces:
        for name, listed in trace.groups.items():
            if (name, id(listed)) not in merged:  # a list shared by many traces (for_matching) once
                merged.add((name, id(listed)))
                declared.setdefault(name, set()).update(listed)
    findings = []
    for (name, desc), ranks in sorted(per_group.items()):
        members = _members(name, desc, ranks.keys(), traces, declared.get(name, set()))
        findings.append(_judge_group(desc or name, members, ranks, by_rank))
    return FlightRecorderAnalysis(tuple(findings), tuple(by_rank))


def _members(name: str, desc: str, seen: Iterable[int], traces: Sequence[RankTrace],
             declared: set[int]) -> tuple[int, ...]:
    if desc == "default_pg" or name == "0":
        declared = declared | {t.rank for t in traces}  # every rank is in the default group
    return tuple(sorted(declared | set(seen)))


def _judge_group(label: str, members: Sequence[int], ranks: Mapping[int, Mapping[int, Mapping[str, Any]]],
                 by_rank: Mapping[int, RankTrace]) -> GroupFinding:
    seq = max(max(seqs) for seqs in ranks.values())
    ops = [seqs[seq].get("profiling_name", "") for seqs in ranks.values() if seq in seqs]
    op = max(set(ops), key=ops.count) if ops else ""
    waiting, completed, behind, other, missing = [], [], {}, {}, []
    for rank in members:
        seqs = ranks.get(rank)
        if rank not in by_rank:
            missing.append(rank)
            continue
        if not seqs or seq not in seqs:
            last = max(seqs) if seqs else 0
            behind[rank] = (last, str(seqs[last].get("profiling_name", "")) if seqs else "")
            continue
        entry = seqs[seq]
        if str(entry.get("profiling_name", "")) != op:
            other[rank] = str(entry.get("profiling_name", ""))
        elif _completed(entry) or _status_completed(by_rank[rank], entry, seq):
            completed.append(rank)
        else:
            waiting.append(rank)
    stalled = _stalled(waiting, ranks) if len(waiting) >= 2 and not behind and not other else {}
    return GroupFinding(label, seq, op, tuple(waiting), tuple(completed), behind, other, tuple(missing), stalled)


def _stalled(waiting: Sequence[int],
             ranks: Mapping[int, Mapping[int, Mapping[str, Any]]]) -> dict[int, tuple[int, int]]:
    """Among ranks that all wait in the same collective, the one whose oldest uncompleted work is older than every
    other's: it stopped completing work first (its GPU, or its host thread), and its peers then stopped on it."""
    oldest = {r: min((q for q, e in ranks[r].items() if not _completed(e)), default=None) for r in waiting}
    known = {r: q for r, q in oldest.items() if q is not None}
    if len(known) < 2:
        return {}
    first = min(known.values())
    at_first = [r for r, q in known.items() if q == first]
    others = min(q for r, q in known.items() if q != first) if len(at_first) < len(known) else None
    # One collective apart is the watchdog's lag in noticing a completion; two or more is work that stopped.
    if len(at_first) != 1 or others is None or others - first < 2:
        return {}
    return {at_first[0]: (first, others)}


def _status_completed(trace: RankTrace, entry: Mapping[str, Any], seq: int) -> bool:
    status = trace.status.get(str(entry.get("pg_id", "")))
    return status is not None and status.get("last_completed_collective", -1) >= seq


def _torch_pg_config(trace: RankTrace) -> dict[str, dict[str, str]]:
    """pg_config as PyTorch's analyzer wants it: keyed by the group names the entries use. Gloo dumps
    (PyTorch 2.13) key the default group '' while its entries name it '0' (desc 'default_pg'): the
    analyzer then fails with KeyError ('0', rank). The group is renamed to what its entries say."""
    named = {group_key(e) for e in trace.entries}
    config = {n: {"name": n, "desc": n, "ranks": str(list(r))} for n, r in trace.groups.items()}
    for name, desc in named:
        if name not in config and "" in config and desc == "default_pg":
            config[name] = {"name": name, "desc": desc, "ranks": config.pop("")["ranks"]}
    return config


def analyze_with_torch(traces: Sequence[RankTrace]) -> list[dict[str, object]] | None:
    """PyTorch's own matcher (torch.distributed.flight_recorder), run on the dumps we already read safely:
    per collective it did not match everywhere, its name, sequence number and missing ranks. None when
    PyTorch (or its analyzer) is not importable, or when it gives up on these dumps."""
    try:
        from argparse import Namespace

        from torch.distributed.flight_recorder.components.builder import build_db
    except Exception:  # ImportError, or a torch that fails to import: our own matcher stands
        return None
    traces = sorted(traces, key=lambda t: t.rank)  # its matching starts from the first rank: keep it rank 0
    details = {f"rank{t.rank}": {"host_name": t.node or f"host_rank{t.rank}", "rank": t.rank,
                                 "entries": [dict(e) for e in t.entries], "version": t.version,
                                 "pg_config": _torch_pg_config(t)}
               for t in traces}
    args = Namespace(verbose=False, just_print_entries=False, allow_incomplete_ranks=True, mismatch_cap=10,
                     selected_ranks=None, pg_filters=None, print_stack_trace=False)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            logging.disable(logging.CRITICAL)  # it reports through logging and print; we report its result
            try:
                db = build_db(details, args, traces[0].version if traces else "2.0")
            finally:
                logging.disable(logging.NOTSET)
    except (Exception, SystemExit):  # its asserts and exits are its way of saying "cannot match these"
        return None
    return [{"collective": c.collective_name, "seq": c.collective_seq_id, "group": c.pg_desc,
             "state": c.collective_state, "missing_ranks": sorted(c.missing_ranks or ()),
             "mismatch": {str(r): m.collective_name for r, m in sorted((c.mismatch_collectives or {}).items())}}
            for c in db.collectives if c.missing_ranks or not c.pass_check]
