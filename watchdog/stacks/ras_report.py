"""A report of NCCL's RAS service (NCCL 2.24+), JSON or text, read and judged: every rank's collective
counts per communicator, the dead and the missing ranks (nccl_ras.py asks the service for it).

The JSON report (2.28.7+) lists per communicator each rank's `collective_counts` per operation, host, pid
and GPU, and the `missing_ranks`; 2.28.9 writes a missing rank without the comma before its `status`
(invalid JSON), which is repaired before parsing. The text report's MISMATCH / INCOMPLETE / DEAD sections
are read too, as are reports pasted one after another or cut to an excerpt.

A rank behind the others in an operation's count is only *stuck* when the counts are unchanged across two
reports a few seconds apart (collectives outpace RAS's gathering on a healthy job); a DEAD or missing
rank is named as such.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from watchdog.boundary import untrusted_data


class RasError(Exception):
    """The RAS service could not be asked (nothing listens, a timeout, an answer we cannot read)."""


@dataclass(frozen=True)
class RasRank:
    rank: int
    host: str = ""
    pid: int | None = None
    gpu: int | None = None
    counts: Mapping[str, int] = field(default_factory=dict)  # operation -> launched so far
    missing: bool = False
    dead: bool = False


@dataclass(frozen=True)
class RasCommunicator:
    hash: str
    size: int
    ranks: tuple[RasRank, ...]
    # op -> ((count, ranks at it), ...) as a text report says them: it lists only the outliers' ranks
    counts: Mapping[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    status_mismatch: str = ""  # "26 ranks have status UNKNOWN, 4 RUNNING, 2 FINALIZE" (text only)


@dataclass(frozen=True)
class RasStatus:
    communicators: tuple[RasCommunicator, ...]
    version: str = ""
    dead: tuple[RasRank, ...] = ()  # processes RAS declared dead (text: the DEAD section; monitor: PEER_DEAD)
    format: str = "json"
    unreached: tuple[RasRank, ...] = ()  # job processes whose communicator data is missing (text: INCOMPLETE)


MAX_OPS = 32
_MISSING_COMMA = re.compile(r'("nvml_dev":[ \t]{0,8}-?\d{1,12})([ \t\r]{0,64}\n[ \t]{0,64}"status")')


_REPORT_MARKS = re.compile(r"^\s{0,8}(?:Job summary|Communicators\.\.\.|#\d{1,12}-\d{1,12} \([0-9a-f]{1,64}\) "
                           r"(?:MISMATCH|INCOMPLETE|ERROR)|Communicator ranks have different|The missing ranks?:|"
                           r"\d{1,9} job process(?:es)? (?:is|are) considered dead|(?:\[[^\]\n]{1,40}\] )?PEER_DEAD: )",
                           re.MULTILINE)
# Where a report starts, by the first of its sections a paste kept: the version line, the job summary, the
# communicators' section.
_REPORT_STARTS = (re.compile(r"^\s{0,8}NCCL version \d", re.MULTILINE),
                  re.compile(r"^\s{0,8}Job summary\s*$", re.MULTILINE),
                  re.compile(r"^\s{0,8}Communicators\.\.\.", re.MULTILINE))


def looks_like_report(text: str) -> bool:
    """Whether a text holds a RAS report, or an excerpt of one (a section without the header, a monitor line)."""
    return _REPORT_MARKS.search(text) is not None


def parse(text: str) -> RasStatus:
    """A RAS report, JSON or text, told apart by its first character. Whatever the reply holds (it comes
    from a port on the node, which any process may hold), the result is a status or a RasError."""
    try:
        if text.lstrip().startswith("{"):
            return _parse_json(text)
        return _parse_text(textwrap.dedent(text))
    except (ValueError, TypeError, AttributeError, KeyError, OverflowError, RecursionError) as exc:
        raise RasError(f"a RAS report of the wrong shape ({type(exc).__name__})") from None


def parse_all(text: str) -> list[RasStatus]:
    """Every report in a text, in order: reports pasted one after another (each from its `NCCL version` or
    `Job summary` line), or one report or excerpt."""
    starts: list[int] = []
    for start in _REPORT_STARTS:
        starts = [m.start() for m in start.finditer(text)]
        if starts:
            break
    if len(starts) < 2 or text.lstrip().startswith("{"):
        return [parse(text)]
    pieces = [text[a:b] for a, b in zip([0, *starts[1:]], [*starts[1:], len(text)])]
    return [parse(piece) for piece in pieces if looks_like_report(piece)]


def _parse_json(text: str) -> RasStatus:
    try:
        data = untrusted_data.loads_json(text, "the RAS report")
    except untrusted_data.TooMuchData as exc:
        raise RasError(str(exc)) from None
    except json.JSONDecodeError:
        try:  # NCCL 2.28.9: a missing rank's "nvml_dev" line lacks its comma
            data = json.loads(_MISSING_COMMA.sub(r"\1,\2", text))
        except json.JSONDecodeError as exc:
            raise RasError(f"RAS JSON line {exc.lineno}: {exc.msg[:80]}") from None
    if isinstance(data, dict) and data.get("event") == "PEER_DEAD" and isinstance(data.get("peer"), dict):
        peer = data["peer"]  # the monitor's event (2.29+): a process and its GPUs, no rank
        gpus = peer.get("nvml_devs") or peer.get("cuda_devs") or [None]
        pid = peer.get("pid")
        return RasStatus((), format="monitor", dead=(RasRank(-1, _word(peer.get("host", "")),
                                                            _count(pid) if isinstance(pid, int) else None,
                                                            _count(gpus[0]) if isinstance(gpus[0], int) else None,
                                                            dead=True),))
    if not isinstance(data, dict) or not isinstance(data.get("communicators"), list):
        raise RasError("RAS JSON without a `communicators` list")
    comms = []
    for comm in data["communicators"]:
        if not isinstance(comm, dict):
            continue
        ranks = [_json_rank(r, missing=False) for r in comm.get("ranks") or [] if isinstance(r, dict)]
        ranks += [_json_rank(r, missing=True) for r in comm.get("missing_ranks") or [] if isinstance(r, dict)]
        size = comm.get("size")
        comms.append(RasCommunicator(_word(comm.get("hash", "")), _count(size) if size else len(ranks),
                                     tuple(sorted(ranks, key=lambda r: r.rank))))
    return RasStatus(tuple(comms), _word(data.get("nccl_version", "")), format="json")


def _count(value: object) -> int:
    """A count from a reply: a non-negative integer within 64 bits, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise ValueError("count")
    return value


def _word(value: object) -> str:
    """Text from a reply that reaches a verdict sentence: printable, short, no markup."""
    text = value if isinstance(value, str) else str(value) if isinstance(value, int) else ""
    return "".join(c for c in text[:64] if c.isalnum() or c in ".-_:")


def _json_rank(raw: Mapping[str, Any], missing: bool) -> RasRank:
    status: Mapping[str, Any] = raw["status"] if isinstance(raw.get("status"), dict) else {}
    counts: Mapping[str, Any] = raw["collective_counts"] if isinstance(raw.get("collective_counts"), dict) else {}
    pid, gpu, rank = raw.get("pid"), raw.get("nvml_dev", raw.get("cuda_dev")), raw.get("rank")
    return RasRank(_count(rank) if isinstance(rank, int) else -1, _word(raw.get("host", "")),
                   _count(pid) if isinstance(pid, int) and pid >= 0 else None,
                   _count(gpu) if isinstance(gpu, int) else None,
                   {_word(k): _count(v) for k, v in list(counts.items())[:64] if isinstance(v, int)}, missing,
                   bool(status.get("considered_dead")))


# Every repetition bounded, and lines cut at MAX_LINE before matching: no reply makes a pattern backtrack
# for long (an unbounded `\d+\S*` over a line of digits is quadratic).
MAX_LINE = 4096
_COMM_HEAD = re.compile(r"^#\d{1,12}-\d{1,12} \((?P<hash>[0-9a-f]{1,64})\) (?P<kind>\w{1,32})")
_OP_HEAD = re.compile(r"^\s{1,32}Communicator ranks have different (?:(?P<op>\w{1,40}) )?operation counts")
_COUNT_GROUP = re.compile(r"^\s{1,32}(?P<n>\d{1,9}) ranks have (?:launched up to operation (?P<v>\d{1,18})|"
                          r"not launched any)")
_RANK_LINE = re.compile(r"^\s{1,32}Rank (?P<rank>\d{1,9})(?: has (?:launched up to operation (?P<v>\d{1,18})|not "
                        r"launched any operations))? -- (?:GPU (?P<gpu>\d{1,6})\S{0,64}(?: \(NVML "
                        r"(?P<nvml>\d{1,6})\))? managed by process (?P<pid>\d{1,9}) on node (?P<host>\S{1,255})|"
                        r"\[process information not found\])")
_PROCESS_LINE = re.compile(r"^\s{1,32}Process (?P<pid>\d{1,9}) on node (?P<host>\S{1,255}) managing GPUs? "
                           r"(?P<gpu>\d{1,6})")
_MISSING_RANK = re.compile(r"^\s{1,32}The missing ranks?: (?P<ranks>\d{1,9}(?:,\s?\d{1,9}){0,4095})")
_STATUS_GROUP = re.compile(r"^\s{1,32}(?P<n>\d{1,9}) ranks have status (?P<status>\w{1,20})")
_PEER_DEAD = re.compile(r"PEER_DEAD: Process (?P<pid>\d{1,9}) on node (?P<host>\S{1,255}) managing GPUs? "
                        r"(?P<gpu>\d{1,6})")


def _parse_text(text: str) -> RasStatus:
    """The text report: only what it names. Per MISMATCH'd communicator and operation, the ranks it lists
    with their counts (an outlier group's members follow its 'N ranks have launched up to operation V'
    line, or carry their own count); per INCOMPLETE communicator, its missing ranks; the DEAD processes."""
    if not looks_like_report(text) and "Communicators" not in text and "RAS" not in text:
        raise RasError("not a RAS report (no 'Job summary' or 'Communicators' section)")
    comms: dict[str, dict[int, RasRank]] = {}
    groups: dict[str, dict[str, list[tuple[int, int]]]] = {}
    statuses: dict[str, list[str]] = {}
    dead: list[RasRank] = []
    unreached: list[RasRank] = []
    section = current = op = ""
    value: int | None = None
    for line in text.splitlines():
        line = line[:MAX_LINE]
        head = _COMM_HEAD.match(line)
        if head:
            current, section, op, value = head["hash"], head["kind"], "", None
            comms.setdefault(current, {})
            continue
        if line.strip() in ("DEAD", "INCOMPLETE", "TIMEOUT", "Errors", "Warnings"):
            section, current = line.strip(), ""
            continue
        if m := _PEER_DEAD.search(line):
            dead.append(RasRank(-1, _word(m["host"]), int(m["pid"]), int(m["gpu"]), dead=True))
            continue
        if section in ("DEAD", "INCOMPLETE") and not current and (m := _PROCESS_LINE.match(line)):
            found = RasRank(-1, _word(m["host"]), int(m["pid"]), int(m["gpu"]), dead=section == "DEAD")
            (dead if section == "DEAD" else unreached).append(found)
            continue
        if not current:
            continue
        if m := _OP_HEAD.match(line):
            op, value = m["op"] or "Collectives", None
        elif m := _STATUS_GROUP.match(line):
            statuses.setdefault(current, []).append(f"{m['n']} {m['status']}")
            op, value = "", None
        elif m := _COUNT_GROUP.match(line):
            value = int(m["v"] or 0)
            if op:
                groups.setdefault(current, {}).setdefault(op, []).append((value, int(m["n"])))
        elif m := _MISSING_RANK.match(line):
            for rank in (int(r) for r in m["ranks"].split(",")):
                comms[current][rank] = RasRank(rank, missing=True)
        elif (m := _RANK_LINE.match(line)) and not op and "INCOMPLETE" in section:
            # 2.26+: an INCOMPLETE communicator lists its missing ranks one per line
            rank = int(m["rank"])
            comms[current][rank] = RasRank(rank, _word(m["host"] or ""), int(m["pid"]) if m["pid"] else None,
                                           int(m["nvml"] or m["gpu"]) if m["gpu"] else None, missing=True)
        elif (m := _RANK_LINE.match(line)) and op:
            rank = int(m["rank"])
            count = int(m["v"]) if m["v"] else (0 if "not launched" in line else value)
            known = comms[current].get(rank) or RasRank(rank, _word(m["host"] or ""),
                                                        int(m["pid"]) if m["pid"] else None,
                                                        int(m["nvml"] or m["gpu"]) if m["gpu"] else None)
            counts = dict(known.counts)
            if count is not None:
                counts[op] = count
            comms[current][rank] = RasRank(rank, known.host, known.pid, known.gpu, counts, known.missing)
    communicators = tuple(RasCommunicator(h, len(r), tuple(sorted(r.values(), key=lambda x: x.rank)),
                                          {op: tuple(v) for op, v in groups.get(h, {}).items()},
                                          ", ".join(statuses.get(h, [])))
                          for h, r in comms.items())
    return RasStatus(communicators, dead=tuple(dead), format="text", unreached=tuple(unreached))


# -- judging -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Behind:
    rank: RasRank
    op: str
    by: int  # operations behind the others (ahead of them, where `ahead`)
    others: int  # how many ranks are ahead (behind, where `ahead`)
    ahead: bool = False  # one of the few that launched operations the many have not

    def sentence(self) -> str:
        where = f" on {self.rank.host}" if self.rank.host else ""
        side = "ahead of" if self.ahead else "behind"
        them = f"the other {self.others}" if self.others else "the others"
        return (f"rank {self.rank.rank}{where} is {self.by} {self.op} {side} {them}"
                + (" (it waits in an operation they have not launched)" if self.ahead else "")
                + (f" (pid {self.rank.pid}, GPU {self.rank.gpu})" if self.rank.pid is not None else ""))


@dataclass(frozen=True)
class RasFinding:
    stuck: bool  # counts unchanged across the two queries while some rank is behind
    behind: tuple[Behind, ...]
    missing: tuple[RasRank, ...]
    dead: tuple[RasRank, ...]
    queries: int
    version: str = ""
    problem: str | None = None
    unreached: tuple[RasRank, ...] = ()  # job processes that sent no communicator data (no rank known)
    status_mismatch: str = ""
    moving: bool = False  # two reports, and the counts moved between them: the job makes progress

    @property
    def culprits(self) -> tuple[int, ...]:
        return tuple(sorted({b.rank.rank for b in self.behind} | {r.rank for r in self.missing + self.dead
                                                                    if r.rank >= 0}))

    @property
    def conclusive(self) -> bool:
        """Names a rank the job waits on: behind in both queries, or dead, or missing."""
        return bool(self.culprits) and (self.stuck or bool(self.dead) or bool(self.missing))

    @property
    def broken(self) -> bool:
        """A process RAS declared dead or could not reach, or a rank missing: the job cannot go on as it is."""
        return bool(self.dead or self.missing or self.unreached)

    @property
    def summary(self) -> str:
        if self.problem:
            return f"NCCL RAS: {self.problem}"
        parts = [b.sentence() for b in self.behind[:4]]
        if len(self.behind) > 4:
            parts.append(f"and {len(self.behind) - 4} more ranks: "
                         + ", ".join(str(b.rank.rank) for b in self.behind[4:64]))
        parts += [f"rank {r.rank}{' on ' + r.host if r.host else ''} is missing (RAS cannot reach it)"
                  for r in self.missing[:4]]
        parts += [f"rank {r.rank}{' on ' + r.host if r.host else ''} is dead" if r.rank >= 0
                  else f"process {r.pid} on {r.host} (GPU {r.gpu}) is dead" for r in self.dead[:4]]
        parts += [f"process {r.pid} on {r.host} (GPU {r.gpu}) sent no communicator data" for r in self.unreached[:4]]
        if self.status_mismatch:
            parts.append(f"ranks differ in status ({self.status_mismatch})")
        reports = "two reports" if self.queries > 1 else "one report"
        if not parts:
            return f"NCCL RAS ({reports}): every rank has launched the same collectives"
        tail = "" if self.stuck or not self.behind else (
            " (still moving between the two queries: not stuck)" if self.queries > 1 else
            " (one report: a stuck rank and a slow one look the same)")
        return "NCCL RAS: " + "; ".join(parts) + tail

    def to_json(self) -> dict[str, object]:
        def rank(r: RasRank) -> dict[str, object]:
            return {"rank": r.rank, "host": r.host, "pid": r.pid, "gpu": r.gpu, "dead": r.dead}

        return {"stuck": self.stuck, "conclusive": self.conclusive, "queries": self.queries,
                "nccl_version": self.version, "problem": self.problem, "summary": self.summary,
                "culprits": list(self.culprits),
                "behind": [{**rank(b.rank), "op": b.op, "by": b.by, "others": b.others} for b in self.behind],
                "missing": [rank(r) for r in self.missing], "dead": [rank(r) for r in self.dead],
                "unreached": [rank(r) for r in self.unreached], "status_mismatch": self.status_mismatch,
                "moving": self.moving}


def behind(status: RasStatus) -> list[Behind]:
    """Per communicator and operation, the odd ranks: those whose count is below the top one, or, where the few
    at the top count are fewer than the ranks below it, those few (ahead: they wait in an operation the many
    never launched)."""
    found: dict[int, Behind] = {}
    for comm in status.communicators:
        present = [r for r in comm.ranks if not r.missing]
        ops = {op for r in present for op in r.counts}
        for op in sorted(ops)[:MAX_OPS]:  # NCCL has a handful of operations; a reply may claim thousands
            counts = Counter(r.counts[op] for r in present if op in r.counts)
            for value, n in comm.counts.get(op, ()):  # a text report's groups: their ranks are not all listed
                counts[value] = max(counts[value], n)
            if len(counts) < 2:
                continue
            top = max(counts)
            below = sum(n for value, n in counts.items() if value < top)
            lead = max(value for value in counts if value < top)
            if counts[top] < below and all(r.counts[op] == top for r in present if op in r.counts):
                for r in present:  # only the few ahead are listed: they are the odd ones
                    found.setdefault(r.rank, Behind(r, op, top - lead, below, ahead=True))
                continue
            for r in present:
                if op in r.counts and r.counts[op] < top:
                    gap = top - r.counts[op]
                    if r.rank not in found or found[r.rank].by < gap:
                        found[r.rank] = Behind(r, op, gap, counts[top])
    return sorted(found.values(), key=lambda b: b.rank.rank)


def judge(first: RasStatus, second: RasStatus | None) -> RasFinding:
    """Two reports a few seconds apart: ranks behind in both with unchanged counts are stuck."""
    latest = second or first
    lagging = behind(latest)
    same = second is not None and _counts(first) == _counts(second)
    stuck = bool(lagging) and same
    # A rank missing from either report (the later one may no longer list the communicator at all)
    missing = tuple({r.rank: r for status in (first, latest) for c in status.communicators for r in c.ranks
                     if r.missing}.values())
    dead = tuple({(r.host, r.pid, r.rank): r for r in [*first.dead, *latest.dead, *(m for m in missing if m.dead)]
                  }.values())
    unreached = tuple({(r.host, r.pid): r for r in [*first.unreached, *latest.unreached]}.values())
    moving = second is not None and not same and any(c.ranks and any(r.counts for r in c.ranks)
                                                     for c in latest.communicators)
    status = "; ".join(c.status_mismatch for c in latest.communicators if c.status_mismatch)
    return RasFinding(stuck, tuple(lagging), tuple(m for m in missing if not m.dead), dead,
                      2 if second is not None else 1, latest.version, unreached=unreached, status_mismatch=status,
                      moving=moving)


def _counts(status: RasStatus) -> dict[tuple[str, int], Mapping[str, int]]:
    return {(c.hash, r.rank): r.counts for c in status.communicators for r in c.ranks}


