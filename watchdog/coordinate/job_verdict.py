"""One verdict for a job that spans nodes, from every node's /v1/dump answer.

The ranks' raw py-spy threads from all nodes are analysed together (the same grouping and verdict as
on one node), so the odd rank is found across the job and named with its node, pid, GPU and activity.
The Flight Recorder dumps of all nodes are matched together; NCCL RAS already sees the whole job, so a
finding the answering nodes agree on stands for it. Each answer speaks only for its own instance: its
name is its claim, and it is believed only of the ranks Prometheus places on that instance (where
Prometheus places none, as a stand-in without `rank` labels, of what it says).

The answers of a thousand nodes are hundreds of MB parsed: JobEvidence reads each one as it arrives into
what the verdict needs, so they are never all held at once.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from watchdog.stacks import fr_matching
from watchdog.stacks.analysis import Analysis, analyze
from watchdog.stacks.confirm import ONE_LOOK
from watchdog.stacks.fr_dumps import SharedGroups
from watchdog.stacks.fr_matching import FlightRecorderAnalysis
from watchdog.stacks.picture import corroborated, corroborations
from watchdog.stacks.verdict import verdict
from watchdog.vocabulary.model import Severity, Verdict

from . import answers
from .answers import NodeEvidence
from .nodes import NodeAnswer, Placement


@dataclass
class JobVerdict:
    job: str
    answers: list[NodeAnswer]
    analysis: Analysis
    verdict: Verdict
    odd: list[dict[str, object]] = field(default_factory=list)  # the odd ranks, with node, pid, GPU, activity
    ranks: list[dict[str, object]] = field(default_factory=list)
    fr: FlightRecorderAnalysis | None = None
    ras: dict[str, Any] | None = None
    placement: Placement = field(default_factory=lambda: Placement([]))  # what Prometheus or Slurm said of the job
    problem: str | None = None  # neither could be asked, or neither knows the job
    seconds: float = 0.0

    @property
    def silent(self) -> list[NodeAnswer]:
        return [a for a in self.answers if not a.answered]

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"training_job": self.job, "verdict": self.verdict.to_json(),
                                  "odd_ranks": self.odd, "seconds": round(self.seconds, 3),
                                  "nodes": [a.to_json() for a in self.answers],
                                  "nodes_answered": sum(a.answered for a in self.answers),
                                  "nodes_silent": [a.instance for a in self.silent], "ranks": self.ranks,
                                  "problem": self.problem, "rank_placement": self.placement.to_json(),
                                  "placed_by": self.placement.source}
        out.update(self.analysis.to_json())
        if self.fr is not None:
            out["flight_recorder"] = self.fr.to_json()
        if self.ras is not None:
            out["nccl_ras"] = self.ras
        return out


MAX_BUNDLE_BYTES = 64 * 2**20  # one job bundle: node answers past it are neither kept nor written, and said so


class JobEvidence:
    """What the job verdict needs of each node's answer, read as each answer arrives: the job's ranks and
    their stacks, the Flight Recorder traces as matching reads them (a process group's rank list, which
    every rank of the job repeats, read and kept once) and NCCL RAS. `keep` then drops the parsed answer;
    its bytes as they came stay for the bundle while `keep_bytes` (the bundle's budget) allows."""

    def __init__(self, job: str, keep_bytes: int = MAX_BUNDLE_BYTES):
        self.job = job
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._read: dict[str, list[NodeEvidence]] = {}  # by instance, in the order read
        self._groups: SharedGroups = {}
        self._kept = 0

    def add(self, answer: NodeAnswer) -> NodeEvidence:
        with self._lock:
            found = answers.read(self.job, answer.body, answer.instance, self._groups) if answer.answered \
                else NodeEvidence()
            self._read.setdefault(answer.instance, []).append(found)
        return found

    def keep(self, answer: NodeAnswer) -> NodeAnswer:
        """`add`, then the answer without its parsed body (its name as it gave it stays), with its bytes as
        they came while the answers kept are within `keep_bytes` (the bundle could not hold more); a
        malformed answer with its problem as its error."""
        found = self.add(answer)
        with self._lock:
            raw = answer.raw if answer.raw is not None and self._kept + len(answer.raw) <= self.keep_bytes else None
            self._kept += len(raw or b"")
        return replace(answer, body={"node": found.node, "bundle": found.bundle}, raw=raw,
                       error=answer.error or found.problem)

    def verdict(self, answered: Sequence[NodeAnswer], placement: Placement | None = None,
                problem: str | None = None) -> JobVerdict:
        """The job verdict from the answers read (in the answers' order, whatever order they came in). Each
        answer speaks only for its own instance: under its own name (a name another answer gives too, or
        another instance's address, is said with the instance), and for the ranks Prometheus places there
        (`placement`); a rank two instances answer for is believed of neither."""
        placement = placement or Placement([a.instance for a in answered])
        taken: dict[str, int] = {}
        pairs = []
        for answer in answered:
            n = taken[answer.instance] = taken.get(answer.instance, -1) + 1
            found = self._read.get(answer.instance, [])
            evidence = found[n] if n < len(found) else NodeEvidence()
            pairs.append((replace(answer, error=answer.error or evidence.problem), evidence))
        names = _names([(a.instance, e.node) for a, e in pairs if a.answered])
        refused, notes, unheard = _attribution([(a.instance, e) for a, e in pairs if a.answered], placement)
        read = [e.without(refused[a.instance], names[a.instance]) for a, e in pairs if a.answered]
        ras, ras_note = _ras([(a.instance, e.ras) for a, e in pairs if a.answered and e.ras is not None],
                             sum(a.answered for a, _ in pairs))
        return _decide(self.job, [a for a, _ in pairs], read, ras, placement, problem,
                       notes + [n for n in (placement.note, ras_note) if n], unheard)


def merge(job: str, answered: Sequence[NodeAnswer], placement: Placement | None = None,
          problem: str | None = None) -> JobVerdict:
    evidence = JobEvidence(job)
    for answer in answered:
        evidence.add(answer)
    return evidence.verdict(answered, placement, problem)


def _names(claims: Sequence[tuple[str, str | None]]) -> dict[str, str]:
    """Each instance's name: the one its answer gives, unless another answer gives it too or it is another
    instance's address (then said with the instance: "node-b at 10.0.0.7:9944"); its instance without one."""
    given = Counter(name for _, name in claims if name)
    instances = {instance for instance, _ in claims}
    names = {}
    for instance, name in claims:
        if not name or name == instance:
            names[instance] = instance
        elif given[name] > 1 or name in instances:
            names[instance] = f"{name} at {instance}"
        else:
            names[instance] = name
    return names


def _listed(items: Sequence[str], most: int = 4) -> str:
    return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")


def _attribution(found: Sequence[tuple[str, NodeEvidence]],
                 placement: Placement) -> tuple[dict[str, set[str]], list[str], bool]:
    """What each instance's answer is not believed for, and why. Where Prometheus places the job's ranks, an
    answer speaks only for the ranks placed on its own instance: a rank placed on other instances only, a rank
    placed nowhere and a rank-less pid are not counted (else one node could outvote the others, or invent a
    culprit). A rank (or, placement unknown, a rank-less pid) several instances speak for is believed of none.
    Last, whether a rank's own evidence may be among what is not believed (a process placed nowhere is none of
    the job's ranks: refusing it hides none, so it does not make the verdict look elsewhere)."""
    claims: dict[str, set[str]] = {}
    for instance, evidence in found:
        for member in evidence.members():
            claims.setdefault(member, set()).add(instance)
    refused: dict[str, set[str]] = {instance: set() for instance, _ in found}
    elsewhere: dict[str, list[str]] = {}
    nowhere: dict[str, list[str]] = {}
    shared: list[tuple[str, list[str]]] = []
    for member, instances in sorted(claims.items(), key=lambda c: _order(c[0])):
        rank = int(member[5:]) if member.startswith("rank ") else None
        placed = placement.ranks.get(rank, frozenset()) if rank is not None else frozenset()
        if placement.ranks and not placed:
            for instance in instances:
                refused[instance].add(member)
                nowhere.setdefault(instance, []).append(member if rank is not None else f"{member} (no rank)")
            continue
        if placed:
            for instance in sorted(instances - placed):
                refused[instance].add(member)
                elsewhere.setdefault(instance, []).append(member)
            instances = instances & placed
        if len(instances) > 1:
            for instance in instances:
                refused[instance].add(member)
            shared.append((member, sorted(instances)))
    notes = []
    for instance, members in elsewhere.items():
        if len(members) == 1:
            where = sorted(placement.ranks.get(int(members[0][5:]), ()))
            notes.append(f"{instance} answered for {members[0]}, which Prometheus places on {_listed(where)}: "
                         "not believed")
        else:
            notes.append(f"{instance} answered for {len(members)} ranks Prometheus places on other instances "
                         f"({_listed(members)}): not believed")
    for instance, members in nowhere.items():
        notes.append(f"{instance} answered for {members[0]}, which Prometheus places on no instance: not believed"
                     if len(members) == 1 else f"{instance} answered for {len(members)} processes Prometheus "
                     f"places on no instance ({_listed(members)}): not believed")
    if len(shared) == 1:
        member, alike = shared[0]
        notes.append(f"{member} was answered for by {len(alike)} instances ({_listed(alike)}): believed "
                     + ("of neither" if len(alike) == 2 else "of none of them"))
    elif shared:
        notes.append(f"{len(shared)} ranks were answered for by several instances "
                     f"({_listed([m for m, _ in shared])}): believed of none of them")
    return refused, notes, bool(elsewhere or shared)


def _order(member: str) -> tuple[int, int]:
    kind, _, number = member.partition(" ")
    return (0 if kind == "rank" else 1, int(number) if number.isdigit() else -1)


def _ras(findings: Sequence[tuple[str, dict[str, Any]]], answered: int) -> tuple[dict[str, Any] | None, str | None]:
    """NCCL RAS sees the whole job, so one node's finding would speak for every other: a conclusive finding
    is believed when the nodes that answered with one all name the same culprits and are more than half
    of the nodes that answered; otherwise the first one stands as not conclusive, and why is said."""
    if not findings:
        return None, None
    first = findings[0][1]
    conclusive = [(i, tuple(f.get("culprits") or ())) for i, f in findings if f.get("conclusive")]
    if not conclusive:
        return first, None
    named = {c for _, c in conclusive}
    if len(named) == 1 and len(conclusive) == len(findings) and 2 * len(conclusive) > answered:
        return next(f for _, f in findings if f.get("conclusive")), None
    why = (f"the nodes' NCCL RAS findings name different culprits ({_listed([i for i, _ in conclusive])})"
           if len(named) > 1 or len(conclusive) < len(findings) else
           f"NCCL RAS's culprit comes from {len(conclusive)} of the {answered} nodes that answered")
    return {**first, "conclusive": False}, why + ": not believed"


def _decide(job: str, answered: Sequence[NodeAnswer], read: Sequence[NodeEvidence], ras: dict[str, Any] | None,
            placement: Placement, problem: str | None, notes: list[str], unheard: bool = False) -> JobVerdict:
    dumps = [d for r in read for d in r.dumps]
    ranks: list[dict[str, object]] = [row for r in read for row in r.ranks]
    traces = [t for r in read for t in r.traces]
    analysis = analyze(dumps)
    silent = [a for a in answered if not a.answered]
    decided = verdict(analysis, spans_other_nodes=bool(silent) or unheard)  # some ranks' evidence is missing
    fr = fr_matching.analyze(traces) if traces else None
    conclusive = ras is not None and bool(ras.get("conclusive"))
    ras_culprits = list((ras or {}).get("culprits") or []) if conclusive else []
    if not dumps and not traces and ras is None:
        # Nothing was read: not an all-clear. Unknown is said as unknown.
        why = problem or ("no node answered" if answered else "no node exports ranks of this job")
        decided = Verdict("unknown", None, f"Unknown: no evidence was gathered ({why})", "unknown: no evidence")
    if decided.kind == "hang":  # the nodes' stacks joined are one look: critical on evidence that spans time
        looked = [r for r in read if r.dumps]
        twice = bool(looked) and all(r.confirmed for r in looked)  # every node's own second look agreed
        if twice or (fr and (fr.culprits or fr.stuck)) or (conclusive and ras and ras.get("stuck")):
            decided = replace(decided, severity=Severity.CRITICAL, confirmed=twice)
        else:
            decided = decided.noted([ONE_LOOK])
    found = corroborations(fr, ras_culprits, str(ras.get("summary")) if ras is not None and conclusive else None)
    decided = corroborated(decided, found).noted(_silent_note(silent) + notes + _slow_note(ranks))
    where = analysis.group_by_member()
    by_member = {d.member: d for d in dumps}
    odd: list[dict[str, object]] = []
    for member in analysis.outliers:
        dump, group = by_member.get(member), where.get(member)
        if dump is None or group is None:
            continue
        odd.append({"member": member, "rank": dump.rank, "node": dump.node, "pid": dump.pid,
                    "gpus": list(dump.gpus), "instance": dump.source,
                    "activity": group.activity.name, "where": group.where})
    for row in ranks:
        group = where.get(answers.member(row["rank"], row["pid"]))
        row["activity"] = group.activity.name if group else None
        row["where"] = group.where if group else None
    return JobVerdict(job, list(answered), analysis, decided, odd, ranks, fr, ras, placement, problem)


def _slow_note(ranks: Sequence[dict[str, object]]) -> list[str]:
    """The ranks their own nodes named stragglers (a warning before any hang), slowest first: the job ran
    slower for them, which a hang's verdict is worth reading beside."""
    slow = sorted((r for r in ranks if isinstance(r.get("straggler_slowdown"), float)),
                  key=lambda r: -float(r["straggler_slowdown"]))  # type: ignore[arg-type]
    if not slow:
        return []
    said = [f"{answers.member(r['rank'], r['pid'])} on {r.get('node') or r['instance']} "
            f"({float(r['straggler_slowdown']):.2f}x)" for r in slow[:4]]  # type: ignore[arg-type]
    more = f" and {len(slow) - 4} more" if len(slow) > 4 else ""
    return [f"a straggler before it, as its node measured (the job ran this much slower for it): "
            f"{', '.join(said)}{more}"]


def _silent_note(silent: Sequence[NodeAnswer]) -> list[str]:
    """The nodes that did not answer, and those whose answer could not be read, each said as such."""
    notes = []
    for unread, said in ((False, "did not answer"), (True, "answered what cannot be read")):
        these = [a for a in silent if (a.status == 200) == unread]
        if these:
            notes.append(f"{len(these)} node{'s' if len(these) > 1 else ''} {said}: "
                         + ", ".join(f"{a.instance} ({a.error})" for a in these[:4]))
    return notes
