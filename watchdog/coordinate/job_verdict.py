"""One verdict for a job that spans nodes, from every node's /v1/dump answer.

The ranks' raw py-spy threads from all nodes are analysed together (the same grouping and verdict as
on one node), so the odd rank is found across the job and named with its node, pid, GPU and activity.
The Flight Recorder dumps of all nodes are matched together; NCCL RAS already sees the whole job, so
the first node's finding that is not a failure stands for it.

The answers of a thousand nodes are hundreds of MB parsed: JobEvidence reads each one as it arrives into
what the verdict needs, so they are never all held at once.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from watchdog.model import StackDump, Verdict
from watchdog.stacks import fr_dumps
from watchdog.stacks.analysis import Analysis, analyze
from watchdog.stacks.formats import parse_pyspy_json
from watchdog.stacks.fr_dumps import FlightRecorderAnalysis, FlightRecorderError, RankTrace, SharedGroups
from watchdog.stacks.picture import corroborated, corroborations, with_notes
from watchdog.stacks.verdict import verdict

from .nodes import NodeAnswer


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
    instances: list[str] = field(default_factory=list)
    problem: str | None = None  # Prometheus could not be asked
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
                                  "problem": self.problem}
        out.update(self.analysis.to_json())
        if self.fr is not None:
            out["flight_recorder"] = self.fr.to_json()
        if self.ras is not None:
            out["nccl_ras"] = self.ras
        return out


def _node_name(answer: NodeAnswer) -> str:
    return str(answer.body.get("node") or answer.instance)


MAX_BUNDLE_BYTES = 64 * 2**20  # one job bundle: node answers past it are neither kept nor written, and said so


@dataclass
class _NodeEvidence:
    dumps: list[StackDump] = field(default_factory=list)
    ranks: list[dict[str, object]] = field(default_factory=list)
    traces: list[RankTrace] = field(default_factory=list)
    ras: dict[str, Any] | None = None


class JobEvidence:
    """What the job verdict needs of each node's answer, read as each answer arrives: the job's ranks and
    their stacks, the Flight Recorder traces as matching reads them (a process group's rank list, which
    every rank of the job repeats, read and kept once) and NCCL RAS. `keep` then drops the parsed answer;
    its bytes as they came stay for the bundle while `keep_bytes` (the bundle's budget) allows."""

    def __init__(self, job: str, keep_bytes: int = MAX_BUNDLE_BYTES):
        self.job = job
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._read: dict[str, list[_NodeEvidence]] = {}  # by instance, in the order read
        self._groups: SharedGroups = {}
        self._kept = 0

    def add(self, answer: NodeAnswer) -> None:
        found = _NodeEvidence()
        with self._lock:
            if answer.answered:
                _read_answer(self.job, answer, found, self._groups)
            self._read.setdefault(answer.instance, []).append(found)

    def keep(self, answer: NodeAnswer) -> NodeAnswer:
        """`add`, then the answer without its parsed body (its node-level fields stay), with its bytes as
        they came while the answers kept are within `keep_bytes` (the bundle could not hold more)."""
        self.add(answer)
        with self._lock:
            raw = answer.raw if answer.raw is not None and self._kept + len(answer.raw) <= self.keep_bytes else None
            self._kept += len(raw or b"")
        return replace(answer, body={k: v for k, v in answer.body.items() if k != "jobs"}, raw=raw)

    def verdict(self, answers: Sequence[NodeAnswer], instances: Sequence[str] = (),
                problem: str | None = None) -> JobVerdict:
        """The job verdict from the answers read (in the answers' order, whatever order they came in)."""
        taken: dict[str, int] = {}
        read = []
        for answer in answers:
            n = taken[answer.instance] = taken.get(answer.instance, -1) + 1
            found = self._read.get(answer.instance, [])
            read.append(found[n] if n < len(found) else _NodeEvidence())
        dumps = [d for r in read for d in r.dumps]
        ranks = [row for r in read for row in r.ranks]
        traces = [t for r in read for t in r.traces]
        ras = next((r.ras for r in read if r.ras is not None), None)
        return _decide(self.job, answers, dumps, ranks, traces, ras, instances, problem)


def merge(job: str, answers: Sequence[NodeAnswer], instances: Sequence[str] = (),
          problem: str | None = None) -> JobVerdict:
    evidence = JobEvidence(job)
    for answer in answers:
        evidence.add(answer)
    return evidence.verdict(answers, instances, problem)


def _read_answer(job: str, answer: NodeAnswer, found: _NodeEvidence, groups: SharedGroups) -> None:
    node = _node_name(answer)
    for picture in answer.body.get("jobs") or []:
        if not isinstance(picture, dict) or picture.get("training_job") != job:
            continue
        for rank in picture.get("ranks") or []:
            if not isinstance(rank, dict):
                continue
            gpus = tuple(g for g in rank.get("gpus") or [] if isinstance(g, int))
            number = rank.get("rank") if isinstance(rank.get("rank"), int) else None
            threads = rank.get("threads")
            if isinstance(threads, list) and threads:
                for dump in parse_pyspy_json(threads, answer.instance, number, gpus):
                    found.dumps.append(StackDump(dump.member, dump.threads, dump.pid, dump.rank, dump.gpus,
                                                 dump.source, dump.count, node))
            found.ranks.append({"rank": number, "node": node, "instance": answer.instance, "pid": rank.get("pid"),
                                "gpus": list(gpus), "capture": rank.get("capture")})
        for raw in picture.get("flight_recorder_traces") or []:
            try:
                found.traces.append(RankTrace.for_matching(raw, node, groups))
            except FlightRecorderError:
                continue
        ras = picture.get("nccl_ras")
        if found.ras is None and isinstance(ras, dict) and not ras.get("problem"):
            found.ras = ras


def _decide(job: str, answers: Sequence[NodeAnswer], dumps: list[StackDump], ranks: list[dict[str, object]],
            traces: list[RankTrace], ras: dict[str, Any] | None, instances: Sequence[str],
            problem: str | None) -> JobVerdict:
    analysis = analyze(dumps)
    silent = [a for a in answers if not a.answered]
    decided = verdict(analysis, spans_other_nodes=bool(silent))
    fr = fr_dumps.analyze(traces) if traces else None
    conclusive = ras is not None and bool(ras.get("conclusive"))
    ras_culprits = [r for r in (ras or {}).get("culprits") or [] if isinstance(r, int)] if conclusive else []
    if not dumps and not traces and ras is None:
        # Nothing was read: not an all-clear. Unknown is said as unknown.
        why = problem or ("no node answered" if answers else "no node exports ranks of this job")
        decided = Verdict("unknown", None, f"Unknown: no evidence was gathered ({why})", "unknown: no evidence")
    found = corroborations(fr, ras_culprits, str(ras.get("summary")) if ras is not None and conclusive else None)
    decided = with_notes(corroborated(decided, found), _silent_note(silent))
    where = analysis.group_by_member()
    by_member = {d.member: d for d in dumps}
    instance_of = {(r["node"], r["pid"]): r["instance"] for r in ranks}
    odd = []
    for member in analysis.outliers:
        dump, group = by_member.get(member), where.get(member)
        if dump is None or group is None:
            continue
        odd.append({"member": member, "rank": dump.rank, "node": dump.node, "pid": dump.pid,
                    "gpus": list(dump.gpus), "instance": instance_of.get((dump.node, dump.pid)),
                    "activity": group.activity.name, "where": group.where})
    for row in ranks:
        member = f"rank {row['rank']}" if row["rank"] is not None else f"pid {row['pid']}"
        group = where.get(member)
        row["activity"] = group.activity.name if group else None
        row["where"] = group.where if group else None
    return JobVerdict(job, list(answers), analysis, decided, odd, ranks, fr, ras, list(instances), problem)


def _silent_note(silent: Sequence[NodeAnswer]) -> list[str]:
    if not silent:
        return []
    return [f"{len(silent)} node{'s' if len(silent) > 1 else ''} did not answer: "
            + ", ".join(f"{a.instance} ({a.error})" for a in silent[:4])]
