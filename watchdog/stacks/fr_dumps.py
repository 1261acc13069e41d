"""Read PyTorch Flight Recorder dumps back, safely and within bounds (fr_matching.py names the ranks a
process group waits on).

A dump (format 2.x, one per rank, `<TORCH_FR_DUMP_TEMP_FILE or TORCH_NCCL_DEBUG_INFO_TEMP_FILE><rank>`) is
a pickle (or the JSON twin `_dump_fr_trace_json` writes) holding `entries` (one per collective:
`pg_id`, `process_group` (name, desc), `collective_seq_id`, `profiling_name`, `state`, `retired`...),
`pg_config` (each group's ranks) and `pg_status` (per group: the last collective enqueued, started and
completed).

Pickles and JSON are read by watchdog/boundary/untrusted_data.py: every class refused (a file in /tmp must never run
code in a daemon that may run as root), and the objects built while reading bounded (16 MiB of empty-list
opcodes would build a GiB), so a dump over that budget is refused. What is kept of a dump is bounded too:
a pickle may share one list many times through its memo (437 bytes that unfold into gigabytes of JSON), so
every trace is copied into plain values under a budget (the newest `MAX_ENTRIES` entries, `MAX_NODES`
values in all, strings cut at `MAX_TEXT` characters, lists at `MAX_ITEMS` items and `MAX_DEPTH` levels,
integers within 64 bits, floats finite) before it is kept, matched or written anywhere.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from watchdog.boundary import rank_files, untrusted_data

MAX_DUMP_BYTES = 16 * 2**20  # 2,000 entries with their stack frames are a few MB
MAX_ENTRIES = 4096  # PyTorch keeps TORCH_NCCL_TRACE_BUFFER_SIZE entries; 2,000 is the usual setting
MAX_NODES = 250_000  # plain values kept per trace, entries and groups together
MAX_TEXT = 256
MAX_ITEMS = 64
MAX_DEPTH = 4
MAX_RANK = 2**31 - 1
_RANK_SUFFIX = re.compile(r"(?<!\d)(\d{1,9})$")


SharedGroups = dict[tuple[str, tuple[object, ...]], tuple[int, ...]]  # (group, its list as read) -> its ranks


class _Budget:
    def __init__(self, nodes: int = MAX_NODES):
        self.left = nodes


def _plain(value: object, budget: _Budget, depth: int = 0) -> object:
    """A bounded, JSON-safe copy of a value from a dump (None for what does not fit or is not data)."""
    budget.left -= 1
    if budget.left < 0:
        return None
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if -2**63 <= value < 2**63 else None
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (str, bytes)):  # a string shared through the memo is copied each time: its text is paid
        text = value[:MAX_TEXT] if isinstance(value, str) else value[:MAX_TEXT].decode("utf-8", "replace")
        budget.left -= len(text) // 32
        return text
    if isinstance(value, (list, tuple)) and depth < MAX_DEPTH:
        return [_plain(item, budget, depth + 1) for item in value[:MAX_ITEMS] if budget.left > 0]
    return None


def _entries(raw: object, budget: _Budget, fields: tuple[str, ...]) -> tuple[dict[str, Any], ...]:
    """The newest MAX_ENTRIES entries, each reduced to `fields` (oldest dropped first when over)."""
    if not isinstance(raw, (list, tuple)):
        return ()
    kept: list[dict[str, Any]] = []
    for entry in reversed(raw[-MAX_ENTRIES:]):
        if budget.left <= 0:
            break
        if isinstance(entry, dict):
            kept.append({k: _plain(entry[k], budget) for k in fields if k in entry and _typed(k, entry[k])})
    return tuple(reversed(kept))


_TEXT_FIELDS = ("profiling_name", "state")  # compared and hashed by matching: text or nothing


def _typed(key: str, value: object) -> bool:
    """A field of the type matching reads it as (a crafted dump's list where a name goes is left out)."""
    return isinstance(value, str) if key in _TEXT_FIELDS else True


def _rank_number(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RANK:
        raise ValueError("rank")
    return value


class FlightRecorderError(Exception):
    """A file that is not a readable Flight Recorder dump (the message names it and says why). `final`: refused
    for what it is (over the budget of objects built), not because it may still be being written."""

    def __init__(self, message: str, final: bool = False):
        super().__init__(message)
        self.final = final


@dataclass(frozen=True)
class RankTrace:
    """One rank's dump, reduced to what matching needs."""

    rank: int
    version: str
    entries: tuple[Mapping[str, Any], ...]
    groups: Mapping[str, tuple[int, ...]]  # process group name -> its global ranks (from pg_config)
    status: Mapping[str, Mapping[str, int]]  # pg id -> last_enqueued/started/completed_collective
    source: str = ""
    node: str = ""

    def to_json(self) -> dict[str, object]:
        """Compact and JSON-safe: the fields matching uses (no stack frames), for bundles and /v1/dump. A
        group's ranks are written as runs (start, stop, step): the default group of a 100,000-rank job is one
        run, not 100,000 numbers in every rank's trace."""
        return {"rank": self.rank, "version": self.version, "node": self.node, "source": self.source,
                "groups": {n: {"runs": _runs(r)} for n, r in self.groups.items()}, "status": dict(self.status),
                "entries": [{k: e.get(k) for k in _KEPT if k in e} for e in self.entries]}

    def summarised(self) -> RankTrace:
        """What matching needs of this trace, as a node sends it to the coordinator: per process group, its
        newest collective and its oldest not completed (fr_matching.analyze finds the same in these as in the
        whole ring: a 2,000-entry ring becomes a few entries a group)."""
        kept: set[int] = set()
        for seqs in collectives(self).values():
            kept.add(id(seqs[max(seqs)]))
            open_ = [seq for seq, entry in seqs.items() if not completed(entry)]
            if open_:
                kept.add(id(seqs[min(open_)]))
        return replace(self, entries=tuple(e for e in self.entries if id(e) in kept))


    @classmethod
    def from_json(cls, data: Mapping[str, Any], node: str | None = None) -> RankTrace:
        return cls._read(data, node, _KEPT, None)

    @classmethod
    def for_matching(cls, data: Mapping[str, Any], node: str, shared: SharedGroups) -> RankTrace:
        """A trace read for `analyze` alone, as the coordinator reads the thousands of a job: each entry
        keeps only the fields matching reads (_MATCHED), and a group's rank list (every rank of the job
        lists the default group's ranks, all of them) is read once per job and kept once (`shared`)."""
        return cls._read(data, node, _MATCHED, shared)

    @classmethod
    def _read(cls, data: Mapping[str, Any], node: str | None, fields: tuple[str, ...],
              shared: SharedGroups | None) -> RankTrace:
        try:
            budget = _Budget()
            return cls(_rank_number(data["rank"]), _text(data.get("version", "")),
                       _entries(data.get("entries"), budget, fields), _groups(data.get("groups"), budget, shared),
                       _status(data.get("status")), _text(data.get("source", "")),
                       node if node is not None else _text(data.get("node", "")))
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise FlightRecorderError(f"a Flight Recorder trace of the wrong shape ({type(exc).__name__})") from None


def group_key(entry: Mapping[str, Any]) -> tuple[str, str]:
    """An entry's process group: (its name, its description)."""
    group = entry.get("process_group")
    if isinstance(group, (list, tuple)) and len(group) == 2:
        return str(group[0]), str(group[1])
    return str(entry.get("pg_id", "")), ""


def completed(entry: Mapping[str, Any]) -> bool:
    return entry.get("state") == "completed" or (entry.get("retired") is True)


def collectives(trace: RankTrace) -> dict[tuple[str, str], dict[int, Mapping[str, Any]]]:
    """A trace's collectives by process group and sequence number (the later entry of a number kept); point-to-
    point operations and entries without a number left out."""
    out: dict[tuple[str, str], dict[int, Mapping[str, Any]]] = {}
    for entry in trace.entries:
        seq = entry.get("collective_seq_id")
        if entry.get("is_p2p") or not isinstance(seq, int) or seq <= 0:
            continue
        out.setdefault(group_key(entry), {})[seq] = entry
    return out


def _runs(ranks: tuple[int, ...]) -> list[list[int]]:
    """Ranks as arithmetic runs [start, stop, step] (stop exclusive), longest first from each start."""
    if len(ranks) > 2 and ranks[1] > ranks[0] and ranks == tuple(range(ranks[0], ranks[-1] + 1, ranks[1] - ranks[0])):
        return [[ranks[0], ranks[-1] + 1, ranks[1] - ranks[0]]]  # one run (the default group: every rank)
    out: list[list[int]] = []
    i = 0
    while i < len(ranks):
        start = ranks[i]
        if i + 1 == len(ranks):
            out.append([start, start + 1, 1])
            break
        step = ranks[i + 1] - start
        j = i + 1
        while j + 1 < len(ranks) and ranks[j + 1] - ranks[j] == step:
            j += 1
        if step <= 0:  # not increasing: this rank alone
            out.append([start, start + 1, 1])
            i += 1
            continue
        out.append([start, ranks[j] + 1, step])
        i = j + 1
    return out


_KEPT = ("record_id", "pg_id", "process_group", "collective_seq_id", "p2p_seq_id", "op_id", "profiling_name",
         "state", "retired", "is_p2p", "time_created_ns", "input_sizes", "output_sizes", "input_dtypes",
         "output_dtypes")
_MATCHED = ("pg_id", "process_group", "collective_seq_id", "profiling_name", "state", "retired", "is_p2p")  # analyze


def _loads(data: bytes, source: str) -> dict[str, Any]:
    what = f"{source or 'a dump'}: this Flight Recorder dump"
    if data[:1] in (b"{", b" ", b"\n"):
        try:
            loaded = untrusted_data.loads_json(data, what)
        except untrusted_data.TooMuchData as exc:
            raise FlightRecorderError(str(exc), final=True) from None
        except (ValueError, RecursionError, OverflowError) as exc:
            raise FlightRecorderError(f"{source}: not a Flight Recorder dump (JSON: {exc})") from None
    else:
        try:
            loaded = untrusted_data.loads_pickle(data, what)
        except untrusted_data.TooMuchData as exc:
            raise FlightRecorderError(str(exc), final=True) from None
        except Exception as exc:  # any failure to unpickle is a file we do not read
            raise FlightRecorderError(f"{source}: not a Flight Recorder dump ({type(exc).__name__}: "
                                      f"{str(exc)[:120]})") from None
    if not isinstance(loaded, dict) or not isinstance(loaded.get("entries"), list):
        raise FlightRecorderError(f"{source}: not a Flight Recorder dump (no `entries` list)")
    return loaded


def _text(value: object) -> str:
    return value[:MAX_TEXT] if isinstance(value, str) else ""


def _key(value: object) -> str | None:
    """A dict key from a dump as text: a string (cut) or a 64-bit integer; anything else is no key (a
    5,000-digit integer or a tuple of a million items is never turned into a string)."""
    if isinstance(value, str):
        return value[:MAX_TEXT]
    if isinstance(value, int) and -2**63 <= value < 2**63:
        return str(value)
    return None


def _ranks_of(text: object, budget: _Budget) -> tuple[int, ...]:
    """A group's ranks; what is looked at is charged to the budget, not only what is kept (a list or string
    shared by every group through the memo is paid for each time)."""
    room = max(0, budget.left)
    if isinstance(text, dict):  # {"runs": [[start, stop, step], ...]}, as to_json writes a group
        found: list[int] = []
        runs = text.get("runs")
        for run in runs[:room] if isinstance(runs, list) else ():
            budget.left -= 1
            if (isinstance(run, list) and len(run) == 3 and all(type(v) is int for v in run) and run[0] >= 0
                    and run[1] <= MAX_RANK + 1 and run[2] >= 1):
                span = range(run[0], run[1], run[2])[:max(0, budget.left)]
                budget.left -= len(span)
                found.extend(span)
        return tuple(found)
    if isinstance(text, (list, tuple)):
        looked = text[:room]
        found = [r for r in looked if isinstance(r, int) and not isinstance(r, bool) and 0 <= r <= MAX_RANK]
        budget.left -= len(looked) + 1
    elif isinstance(text, str):
        chars = text[:8 * room]
        found = [int(r) for r in re.findall(r"(?<!\d)\d{1,9}(?!\d)", chars)][:room]
        budget.left -= len(chars) // 8 + 1
    else:
        budget.left -= 1
        return ()
    return tuple(found)


def _groups(raw: object, budget: _Budget, shared: SharedGroups | None = None) -> dict[str, tuple[int, ...]]:
    if not isinstance(raw, dict):
        return {}
    groups = {}
    for name, config in itertools.islice(raw.items(), MAX_ENTRIES):
        if budget.left <= 0:
            break
        key = _key(name)
        if key is None:
            continue
        ranks = config.get("ranks", config) if isinstance(config, dict) else config
        groups[key] = _ranks_once(key, ranks, budget, shared)
    return groups


def _ranks_once(name: str, ranks: object, budget: _Budget, shared: SharedGroups | None) -> tuple[int, ...]:
    """_ranks_of, read once per distinct list when `shared` is given and charged to the budget as if read
    again. Only a list the budget would read whole is shared. A list equal to one read before is read as
    that one was (Python's equality: [True, 2.0] equals [1, 2]); a trace could name those ranks anyway."""
    listed = ranks.get("runs") if isinstance(ranks, dict) else ranks
    if shared is None or not isinstance(listed, list) or len(listed) >= budget.left:
        return _ranks_of(ranks, budget)
    try:
        key = (name, tuple(tuple(run) if isinstance(run, list) else run for run in listed))
        found = shared.get(key)
    except TypeError:  # an unhashable item: read it as it is
        return _ranks_of(ranks, budget)
    if found is None:
        found = shared[key] = _ranks_of(ranks, budget)
    else:
        budget.left -= len(found) + 1
    return found


def _status(raw: object) -> dict[str, dict[str, int]]:
    if not isinstance(raw, dict):
        return {}
    status: dict[str, dict[str, int]] = {}
    for k, st in itertools.islice(raw.items(), MAX_ENTRIES):
        key = _key(k)
        if key is None or not isinstance(st, dict):
            continue
        status[key] = {name: v for s, v in itertools.islice(st.items(), 8)
                       if (name := _key(s)) is not None and isinstance(v, int) and not isinstance(v, bool)
                       and -2**63 <= v < 2**63}
    return status


def parse(data: bytes, rank: int | None = None, source: str = "", node: str = "") -> RankTrace:
    """One dump. `rank` defaults to the digits the file name ends with (PyTorch appends the rank). Whatever
    the file holds, the answer is a trace or a FlightRecorderError."""
    try:
        return _parse(data, rank, source, node)
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError) as exc:
        raise FlightRecorderError(f"{source}: a Flight Recorder dump of the wrong shape ({type(exc).__name__})") \
            from None


def _parse(data: bytes, rank: int | None, source: str, node: str) -> RankTrace:
    loaded = _loads(data, source)
    if rank is None:
        found = _RANK_SUFFIX.search(Path(source).name)
        if found is None:
            raise FlightRecorderError(f"{source}: no rank in the file name (PyTorch names dumps <prefix><rank>)")
        rank = int(found.group(1))
    budget = _Budget()
    entries = _entries(loaded["entries"], budget, _KEPT)
    return RankTrace(rank, _text(loaded.get("version", "")), entries, _groups(loaded.get("pg_config"), budget),
                     _status(loaded.get("pg_status")), source, node)


def read(path: str | Path, node: str = "") -> RankTrace:
    """A dump a person names (`analyze`): a regular file of at most MAX_DUMP_BYTES."""
    try:
        data = rank_files.read_given(path, MAX_DUMP_BYTES)
    except rank_files.RankFileError as exc:
        raise FlightRecorderError(str(exc)) from None
    return parse(data, source=str(path), node=node)


def looks_like_dump(path: Path) -> bool:
    """A file named <prefix><rank> that starts like a pickle (protocol 2+) or like the JSON dump."""
    if not path.is_file() or not _RANK_SUFFIX.search(path.name):
        return False
    try:
        with path.open("rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return starts_like_dump(head)


def starts_like_dump(head: bytes) -> bool:
    """The first bytes of a file: a pickle (protocol 2+), or JSON naming a dump's `entries` or `pg_config`."""
    return head[:1] == b"\x80" or (head.lstrip()[:1] == b"{" and (b'"entries"' in head or b'"pg_config"' in head))
