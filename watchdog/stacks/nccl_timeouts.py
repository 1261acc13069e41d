"""PyTorch's NCCL watchdog timeout logs, the most common artefact a hang leaves behind, read into suspects.

When a collective outlives its timeout, every rank's ProcessGroupNCCL watchdog logs (PyTorch 1.13 to 2.x):

    [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=808, OpType=ALLREDUCE,
        NumelIn=9801523, NumelOut=9801523, Timeout(ms)=600000) ran for 600020 milliseconds before timing out.
    [PG ID 0 PG GUID 0(default_pg) Rank 1] Exception (either an error or timeout) detected by watchdog at
        work: 808, last enqueued NCCL work: 811, last completed NCCL work: 807.

(older: `[Rank 0] Timeout at NCCL work: 808, last enqueued NCCL work: 811, last completed NCCL work: 807.`),
and with TORCH_NCCL_DESYNC_DEBUG=1 a report naming the lagging ranks:

     - [0] Timeout at collective: ALLREDUCE, #3
     - To our best knowledge, the lagging/dead/mismatched ranks that caused the desync are:
         [1] finished collective #2, but didn't join collective #3 (count from 1)

Per process group, a rank whose timed-out work is behind the others' (a lower sequence number, or fewer
works completed) is a suspect: the others wait for it. When every rank that logged is at the same work,
no rank is behind by sequence number: a rank that logged nothing is the first suspect, and otherwise the
transport (network interface, InfiniBand, P2P) is the usual cause; the doctor checks those settings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_TAG = r"\[(?:(?P<pg>PG[^\]\n]{0,80}?) )?Rank (?P<rank>\d{1,7})\]"
_CAUGHT = re.compile(_TAG + r" Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(?P<seq>\d{1,12}), "
                     r"OpType=(?P<op>\w{1,40})(?P<rest>(?:[^()\n]|\(ms\)){0,200})\)"
                     r"(?: ran for (?P<ran>\d{1,12}) milliseconds)?")
_TIMEOUT_MS = re.compile(r"Timeout\(ms\)=(\d{1,12})")
_DETECTED = re.compile(_TAG + r" (?:Exception \(either an error or timeout\) detected by watchdog at work|"
                       r"Timeout at NCCL work): (?P<seq>\d{1,12}), last enqueued NCCL work: (?P<enq>-?\d{1,12}), "
                       r"last completed NCCL work: (?P<done>-?\d{1,12})")
_DESYNC_AT = re.compile(r"\[(?P<rank>\d{1,7})\] Timeout at collective: (?P<op>\w{1,40}), #(?P<seq>\d{1,12})")
_DESYNC_LAG = re.compile(r"^\s*\[(?P<rank>\d{1,7})\] (?P<what>[^\n]{0,200}?collective #\d{1,12}[^\n]{0,80})$")
MARKERS = ("Watchdog caught collective operation timeout", "detected by watchdog at work", "Timeout at NCCL work",
           "Timeout at collective:")


def looks_like_timeout_log(text: str) -> bool:
    return any(marker in text for marker in MARKERS)


@dataclass
class RankTimeout:
    """One rank's timed-out work, merged from its watchdog lines."""

    rank: int
    seq: int
    group: str = ""
    op: str | None = None
    timeout_ms: int | None = None
    ran_ms: int | None = None
    last_enqueued: int | None = None
    last_completed: int | None = None


@dataclass(frozen=True)
class TimeoutFinding:
    events: tuple[RankTimeout, ...]
    behind: dict[int, str] = field(default_factory=dict)  # rank -> why it is a suspect
    silent: tuple[int, ...] = ()  # ranks below the highest that logged nothing
    same_work: bool = False  # every rank that logged is at the same work of its group

    @property
    def culprits(self) -> tuple[int, ...]:
        return tuple(sorted(self.behind))

    @property
    def summary(self) -> str:
        if not self.events and not self.behind:
            return "NCCL timeout log: no rank's timeout read"
        ranks = sorted({e.rank for e in self.events})
        first = min(self.events, key=lambda e: (e.seq, e.rank)) if self.events else None
        what = (f"{first.op or 'a collective'} #{first.seq}" if first else "a collective")
        waited = next((e.timeout_ms for e in self.events if e.timeout_ms), None)
        head = (f"NCCL timeout log: {_ranks(ranks)} timed out" + (f" after {waited / 1000:g} s" if waited else ""))
        if self.behind:
            return head + "; " + "; ".join(f"rank {r} {why}" for r, why in sorted(self.behind.items())[:6])
        if self.silent:
            return head + f" in {what}; no timeout line from {_ranks(self.silent)}: look there first"
        return (head + f", all in {what}: no rank is behind by sequence number, so the transport (network "
                "interface, InfiniBand, P2P) is the usual cause, or a rank whose log is not here; run "
                "`stall-watchdog doctor --all` on the nodes")

    def to_json(self) -> dict[str, object]:
        return {"ranks": sorted({e.rank for e in self.events}), "culprits": list(self.culprits),
                "behind": {str(r): why for r, why in sorted(self.behind.items())}, "silent": list(self.silent),
                "same_work": self.same_work, "summary": self.summary,
                "events": [vars(e) for e in sorted(self.events, key=lambda e: e.rank)]}


def _ranks(ranks: list[int] | tuple[int, ...]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:16]))}{' ...' if len(ranks) > 16 else ''}"


def parse(text: str) -> TimeoutFinding:
    """Every rank's timeout in one or more logs (concatenated), judged (module docstring)."""
    events: dict[tuple[int, int], RankTimeout] = {}
    lagging: dict[int, str] = {}
    for line in text.splitlines():
        if len(line) > 4096:
            line = line[:4096]
        if (m := _CAUGHT.search(line)) is not None:
            event = events.setdefault((int(m["rank"]), int(m["seq"])), RankTimeout(int(m["rank"]), int(m["seq"])))
            event.op = m["op"]
            event.ran_ms = int(m["ran"]) if m["ran"] else event.ran_ms
            found = _TIMEOUT_MS.search(m["rest"] or "")
            event.timeout_ms = int(found.group(1)) if found else event.timeout_ms
            event.group = event.group or _group(m["pg"])
        elif (m := _DETECTED.search(line)) is not None:
            event = events.setdefault((int(m["rank"]), int(m["seq"])), RankTimeout(int(m["rank"]), int(m["seq"])))
            event.last_enqueued, event.last_completed = int(m["enq"]), int(m["done"])
            event.group = event.group or _group(m["pg"])
        elif (m := _DESYNC_AT.search(line)) is not None:
            events.setdefault((int(m["rank"]), int(m["seq"])), RankTimeout(int(m["rank"]), int(m["seq"]), op=m["op"]))
        elif (m := _DESYNC_LAG.match(line)) is not None:
            lagging[int(m["rank"])] = m["what"].strip()
    return judge(list(events.values()), lagging)


def _group(tag: str | None) -> str:
    """`PG 1`, `PG ID 0 PG GUID 0(default_pg)` -> the group's name; the default group otherwise."""
    if not tag:
        return ""
    named = re.search(r"\(([^)]{1,60})\)", tag)
    return named.group(1) if named else tag.strip()


def judge(events: list[RankTimeout], lagging: dict[int, str] | None = None) -> TimeoutFinding:
    behind = dict(lagging or {})
    # A rank's earliest timed-out work is the one it is stuck in (later lines may repeat it).
    first: dict[int, RankTimeout] = {}
    for event in sorted(events, key=lambda e: e.seq):
        first.setdefault(event.rank, event)
    groups: dict[str, list[RankTimeout]] = {}
    named = {e.group for e in first.values() if e.group}
    for event in first.values():
        # A line without a group tag (older formats, or a cut log) belongs to the one group the others name.
        group = event.group or (next(iter(named)) if len(named) == 1 else "")
        groups.setdefault(group, []).append(event)
    same = bool(first)
    for members in groups.values():
        top = max(e.seq for e in members)
        done = [e.last_completed for e in members if e.last_completed is not None]
        for event in members:
            if event.seq < top:
                behind.setdefault(event.rank, f"timed out in #{event.seq} while others were at #{top}")
            elif done and event.last_completed is not None and event.last_completed < max(done):
                behind.setdefault(event.rank, f"completed work #{event.last_completed}, others #{max(done)}")
        same = same and len({e.seq for e in members}) == 1
    logged = sorted(first)
    silent = tuple(r for r in range(max(logged) + 1) if r not in first) if logged and len(groups) <= 1 else ()
    return TimeoutFinding(tuple(first.values()), behind, silent if not behind else (), same and not behind)
