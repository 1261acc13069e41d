"""One verdict for a job that spans nodes, from every node's /v1/dump answer.

The ranks' raw py-spy threads from all nodes are analysed together (the same grouping and verdict as
on one node), so the odd rank is found across the job and named with its node, pid, GPU and activity.
The Flight Recorder dumps of all nodes are matched together; NCCL RAS already sees the whole job, so
the first node's finding that is not a failure stands for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from watchdog.model import StackDump, Verdict
from watchdog.stacks import fr_dumps
from watchdog.stacks.analysis import Analysis, analyze
from watchdog.stacks.formats import parse_pyspy_json
from watchdog.stacks.fr_dumps import FlightRecorderAnalysis, FlightRecorderError, RankTrace
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


def merge(job: str, answers: Sequence[NodeAnswer], instances: Sequence[str] = (),
          problem: str | None = None) -> JobVerdict:
    dumps: list[StackDump] = []
    ranks: list[dict[str, object]] = []
    traces: list[RankTrace] = []
    ras: dict[str, Any] | None = None
    for answer in answers:
        if not answer.answered:
            continue
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
                        dumps.append(StackDump(dump.member, dump.threads, dump.pid, dump.rank, dump.gpus,
                                               dump.source, dump.count, node))
                ranks.append({"rank": number, "node": node, "instance": answer.instance, "pid": rank.get("pid"),
                              "gpus": list(gpus), "capture": rank.get("capture")})
            for raw in picture.get("flight_recorder_traces") or []:
                try:
                    traces.append(RankTrace.from_json(raw, node))
                except FlightRecorderError:
                    continue
            found = picture.get("nccl_ras")
            if ras is None and isinstance(found, dict) and not found.get("problem"):
                ras = found
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
        found, group = by_member.get(member), where.get(member)
        if found is None or group is None:
            continue
        odd.append({"member": member, "rank": found.rank, "node": found.node, "pid": found.pid,
                    "gpus": list(found.gpus), "instance": instance_of.get((found.node, found.pid)),
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
