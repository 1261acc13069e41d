"""What PyTorch's Flight Recorder analyzer prints, as people paste it: `torchfrtrace` / `fr_trace` text.

    Not all ranks joining collective 5 at entry 4              (torchfrtrace, PyTorch 2.5-2.7)
    Not all ranks joining collective, sequence number: 4       (fr_trace, 2.8+)
    group info: 0:default_pg
    collective: nccl:all_reduce
    missing ranks: {1}
    collective state: scheduled

The missing ranks never joined the collective the others wait in: they are the ones waited on. The
side-by-side view (`-j`) puts each rank's entries in a column under `Rank N`: a rank whose column ends
before the others' never reached their last entries. A list of one rank's entries
(`completed nccl:all_reduce` / `started ...` / `scheduled ...`) says where that rank is, not who it waits on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_MISMATCH = re.compile(r"^\s{0,8}Not all ranks joining collective(?:\s{1,4}(?P<seq>\d{1,12})\s{1,4}at\s{1,4}entry"
                       r"\s{1,4}"
                       r"\d{1,12}|,\s{0,4}sequence number:\s{0,4}(?P<seq2>\d{1,12}))", re.MULTILINE)
_FIELD = re.compile(r"^\s{0,8}(?P<key>group info|collective|missing ranks|collective state|expected ranks|"
                    r"world size):\s{0,4}(?P<value>[^\n]{0,400})$", re.MULTILINE)
_COLUMNS = re.compile(r"^\s{0,8}Rank \d{1,7}(?:\s{2,80}Rank \d{1,7}){1,1023}\s*$", re.MULTILINE)
_ENTRY = re.compile(r"^\s{0,8}(?P<state>completed|started|scheduled)\s{1,4}(?P<op>nccl:\w{1,60}|gloo:\w{1,60})",
                    re.MULTILINE)
MAX_BLOCKS = 256


@dataclass(frozen=True)
class Mismatch:
    seq: int | None
    collective: str
    group: str
    missing: tuple[int, ...]
    state: str


@dataclass(frozen=True)
class FrText:
    mismatches: tuple[Mismatch, ...] = ()
    behind_in_table: tuple[int, ...] = ()  # side-by-side view: ranks whose column ends early
    entries: tuple[tuple[str, str], ...] = ()  # one rank's (state, collective) list
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def culprits(self) -> tuple[int, ...]:
        return tuple(sorted({r for m in self.mismatches for r in m.missing} | set(self.behind_in_table)))

    @property
    def summary(self) -> str:
        parts = []
        for m in self.mismatches[:4]:
            where = f"{m.collective}" + (f" #{m.seq}" if m.seq is not None else "") + (
                f" of group {m.group}" if m.group else "")
            if m.missing:
                parts.append(f"{_ranks(m.missing)} never joined {where} ({m.state or 'state not said'})")
            else:
                parts.append(f"not every rank joined {where}; the missing ones are not named")
        if self.behind_in_table:
            parts.append(f"{_ranks(self.behind_in_table)} recorded fewer collectives than the others")
        if not parts and self.entries:
            state, op = self.entries[-1]
            parts.append(f"one rank's entries, the last {op} {state}: where it is, not who it waits on")
        return "Flight Recorder analyzer: " + ("; ".join(parts) or "no mismatch printed")

    def to_json(self) -> dict[str, object]:
        return {"culprits": list(self.culprits), "summary": self.summary,
                "mismatches": [vars(m) for m in self.mismatches], "behind_in_table": list(self.behind_in_table)}


def _ranks(ranks: tuple[int, ...]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks[:16]))


def looks_like(text: str) -> bool:
    return bool(_MISMATCH.search(text) or _COLUMNS.search(text) or len(_ENTRY.findall(text)) >= 2)


def parse(text: str) -> FrText:
    blocks = []
    starts = [m for m in _MISMATCH.finditer(text)][:MAX_BLOCKS]
    for n, m in enumerate(starts):
        end = starts[n + 1].start() if n + 1 < len(starts) else len(text)
        fields = {f["key"]: f["value"].strip() for f in _FIELD.finditer(text, m.end(), end)}
        missing = tuple(sorted(int(r) for r in re.findall(r"\d{1,7}", fields.get("missing ranks", ""))[:4096]))
        seq = m["seq"] or m["seq2"]
        blocks.append(Mismatch(int(seq) if seq else None, fields.get("collective", "a collective")[:80],
                               fields.get("group info", "")[:80], missing, fields.get("collective state", "")[:40]))
    return FrText(tuple(blocks), _table(text), tuple((e["state"], e["op"]) for e in _ENTRY.finditer(text)))


def _table(text: str) -> tuple[int, ...]:
    """The side-by-side view: each rank's column, by the header's positions; the ranks with fewer entries."""
    head = _COLUMNS.search(text)
    if head is None:
        return ()
    line = head.group(0)
    spans = [(m.start(), int(m.group(1))) for m in re.finditer(r"Rank (\d{1,7})", line)]
    filled = {rank: 0 for _, rank in spans}
    for row in text[head.end():].splitlines()[:100000]:
        if not row.strip() or set(row.strip()) <= {"-", " "}:
            continue
        for n, (start, rank) in enumerate(spans):
            end = spans[n + 1][0] if n + 1 < len(spans) else len(row)
            if row[start:end].strip():
                filled[rank] += 1
    most = max(filled.values(), default=0)
    return tuple(sorted(rank for rank, count in filled.items() if count < most))
