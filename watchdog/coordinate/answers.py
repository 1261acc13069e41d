"""A node's /v1/dump answer read at the edge: one training job's ranks, stacks, Flight Recorder traces and
NCCL RAS finding as typed values, or one MalformedAnswer saying where the answer is not what a daemon
writes (that node's evidence is then left out, never the job verdict's).

What an answer says is that node's claim: its name, and the ranks it answers for. Who may speak for
which rank is decided where the answers meet (job_verdict.py); here each piece is only read and bounded.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from watchdog.stacks.formats import parse_pyspy_json
from watchdog.stacks.fr_dumps import FlightRecorderError, RankTrace, SharedGroups
from watchdog.vocabulary.stack_model import StackDump

MAX_NODE_NAME = 253  # a host name's length
MAX_TEXT = 300
MAX_PATH = 4096  # the node's bundle path (Linux's PATH_MAX)
MAX_RAS_SUMMARY = 16 * 1024  # RasFinding.summary: a few sentences of at most 4 ranks each, and 60 rank numbers
MAX_SLOWDOWN = 100.0  # a straggler's slowdown a node may say (the rule caps its own at 20x)
MAX_RAS_CULPRITS = 4096  # the culprits kept of a RAS finding (in rank order); RAS's own summary counts the rest


class MalformedAnswer(ValueError):
    """Where an answer departs from what a daemon writes (a key path and what was found there)."""


@dataclass
class NodeEvidence:
    """What the job verdict reads of one node's answer. `node`: the name the answer gives itself (a claim);
    `bundle`: where it kept its own evidence (a path on that node); `problem`: why nothing of it is read (a
    malformed answer)."""

    node: str | None = None
    bundle: str | None = None
    dumps: list[StackDump] = field(default_factory=list)
    ranks: list[dict[str, object]] = field(default_factory=list)  # rank, pid, gpus, capture
    traces: list[RankTrace] = field(default_factory=list)
    ras: dict[str, Any] | None = None
    confirmed: bool = False  # the node's own verdict of the job: a hang two looks agreed on (stacks/confirm.py)
    problem: str | None = None

    def members(self) -> set[str]:
        """Every rank (or rank-less pid) this answer speaks for, by its stacks, rows or traces."""
        return ({d.member for d in self.dumps} | {member(r["rank"], r["pid"]) for r in self.ranks}
                | {f"rank {t.rank}" for t in self.traces})

    def without(self, refused: set[str], node: str) -> NodeEvidence:
        """Only what it may speak for (`refused` left out), each piece named with the node's `node` name."""
        return replace(self, dumps=[d if d.node == node else replace(d, node=node) for d in self.dumps
                                    if d.member not in refused],
                       ranks=[{**r, "node": node} for r in self.ranks if member(r["rank"], r["pid"]) not in refused],
                       traces=[t if t.node == node else replace(t, node=node) for t in self.traces
                               if f"rank {t.rank}" not in refused])


def member(rank: object, pid: object) -> str:
    return f"rank {rank}" if rank is not None else f"pid {pid}"


def read(job: str, body: object, instance: str, groups: SharedGroups) -> NodeEvidence:
    """The evidence of `job` in one answer's parsed body, or, malformed, its problem alone."""
    try:
        return _read(job, body, instance, groups)
    except MalformedAnswer as exc:
        return NodeEvidence(problem=f"a malformed answer: {exc}")


def _kind(value: object) -> str:
    names = {dict: "an object", list: "a list", str: "text", bool: "true/false", type(None): "null"}
    return names.get(type(value), "a number")


def _expected(path: str, what: str, value: object) -> MalformedAnswer:
    return MalformedAnswer(f"{path}: expected {what}, got {_kind(value)}")


def _optional(value: object, kind: type, path: str, what: str) -> Any:
    if value is not None and not isinstance(value, kind):
        raise _expected(path, what, value)
    return value


def _number(value: object, path: str, limit: int) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < limit:
        raise _expected(path, f"a number from 0 to {limit - 1}", value)
    return value


def _ratio(value: object, path: str, low: float, high: float) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise _expected(path, f"a number from {low:g} to {high:g}", value)
    return float(value)


def _text(value: object, path: str, limit: int = MAX_TEXT) -> str | None:
    text = _optional(value, str, path, "text")
    if text is not None and (len(text) > limit or not text.isprintable()):
        raise MalformedAnswer(f"{path}: expected printable text of at most {limit} characters")
    return text


def _read(job: str, body: object, instance: str, groups: SharedGroups) -> NodeEvidence:
    if not isinstance(body, dict):
        raise _expected("the answer", "an object", body)
    found = NodeEvidence(node=_text(body.get("node"), "node", MAX_NODE_NAME) or None,
                         bundle=_text(body.get("bundle"), "bundle", MAX_PATH) or None)
    for j, picture in enumerate(_optional(body.get("jobs"), list, "jobs", "a list") or []):
        where = f"jobs[{j}]"
        if not isinstance(picture, dict):
            raise _expected(where, "an object", picture)
        if _optional(picture.get("training_job"), str, f"{where}.training_job", "text") != job:
            continue
        for n, rank in enumerate(_optional(picture.get("ranks"), list, f"{where}.ranks", "a list") or []):
            _rank(rank, f"{where}.ranks[{n}]", instance, found)
        traces = _optional(picture.get("flight_recorder_traces"), list, f"{where}.flight_recorder_traces", "a list")
        for raw in traces or []:
            try:  # a trace has its own edge (fr_dumps): one of the wrong shape is left out alone
                found.traces.append(RankTrace.for_matching(raw, "", groups))
            except FlightRecorderError:
                continue
        said = _optional(picture.get("verdict"), dict, f"{where}.verdict", "an object") or {}
        found.confirmed = found.confirmed or bool(
            _optional(said.get("confirmed"), bool, f"{where}.verdict.confirmed", "true/false"))
        ras = _ras(picture.get("nccl_ras"), f"{where}.nccl_ras")
        if found.ras is None and ras is not None and not ras.get("problem"):
            found.ras = ras
    return found


def _rank(rank: object, path: str, instance: str, found: NodeEvidence) -> None:
    if not isinstance(rank, dict):
        raise _expected(path, "an object", rank)
    number = _number(rank.get("rank"), f"{path}.rank", 2**31)
    pid = _number(rank.get("pid"), f"{path}.pid", 2**32)
    gpus = tuple(_number(g, f"{path}.gpus[{i}]", 2**16) for i, g in
                 enumerate(_optional(rank.get("gpus"), list, f"{path}.gpus", "a list") or []))
    capture = _text(rank.get("capture"), f"{path}.capture")
    threads = _optional(rank.get("threads"), list, f"{path}.threads", "a list")
    kept = tuple(g for g in gpus if g is not None)
    for dump in parse_pyspy_json(threads or [], instance, number, kept):
        found.dumps.append(dump)
    row: dict[str, object] = {"rank": number, "instance": instance, "pid": pid, "gpus": list(kept), "capture": capture}
    for name, low, high in (("wait_ratio", 0.0, 1.0), ("straggler_slowdown", 1.0, MAX_SLOWDOWN)):  # its pace
        value = _ratio(rank.get(name), f"{path}.{name}", low, high)
        if value is not None:
            row[name] = value
    found.ranks.append(row)


def _ras(ras: object, path: str) -> dict[str, Any] | None:
    """The RAS finding as the daemon wrote it (RasFinding.to_json), reduced to what the verdict and its
    readers use, each field checked and bounded: a node's other keys and the per-rank lists (its summary says
    them) are not kept in every verdict."""
    if ras is None:
        return None
    if not isinstance(ras, dict):
        raise _expected(path, "an object", ras)
    culprits = []
    for i, rank in enumerate(_optional(ras.get("culprits"), list, f"{path}.culprits", "a list") or []):
        if _number(rank, f"{path}.culprits[{i}]", 2**31) is None:
            raise _expected(f"{path}.culprits[{i}]", "a rank", rank)
        culprits.append(rank)
    found = {"conclusive": _optional(ras.get("conclusive"), bool, f"{path}.conclusive", "true/false") or False,
             "culprits": culprits[:MAX_RAS_CULPRITS],
             "summary": _text(ras.get("summary"), f"{path}.summary", MAX_RAS_SUMMARY),
             "stuck": _optional(ras.get("stuck"), bool, f"{path}.stuck", "true/false") or False,
             "moving": _optional(ras.get("moving"), bool, f"{path}.moving", "true/false") or False,
             "queries": _number(ras.get("queries"), f"{path}.queries", 2**16),
             "nccl_version": _text(ras.get("nccl_version"), f"{path}.nccl_version")}
    if _text(ras.get("problem"), f"{path}.problem", MAX_RAS_SUMMARY):
        found["problem"] = ras["problem"]
    return found
