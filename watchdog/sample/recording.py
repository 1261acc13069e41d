"""The project's own trace format: JSON Lines, written by `stall-watchdog record`.

Line 1 is a header: {"stall_watchdog_recording": 1, "source": ..., "started": ISO-8601, ...}.
Every other line is one snapshot of the node, column by column:

    {"t": 1767225600.0, "gpus": {"index": [0, 1], "power_watts": [150.2, 149.8], "pids": [[4711], [4712]]}}

Each key of "gpus" is a GpuSample field name in base units, with one entry per GPU (null where that GPU
does not support the reading). A column is left out when no GPU has it. "health" holds ok|lost|hung,
"errors" per GPU a map of field -> why it could not be read, "pids" the compute processes,
"host_cpu_ratio" and "host_io_bytes_per_second" the host progress of those processes.
Columns, rather than one object per GPU, make a day-long trace several times faster to read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from itertools import chain
from typing import Any, TextIO

from watchdog.model import GpuHealth, GpuSample, NodeSnapshot
from watchdog.sample.errors import SkipLog, TraceError

FORMAT_KEY = "stall_watchdog_recording"
FORMAT_VERSION = 1

_FIELDS = GpuSample._fields
_DEFAULTS = GpuSample._field_defaults
_INTS = {"index", "memory_used_bytes", "memory_total_bytes", "clock_event_reasons"}
_STRINGS = {"uuid", "name"}
_NUMBER_TYPES = {int, float, type(None)}  # exact types: a JSON true/false is no number here
_INT_TYPES = {int, type(None)}
_STR_TYPES = {str, type(None)}
_LIST_TYPES = {list, type(None)}
_HEALTH = {h.value: h for h in GpuHealth}
_LARGEST = 1e15  # no reading or Unix time is this large; NaN, Infinity and 1e400 fail the range check too
MAX_GPUS = 1024


def header(source: str, started: str, **extra: object) -> dict[str, object]:
    return {FORMAT_KEY: FORMAT_VERSION, "source": source, "started": started, **extra}


def encode(snapshot: NodeSnapshot) -> str:
    gpus = snapshot.gpus
    columns: dict[str, list[Any]] = {}
    for position, name in enumerate(_FIELDS):
        values: list[Any] = [g[position] for g in gpus]
        if name == "health":
            if any(v is not GpuHealth.OK for v in values):
                columns[name] = [v.value for v in values]
        elif name == "pids":
            if any(values):
                columns[name] = [list(v) for v in values]
        elif name == "errors":
            if any(values):
                columns[name] = [dict(v) if v else None for v in values]
        elif name == "index" or any(v is not None for v in values):
            columns[name] = values
    return json.dumps({"t": snapshot.time_seconds, "gpus": columns}, separators=(",", ":"))


def write(stream: TextIO, head: dict[str, object], snapshots: Iterable[NodeSnapshot]) -> int:
    stream.write(json.dumps(head) + "\n")
    count = 0
    for snapshot in snapshots:
        stream.write(encode(snapshot) + "\n")
        count += 1
    return count


def _check_column(name: str, column: list[Any]) -> list[Any]:
    """Validate one column; returns it converted to GpuSample's types."""
    kinds = set(map(type, column))
    if name in _STRINGS:
        if not kinds <= _STR_TYPES:
            raise ValueError(f"'{name}' entries must be strings or null")
    elif name == "health":
        try:
            return [_HEALTH[v] if v is not None else GpuHealth.OK for v in column]
        except (KeyError, TypeError):
            raise ValueError("'health' entries must be ok, lost or hung") from None
    elif name == "pids":
        if not (set(map(type, column)) <= _LIST_TYPES
                and set(map(type, chain.from_iterable(filter(None, column)))) <= {int}):
            raise ValueError("'pids' entries must be lists of integers")
        return [tuple(p) if p else () for p in column]
    elif name == "errors":
        if not all(type(e) is dict for e in column if e is not None):
            raise ValueError("'errors' entries must map a field to a message, or be null")
        return [tuple((str(k), str(v)) for k, v in e.items()) if e else () for e in column]
    elif name == "index":
        if kinds != {int}:
            raise ValueError("'index' entries must be integers")
    elif name in _INTS:
        if not kinds <= _INT_TYPES:
            raise ValueError(f"'{name}' entries must be integers or null")
    elif not kinds <= _NUMBER_TYPES:
        bad = next(v for v in column if type(v) not in _NUMBER_TYPES)
        raise ValueError(f"'{name}' entries must be numbers or null, got {str(bad)[:40]!r}")
    if name not in _STRINGS and any(v is not None and not (0 <= v < _LARGEST) for v in column):
        bad = next(v for v in column if v is not None and not (0 <= v < _LARGEST))
        raise ValueError(f"'{name}' entries must be finite and not negative, got {str(bad)[:40]}")
    return column


def decode(line: str) -> NodeSnapshot:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    if type(raw) is not dict or "t" not in raw or "gpus" not in raw:
        raise ValueError("expected an object with 't' and 'gpus'")
    t, gpus = raw["t"], raw["gpus"]
    if type(t) not in (int, float) or not (-_LARGEST < t < _LARGEST):
        raise ValueError(f"'t' must be a finite number of seconds, got {str(t)[:40]}")
    if type(gpus) is not dict or "index" not in gpus:
        raise ValueError("'gpus' must be an object of columns with at least 'index'")
    unknown = gpus.keys() - set(_FIELDS)
    if unknown:
        raise ValueError(f"unknown GPU field(s) {', '.join(sorted(unknown))}")
    count = len(gpus["index"]) if type(gpus["index"]) is list else -1
    if count > MAX_GPUS:
        raise ValueError(f"{count} GPUs in one sample; at most {MAX_GPUS}")
    columns = []
    for name in _FIELDS:
        column = gpus.get(name)
        if column is None:
            columns.append([_DEFAULTS.get(name)] * count)
            continue
        if type(column) is not list or len(column) != count:
            raise ValueError(f"'{name}' must be a list with one entry per GPU ({count})")
        columns.append(_check_column(name, column))
    if len(set(gpus["index"])) != count:
        raise ValueError("the same GPU index twice in one sample")
    new = tuple.__new__
    return NodeSnapshot(float(t), tuple(new(GpuSample, row) for row in zip(*columns)))


def read(stream: TextIO, path: str, skips: SkipLog | None = None) -> Iterator[NodeSnapshot]:
    skips = skips if skips is not None else SkipLog()
    first = stream.readline()
    try:
        head = json.loads(first) if first.strip() else None
    except json.JSONDecodeError:
        head = None
    if not isinstance(head, dict) or FORMAT_KEY not in head:
        raise TraceError(f"{path}:1: not a stall-watchdog recording (no {FORMAT_KEY!r} header)")
    if head[FORMAT_KEY] != FORMAT_VERSION:
        raise TraceError(f"{path}:1: recording format version {head[FORMAT_KEY]!r}; this version reads "
                         f"{FORMAT_VERSION}")
    # A clock that steps back is kept, as in an nvidia-smi log: the detectors notice the step and say so.
    for number, line in enumerate(stream, start=2):
        if not line.strip():
            continue
        try:
            snapshot = decode(line)
        except ValueError as exc:
            skips.malformed(f"{path}:{number}: {exc}")
            continue
        yield snapshot
