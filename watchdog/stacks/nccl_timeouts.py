"""PyTorch's NCCL watchdog timeout logs, the most common artefact a hang leaves behind, read into suspects.

When a collective outlives its timeout, a rank's ProcessGroupNCCL watchdog logs (PyTorch 1.13 to 2.9):

    [rank3]:[E710 ... ProcessGroupNCCL.cpp:757] [Rank 1] Watchdog caught collective operation timeout:
        WorkNCCL(SeqNum=808, OpType=ALLREDUCE, NumelIn=9801523, NumelOut=9801523, Timeout(ms)=600000) ran for
        600020 milliseconds before timing out.
    [PG ID 0 PG GUID 0(default_pg) Rank 1] Exception (either an error or timeout) detected by watchdog at
        work: 808, last enqueued NCCL work: 811, last completed NCCL work: 807.            (2.1-2.3)
    [PG ID 1 PG GUID 1 Rank 1]  failure detected by watchdog at work sequence id: 808 PG status: last
        enqueued work: 811, last completed work: 807                                        (2.4+)

(older: `[Rank 0] Timeout at NCCL work: 808, last enqueued NCCL work: 811, last completed NCCL work: 807.`).
`[rank3]:` is the global rank (PyTorch's log prefix); `[PG ... Rank 1]` and `[Rank 1]` are the rank within
the process group: without the prefix, a rank of a group other than the default one is only known by its
place in that group, and is said so. Ranks that did not time out themselves say so too: `Received a dump
signal due to a collective timeout from rank N` (2.4+), and `TORCH_NCCL_DESYNC_DEBUG=1` adds a report:

     - [0] Timeout at collective: ALLREDUCE, #3
     - To our best knowledge, the lagging/dead/mismatched ranks that caused the desync are:
         [1] finished collective #2, but didn't join collective #3 (count from 1)

Who is a suspect (timeout_verdict.py), per process group: a rank whose timed-out work is behind the others' (a
lower sequence number, or fewer works completed); ranks at the same sequence number in different collectives
(BROADCAST against ALLREDUCE) will never match, and the fewer are named; ranks the log shows alive but not
timed out never reached the collective the others time out in. When every rank that logged is at the same
work, none is behind: ranks with no line here are looked at first (the log may be cut), else the transport. A
paste whose lines were hard-wrapped is joined back; a line that names the watchdog but cannot be read is
counted and said, never taken as silence.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from watchdog.stacks.timeout_verdict import ANONYMOUS, RankTimeout, TimeoutFinding, default_group, judge

_S = r"\s{0,4}"  # a space a hard wrap may have taken, or doubled
_GLOBAL = re.compile(r"\[rank(?P<g>\d{1,7})\]:")
_TAG = (r"(?:\[(?:(?P<pg>PG[^\]\n]{0,80}?)\s{1,4})?[Rr]ank\s{0,4}(?P<rank>\d{1,7})\]:?\s{0,4}"
        r"(?:\[[A-Z][^\]\n]{0,80}\]\s{0,4})?)?")
_CAUGHT = re.compile(_TAG + _S + r"Watchdog\s{1,4}caught\s{1,4}collective\s{1,4}operation\s{1,4}timeout:" + _S +
                     r"WorkNCCL\(SeqNum=(?P<seq>\d{1,12})," + _S + r"OpType=(?P<op>\w{1,40})"
                     r"(?P<rest>(?:[^()\n]|\(ms\)){0,240})\)"
                     r"(?:" + _S + r"ran\s{1,4}for\s{1,4}(?P<ran>\d{1,12})\s{0,4}milliseconds)?")
_TIMEOUT_MS = re.compile(r"Timeout\(ms\)=(\d{1,12})")
_DETECTED = re.compile(_TAG + _S + r"(?:Exception\s{1,4}\(either\s{1,4}an\s{1,4}error\s{1,4}or\s{1,4}timeout\)"
                       r"\s{1,4}detected\s{1,4}by\s{1,4}watchdog\s{1,4}at\s{1,4}work|Timeout\s{1,4}at\s{1,4}NCCL"
                       r"\s{1,4}work|failure\s{1,4}detected\s{1,4}by\s{1,4}watchdog\s{1,4}at\s{1,4}work\s{1,4}"
                       r"sequence\s{1,4}id):" + _S + r"(?P<seq>\d{1,12}),?" + _S +
                       r"(?:PG\s{1,4}status:" + _S + r")?last\s{1,4}enqueued\s{1,4}(?:NCCL\s{1,4})?work:" + _S +
                       r"(?P<enq>-?\d{1,12}),?" + _S + r"last\s{1,4}completed\s{1,4}(?:NCCL\s{1,4})?work:" + _S +
                       r"(?P<done>-?\d{1,12})")
_SIGNAL = re.compile(r"Received\s{1,4}a\s{1,4}dump\s{1,4}signal\s{1,4}due\s{1,4}to\s{1,4}a\s{1,4}collective\s{1,4}"
                     r"timeout\s{1,4}from\s{1,4}(?:rank\s{1,4}(?P<src>\d{1,7})|this\s{1,4}local\s{1,4}rank)"
                     r"(?:.{0,200}?Last\s{1,4}enqueued\s{1,4}NCCL\s{1,4}work:\s{0,4}(?P<enq>-?\d{1,12}))?")
_FIRST_PG = re.compile(_TAG + r"\s{1,4}First\s{1,4}PG\s{1,4}on\s{1,4}this\s{1,4}rank\s{1,4}to\s{1,4}signal")
_STUCK = re.compile(r"watchdog\s{1,4}got\s{1,4}stuck\s{1,4}for\s{1,4}(?P<s>\d{1,9})\s{1,4}seconds|"
                    r"Heartbeat\s{1,4}monitor\s{1,4}timed\s{1,4}out")
_DESYNC_AT = re.compile(r"\[(?P<rank>\d{1,7})\] Timeout at collective: (?P<op>\w{1,40}), #(?P<seq>\d{1,12})")
# TORCH_NCCL_DESYNC_DEBUG's report (retrieveDesyncReport): the ranks inside the lowest collective anyone is in,
# the ranks that finished it and never joined the next, and ranks that never joined any collective
_DESYNC_RANKS = r"\[(?P<ranks>\d{1,7}(?:,\s{0,2}\d{1,7}){0,4095}(?:,\s{0,2}\.\.\.)?)\]"
_DESYNC_JOINED = re.compile(r"^\s{0,16}(?:-\s{1,4})?" + _DESYNC_RANKS + r" joined but didn't finish collective "
                            r"#(?P<seq>\d{1,12})")
_DESYNC_FINISHED = re.compile(r"^\s{0,16}(?:-\s{1,4})?" + _DESYNC_RANKS + r" finished collective #(?P<seq>\d{1,12}),"
                              r" but didn't join collective #(?P<next>\d{1,12})")
_DESYNC_NEVER = re.compile(r"ranks " + _DESYNC_RANKS + r" are the lagging ranks that caused this timeout")
_ANY_TAG = re.compile(r"\[(?:PG[^\]\n]{0,80}?\s{1,4})?[Rr]ank\s{0,4}(?P<rank>\d{1,7})\]")
_QUOTE = re.compile(r"^\s{0,8}(?:>\s?)+")  # a Markdown quote's '> ' on every line
MARKERS = ("Watchdog caught collective operation timeout", "detected by watchdog at work", "Timeout at NCCL work",
           "Timeout at collective:", "failure detected by watchdog", "Received a dump signal due to a collective",
           "watchdog got stuck for", "Heartbeat monitor timed out")
_MARKER = re.compile(r"Watchdog\s{0,4}caught|detected\s{0,4}by\s{0,4}watchdog|Timeout\s{0,4}at\s{0,4}NCCL|"
                     r"failure\s{0,4}detected|Received\s{0,4}a\s{0,4}dump\s{0,4}signal")
_WRAPPED_MARKER = re.compile(_MARKER.pattern.replace(r"\s{0,4}", r"\s{0,64}"))
_RECORD = re.compile(r"Watchdog\s{0,4}caught|detected\s{0,4}by\s{0,4}watchdog|Timeout\s{0,4}at\s{0,4}NCCL|"
                     r"failure\s{0,4}detected")  # the records a hard wrap is joined back for
# A line that starts a new record: where a hard-wrapped paste's continuation ends.
_NEW_LINE = re.compile(r"^\s{0,4}(?:\[rank\d|\[Rank |\[PG |\[\d{1,7}\] |\(\w+(?:\[[^\]\n]{0,40}\])? pid=|"
                       r"[EWIF]\d{4} |\d{4}-\d\d-\d\d|- |#\d|Traceback|Stack trace|Exception raised|terminate called|"
                       r"what\(\):|\w+Error)")
_COMPLETE = re.compile(r"timing\s{0,4}out\.?\s{0,4}$|last\s{0,4}completed\s{0,4}(?:NCCL\s{0,4})?work:\s{0,4}-?\d{1,12}"
                       r"\.?\s{0,4}$|dump\s{0,4}the\s{0,4}debug\s{0,4}info\.?\s{0,4}$")
_MAX_LINE = 4096
_MAX_JOINED = 8  # lines of one record a paste may have split it into


def looks_like_timeout_log(text: str) -> bool:
    """A marker, or one a paste wrapped (a new line and its indent between two words): searched in the text as it
    is, never a copy of it split into words (a 64 MiB log would be a list of millions)."""
    return any(marker in text for marker in MARKERS) or _WRAPPED_MARKER.search(text) is not None


def unwrap(text: str) -> list[str]:
    """The log's lines, with a record a paste hard-wrapped joined back: a line that holds the start of a
    watchdog record but not its end takes the lines after it until one starts a new record."""
    lines: list[str] = []
    pending: list[str] = []
    for raw in text.splitlines():
        line = _QUOTE.sub("", raw[:_MAX_LINE])
        if pending:
            if _NEW_LINE.match(line) or not line.strip() or len(pending) >= _MAX_JOINED:
                lines.append("".join(pending))
                pending = []
            else:
                pending.append(line.strip() if pending[-1].endswith((" ", "(", "=", ",")) else line.lstrip())
                joined = "".join(pending)
                if _COMPLETE.search(joined):
                    lines.append(joined)
                    pending = []
                continue
        if _RECORD.search(line) and not _COMPLETE.search(line):
            pending = [line]
        else:
            lines.append(line)
    if pending:
        lines.append("".join(pending))
    return lines


def _group(tag: str | None) -> str:
    """`PG 1`, `PG ID 1 PG GUID 1`, `PG ID 0 PG GUID 0(default_pg)`, `PG ID 11 PG GUID 35(ep)` -> `1`, `1`,
    `0 (default_pg)`, `11 (GUID 35, ep)`. A group is its GUID: two groups can share one PG ID (each rank numbers
    the groups it is in), so a GUID other than the ID is kept, and lines of two GUIDs are never compared."""
    if not tag:
        return ""
    number = re.match(r"PG(?:\s+ID)?\s+(\d{1,9})", tag)
    guid = re.search(r"GUID\s+([\w.:-]{1,60}?)\s{0,2}(?:\(|$)", tag)
    named = re.search(r"\(([^)]{1,60})\)", tag)
    if number:
        other = guid.group(1) if guid and guid.group(1) != number.group(1) else None
        inside = ", ".join(part for part in (f"GUID {other}" if other else None, named.group(1) if named else None)
                           if part)
        return number.group(1) + (f" ({inside})" if inside else "")
    return named.group(1) if named else tag.strip()[:60]


def parse(text: str) -> TimeoutFinding:
    """Every rank's timeout in one or more logs (concatenated), judged (module docstring)."""
    return parse_lines(unwrap(text))


# A word of each pattern `parse_lines` reads (and of those it counts as unread): a line with none holds nothing
_WORDS = ("atchdog", "Timeout", "failure", "Received", "caught", "work", "Heartbeat", "First", "joined", "collective",
          "lagging", "orld", "WORLD", "nranks", "nRanks", "nproc")
# The job's size, where the log says it: `world_size=2`, `WORLD_SIZE=2`, NCCL's `... rank 0 nranks 2 cudaDev 0`
# torchrun's own line: --nnodes=2 --nproc_per_node=4 is a job of 8 (a range of nodes, 1:4, says no size)
_NPROC = re.compile(r"--nproc[_-]per[_-]node[= ](?P<n>\d{1,4})\b")
_NNODES = re.compile(r"--nnodes[= ](?P<n>\d{1,5})(?![\d:])")
_WORLD = re.compile(r"\bworld[_ ]?size\s{0,4}[=:]\s{0,4}(\d{1,7})\b|\bnranks\s{0,4}[=:]?\s{0,4}(\d{1,7})\b",
                    re.IGNORECASE)


def read_lines(text: str) -> list[str]:
    """What `parse_lines` can read anything from in a log: its unwrapped lines that hold one of `_WORDS`. What
    `analyze` keeps of a log of many MB is these few lines, not the whole text."""
    return [line for line in unwrap(text) if any(word in line for word in _WORDS)]


def parse_lines(lines: Iterable[str]) -> TimeoutFinding:
    """`parse` of lines already `unwrap`ped."""
    events: dict[tuple[int, bool, str, int], RankTimeout] = {}
    lagging: dict[int, str] = {}
    signalled: dict[int, tuple[int, int | None]] = {}
    own: set[int] = set()  # ranks that dumped for a timeout of their own
    inside: set[int] = set()  # the desync report's "joined but didn't finish"
    outside: dict[int, str] = {}  # its "finished collective #N, but didn't join collective #N+1"
    from_report: set[tuple[int, bool, str, int]] = set()  # events made from its "joined" lines
    stuck: set[int] = set()
    unread = 0
    world: int | None = None

    def event(m: re.Match[str], line: str) -> RankTimeout:
        group = _group(m["pg"])
        prefix = _GLOBAL.search(line[:m.start() + 1]) or _GLOBAL.search(line)
        tagged = int(m["rank"]) if m["rank"] else int(prefix["g"]) if prefix else ANONYMOUS
        known = prefix is not None or (default_group(group) and tagged != ANONYMOUS)
        rank = int(prefix["g"]) if prefix is not None else tagged
        key = (rank, known, "" if prefix is not None or default_group(group) else group, int(m["seq"]))
        if not known:  # the same rank's other line carried its global rank: one event
            same = next((e for e in events.values() if e.global_known and e.group == group and e.seq == int(m["seq"])
                         and (e.group_rank if e.group_rank is not None else e.rank) == tagged), None)
            if same is not None:
                return same
        found = events.setdefault(key, RankTimeout(rank, int(m["seq"]), global_known=known))
        found.group = found.group or group
        if prefix is not None and tagged != rank:
            found.group_rank = tagged
        return found

    for line in lines:
        matched = False
        for size in _WORLD.finditer(line) if world is None else ():
            world = int(size.group(1) or size.group(2)) or None
        if world is None and (per := _NPROC.search(line)) is not None:
            nodes = _NNODES.search(line)
            if nodes is not None or "--nnodes" not in line:  # a range of nodes (1:4) says no size
                world = int(per["n"]) * (int(nodes["n"]) if nodes else 1) or None
        # each record's words first, found at C speed: the patterns' tag prefix costs microseconds per character
        for caught in _CAUGHT.finditer(line) if "caught" in line else ():
            found = event(caught, line)
            found.op = caught["op"]
            found.ran_ms = int(caught["ran"]) if caught["ran"] else found.ran_ms
            limit = _TIMEOUT_MS.search(caught["rest"] or "")
            found.timeout_ms = int(limit.group(1)) if limit else found.timeout_ms
            matched = True
        for detected in _DETECTED.finditer(line) if "work" in line else ():
            found = event(detected, line)
            found.last_enqueued, found.last_completed = int(detected["enq"]), int(detected["done"])
            matched = True
        if (m := _SIGNAL.search(line)) is not None:
            tag = _GLOBAL.search(line) or _ANY_TAG.search(line)
            if tag is not None and m["src"] is not None:
                signalled[int(tag.group(1))] = (int(m["src"]), int(m["enq"]) if m["enq"] else None)
            elif tag is not None:  # "from this local rank": a timeout of its own (its lines may be cut)
                own.add(int(tag.group(1)))
            matched = True
        if (m := _STUCK.search(line)) is not None:
            tag = _GLOBAL.search(line) or _ANY_TAG.search(line)
            if tag is not None:
                stuck.add(int(tag.group(1)))
            matched = True
        if _FIRST_PG.search(line):
            matched = True
        if (m := _DESYNC_AT.search(line)) is not None:  # the report counts from 1, SeqNum from 0
            rank, seq = int(m["rank"]), int(m["seq"]) - 1
            if not any(k[0] == rank for k in events):
                events[(rank, True, "", seq)] = RankTimeout(rank, seq, op=m["op"], from_report=True)
            matched = True
        elif (m := _DESYNC_JOINED.match(line)) is not None:
            joined = _rank_list(m["ranks"])
            inside.update(joined)
            for rank in joined:
                if not any(k[0] == rank for k in events):
                    key = (rank, True, "", int(m["seq"]) - 1)
                    events[key] = RankTimeout(rank, int(m["seq"]) - 1, from_report=True)
                    from_report.add(key)
            matched = True
        elif (m := _DESYNC_FINISHED.match(line)) is not None:
            for rank in _rank_list(m["ranks"]):
                outside[rank] = f"finished collective #{m['seq']}, but didn't join collective #{m['next']}"
            matched = True
        elif (m := _DESYNC_NEVER.search(line)) is not None:
            for rank in _rank_list(m["ranks"]):
                lagging[rank] = "never joined any collective (TORCH_NCCL_DESYNC_DEBUG)"
            matched = True
        if not matched and _MARKER.search(line) and not line.lstrip().startswith(("[E", "#")) and \
                "Stack trace" not in line:
            unread += 1
    # Both sides of a desync report: the fewer are the odd ones (one rank stuck inside while the rest finished
    # it, or one rank that finished and never joined the next while the rest wait in it)
    if outside:  # the report's "joined" ranks wait in it; they did not time out themselves
        events = {k: e for k, e in events.items() if k not in from_report}
    if outside and (not inside or len(outside) <= len(inside)):
        lagging.update({r: why for r, why in outside.items() if r not in lagging})
    elif inside and outside:
        lagging.update({r: "joined but didn't finish the collective the others finished (TORCH_NCCL_DESYNC_DEBUG)"
                        for r in inside if r not in lagging})
    return judge(list(events.values()), lagging, signalled, tuple(sorted(stuck)), unread, tuple(sorted(own)), world)


def _rank_list(text: str) -> list[int]:
    return [int(r) for r in re.findall(r"\d{1,7}", text)[:4096]]
