"""The verdict on a job's NCCL watchdog timeouts (read by nccl_timeouts.py): one rank's timed-out work, and
who the others wait on, per process group (nccl_timeouts.py's docstring says the rules with the log lines
they come from)."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

ANONYMOUS = -1  # a timeout whose rank the paste left out


def default_group(group: str) -> bool:
    """Whether a group, as the log names it, is the default one (whose ranks are the global ranks)."""
    return not group or group.startswith("0") or "default_pg" in group


@dataclass
class RankTimeout:
    """One rank's timed-out work, merged from its watchdog lines."""

    rank: int  # global where the log says it ([rankN]: or the default group), else the rank within `group`
    seq: int
    group: str = ""
    group_rank: int | None = None  # the rank within `group` where it differs from `rank`
    global_known: bool = True
    op: str | None = None
    timeout_ms: int | None = None
    ran_ms: int | None = None
    last_enqueued: int | None = None
    last_completed: int | None = None
    from_report: bool = False  # known only from TORCH_NCCL_DESYNC_DEBUG's report, which counts from 1

    def who(self) -> str:
        if self.rank == ANONYMOUS:
            return "a rank the log does not name"
        if self.global_known:
            return f"rank {self.rank}"
        return f"rank {self.rank} of process group {self.group}"


@dataclass(frozen=True)
class TimeoutFinding:
    events: tuple[RankTimeout, ...]
    behind: dict[int, str] = field(default_factory=dict)  # global rank -> why it is a suspect
    silent: tuple[int, ...] = ()  # ranks below the highest that logged, with no line here (the first MAX_LISTED)
    same_work: bool = False  # every rank that logged is at the same work of its group
    signalled: dict[int, int] = field(default_factory=dict)  # rank -> the rank whose timeout it was told of
    unread: int = 0  # lines naming the watchdog that could not be read
    stuck_watchdogs: tuple[int, ...] = ()  # ranks whose watchdog thread itself hung (a CUDA/NCCL call)
    group_suspects: tuple[str, ...] = ()  # suspects known only by their rank within a process group
    own_timeouts: tuple[int, ...] = ()  # ranks that dumped for a timeout of their own whose lines are not here
    silent_count: int = 0  # all of them: counted, never listed (a log naming rank 9999999 is not 10M ranks' lines)

    @property
    def culprits(self) -> tuple[int, ...]:
        return tuple(sorted(self.behind))

    @property
    def read(self) -> bool:
        """Whether anything was read: a timeout, a dump signal or a stuck watchdog."""
        return bool(self.events or self.behind or self.signalled or self.stuck_watchdogs or self.own_timeouts)

    @staticmethod
    def _work(first: RankTimeout) -> str:
        group = f" of process group {first.group}" if first.group and not default_group(first.group) else ""
        if first.from_report:
            return f"{first.op or 'collective'} #{first.seq + 1} (the desync report's count, from 1){group}"
        return f"{first.op or 'a collective'} #{first.seq}{group}"

    def _timed_out(self) -> list[str]:
        """'ranks 0, 2, 3 timed out after 600 s in ALLREDUCE #42', one clause per work the ranks are stuck in."""
        by_seq: dict[tuple[int, bool], list[RankTimeout]] = {}
        for e in sorted(self.events, key=lambda e: (e.seq, e.rank)):
            by_seq.setdefault((e.seq, e.from_report), []).append(e)
        works: list[list[RankTimeout]] = []
        for members in by_seq.values():  # split one sequence number only where its ranks name different collectives
            ops = sorted({e.op for e in members if e.op})
            works += [[e for e in members if e.op in (op, None) and (op == ops[0] or e.op)] for op in ops] or [members]
        clauses = []
        for members in works[:4]:
            first = next((e for e in members if e.op and e.group), next((e for e in members if e.op), members[0]))
            named = sorted({e.rank for e in members if e.global_known and e.rank >= 0})
            local = sorted({e.who() for e in members if not e.global_known})
            who = ", ".join(([_ranks(named)] if named else []) + local)
            limit = next((e.timeout_ms for e in members if e.timeout_ms), None)
            waited = f" after {limit / 1000:g} s" if limit and limit < 2**40 else ""
            verb = "joined and did not finish " if first.from_report else "timed out" + waited + " in "
            clauses.append(f"{who} {verb}{self._work(first)}")
        if len(works) > 4:
            clauses.append(f"and {len(works) - 4} more works")
        return clauses

    @property
    def summary(self) -> str:
        unread = (f"; {self.unread} line{'s' if self.unread > 1 else ''} naming the watchdog could not be read"
                  if self.unread else "")
        if not self.read:
            return "NCCL timeout log: no rank's timeout could be read" + unread
        parts = self._timed_out()
        if self.own_timeouts:
            whose = "its" if len(self.own_timeouts) == 1 else "their"
            parts.append(f"{_ranks(list(self.own_timeouts))} dumped for a timeout of {whose} own")
        if self.signalled:
            told = sorted(self.signalled)
            parts.append(f"{_ranks(told)} did not time out {'itself' if len(told) == 1 else 'themselves'} (told "
                         f"of rank {sorted(set(self.signalled.values()))[0]}'s timeout)")
        if self.stuck_watchdogs:
            parts.append(f"the watchdog of {_ranks(list(self.stuck_watchdogs))} got stuck (a CUDA or NCCL call hung)")
        head = "NCCL timeout log: " + "; ".join(parts)
        if self.behind:
            return head + "; " + "; ".join(f"rank {r} {why}" for r, why in sorted(self.behind.items())[:6]) + unread
        if self.group_suspects:
            return head + "; " + "; ".join(self.group_suspects[:6]) + unread
        if self.silent:
            many = f"{self.silent_count} ranks ({', '.join(map(str, self.silent[:16]))} ...)" if \
                self.silent_count > 16 else _ranks(self.silent)
            return (head + f"; none is behind another; no line from {many} here (the log may be cut, "
                    "or they never reached it): look at theirs first" + unread)
        if len(self.events) == 1:
            return head + ": one rank's log; which peer never arrived is in the others' logs" + unread
        if self.events:
            return (head + f"; all {len({e.rank for e in self.events})} ranks that logged are at the same work: "
                    "none is behind, so the transport (network interface, InfiniBand, P2P) is the usual cause, or "
                    "a rank whose log is not here; run `stall-watchdog doctor --all-ranks` on the nodes" + unread)
        return head + unread

    def to_json(self) -> dict[str, object]:
        return {"ranks": sorted({e.rank for e in self.events}), "culprits": list(self.culprits),
                "behind": {str(r): why for r, why in sorted(self.behind.items())}, "silent": list(self.silent),
                "silent_count": self.silent_count,
                "same_work": self.same_work, "summary": self.summary, "unread_lines": self.unread,
                "signalled": {str(r): s for r, s in sorted(self.signalled.items())},
                "stuck_watchdogs": list(self.stuck_watchdogs), "group_suspects": list(self.group_suspects),
                "own_timeouts": list(self.own_timeouts),
                "events": [vars(e) for e in sorted(self.events, key=lambda e: e.rank)]}


def _ranks(ranks: list[int] | tuple[int, ...]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:16]))}{' ...' if len(ranks) > 16 else ''}"


def judge(events: list[RankTimeout], lagging: dict[int, str] | None = None,
          signalled: dict[int, tuple[int, int | None]] | None = None, stuck: tuple[int, ...] = (),
          unread: int = 0, own: tuple[int, ...] = (), world: int | None = None) -> TimeoutFinding:
    """`signalled`: rank -> (the rank whose timeout it was told of, its own last enqueued work or None); `world`:
    the job's size where the log says it. In a job of two ranks whose one rank timed out and the other left no
    line, the other is the peer it waits on; a known size also lists the silent ranks above the highest that
    logged."""
    behind = dict(lagging or {})
    told = {r: s for r, s in (signalled or {}).items() if not any(e.rank == r for e in events)}
    known = [e for e in events if e.rank != ANONYMOUS]
    events = known or events  # a record whose rank a paste cut off counts only where no rank is named
    # A rank's earliest timed-out work is the one it is stuck in (later lines may repeat it).
    first: dict[tuple[int, bool, str], RankTimeout] = {}
    for e in sorted(events, key=lambda e: e.seq):
        first.setdefault((e.rank, e.global_known, "" if e.global_known else e.group), e)
    groups: dict[str, list[RankTimeout]] = {}
    named = {e.group for e in first.values() if e.group}
    for e in first.values():
        # A line without a group tag (older formats, or a cut log) belongs to the one group the others name.
        group = e.group or (next(iter(named)) if len(named) == 1 else "")
        groups.setdefault(group, []).append(e)
    same = bool(first)
    local: list[str] = []

    def suspect(e: RankTimeout, why: str) -> None:
        if e.global_known:
            behind.setdefault(e.rank, why)
        else:
            local.append(f"{e.who()} {why}")

    for members in groups.values():
        top = max(e.seq for e in members)
        done = [e.last_completed for e in members if e.last_completed is not None]
        for e in members:
            if e.seq < top:
                suspect(e, f"timed out in #{e.seq} while others were at #{top}")
            elif done and e.last_completed is not None and e.last_completed < max(done):
                suspect(e, f"completed work #{e.last_completed}, others #{max(done)}")
        at_top = [e for e in members if e.seq == top and e.op]
        ops = Counter(e.op for e in at_top)
        (common, most), *rest = ops.most_common() if ops else [("", 0)]
        if rest and most >= 2 and most > rest[0][1]:  # the same sequence number in different collectives: they
            # will never match; the odd side is the smaller one, and one rank on each side blames neither
            for e in at_top:
                if e.op != common:
                    suspect(e, f"is in {e.op} #{e.seq} while the others are in {common} #{top}: the collectives do "
                               "not match (a desync)")
        same = same and len({e.seq for e in members}) == 1 and len(ops) <= 1
    default = [e for e in first.values() if e.global_known and default_group(e.group) and e.rank >= 0]
    waited = min((e.seq for e in default), default=None)
    for rank, (source, enqueued) in told.items():
        # Alive, told of a timeout it did not have: it never enqueued the work the others time out in.
        if waited is not None and enqueued is not None and enqueued < waited:
            behind.setdefault(rank, f"never enqueued work #{waited} (its last enqueued is #{enqueued}; told of "
                                    f"rank {source}'s timeout)")
        elif enqueued is None and waited is not None and not behind and not local:
            behind.setdefault(rank, f"did not time out (told of rank {source}'s): it never entered the collective "
                                    "the others wait in")
    sources = {r: s for r, (s, _) in told.items()}
    # A rank that signalled its timeout to the others timed out itself: it is not silent
    logged = sorted({e.rank for e in first.values() if e.global_known and e.rank >= 0} | set(sources) | set(own) |
                    {s for s in sources.values() if 0 <= s < 1 << 24})
    if world == 2 and len(logged) == 1 and logged[0] in (0, 1) and not behind and not local and len(groups) <= 1 \
            and all(default_group(e.group) for e in first.values()):
        peer = 1 - logged[0]
        behind[peer] = (f"left no line in a job of 2 ranks whose rank {logged[0]} timed out waiting: the peer that "
                        "never arrived")
    sized = world is not None and bool(logged) and logged[-1] + 1 < world <= 1 << 20
    ceiling = [*logged, world] if sized and world is not None else logged
    silent = _absent(ceiling) if logged and len(groups) <= 1 and (len(logged) > 1 or sized) and not behind and \
        not local else ()
    return TimeoutFinding(tuple(first.values()), behind, silent, same and not behind and not local, sources, unread,
                          stuck, tuple(local), tuple(r for r in own if not any(e.rank == r for e in first.values())),
                          (world if sized and world else logged[-1] + 1) - len(logged) if silent else 0)


MAX_LISTED = 64


def _absent(logged: list[int]) -> tuple[int, ...]:
    """The first MAX_LISTED ranks below the highest of `logged` (sorted, distinct) that are not in it, found
    from the gaps between them: the cost is what the log holds, never the largest rank number it names."""
    gaps = (range(below + 1, rank) for below, rank in zip([-1, *logged], logged))
    return tuple(itertools.islice(itertools.chain.from_iterable(gaps), MAX_LISTED))
