"""The project's own trace format: JSON Lines, written by `stall-watchdog record`.

Line 1 is a header: {"stall_watchdog_recording": 1, "source": ..., "started": ISO-8601, ...}.
Every other line is one snapshot of the node, column by column:

    {"t": 1767225600.0, "gpus": {"index": [0, 1], "power_watts": [150.2, 149.8], "pids": [[4711], [4712]]}}

Each key of "gpus" is a GpuSample field name in base units, with one entry per GPU (null where that GPU
does not support the reading, or read as no number: NaN or infinity). A column is left out when no GPU has
it. "health" holds ok|lost|hung, "errors" per GPU a map of field -> why it could not be read, "pids" the compute
processes, "host_cpu_ratio" and "host_io_bytes_per_second" the host progress of those processes, "xids" the Xid events
of each GPU since the sample before, the health counters (model.HEALTH_COUNTERS) as whole numbers, and
"rank_waits" the stack sample counts of each GPU's rank (model.RANK_WAITS), "nccl_waits" the same counts timed
from the rank's NCCL Inspector log.
Columns, rather than one object per GPU, make a day-long trace several times faster to read.
"""

from __future__ import annotations

import itertools
import json
import operator
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Annotated, Any, Literal, Protocol

import msgspec

from watchdog.sample.errors import SkipLog, TraceError
from watchdog.sample.lines import MAX_GPUS, TextLines, TraceGpus, line_blocks
from watchdog.sample.smi_cells import KINDS, most
from watchdog.vocabulary.model import (
    INTEGER_FIELDS,
    GpuHealth,
    GpuSample,
    NodeSnapshot,
    SnapshotBlock,
    each_snapshot,
    samples_of,
)

FORMAT_KEY = "stall_watchdog_recording"
FORMAT_VERSION = 1

_FIELDS = GpuSample._fields
_DEFAULTS = GpuSample._field_defaults
_INTS = {"index", *INTEGER_FIELDS}
_COUNTS = ("xids", "rank_waits", "nccl_waits")  # a tuple of counts (whole numbers, none negative) per GPU
_TUPLES = ("pids", *_COUNTS)  # a tuple of whole numbers per GPU
_HEALTH = {h.value: h for h in GpuHealth}
_PLAIN = frozenset(_FIELDS) - {"health", "errors", *_TUPLES}  # written as they are, left out where no GPU has them
_ENCODE = msgspec.json.Encoder().encode  # a reading that is not a number (NaN, infinity) is written null
_LARGEST = 1e15  # no reading or Unix time is this large


def header(source: str, started: str, **extra: object) -> dict[str, object]:
    return {FORMAT_KEY: FORMAT_VERSION, "source": source, "started": started, **extra}


def encode(snapshot: NodeSnapshot) -> str:
    """One snapshot's line, its columns in GpuSample's field order (no line break)."""
    columns: dict[str, Any] = {}
    for name, values in zip(_FIELDS, zip(*snapshot.gpus)):  # each field's values, GPU by GPU (tuples: arrays)
        if name in _PLAIN:
            if values.count(None) != len(values) or name == "index":
                columns[name] = values
        elif name == "health":
            if values.count(GpuHealth.OK) != len(values):
                columns[name] = [v.value for v in values]
        elif any(values):  # the tuples, and errors
            columns[name] = [dict(v) if v else None for v in values] if name == "errors" else values
    return _ENCODE({"t": snapshot.time_seconds, "gpus": columns}).decode()


class Writes(Protocol):
    """Where a recording is written: an open text file, or a bundle's private file (boundary/private_files.py)."""

    def write(self, text: str, /) -> object: ...


def write(stream: Writes, head: dict[str, object], snapshots: Iterable[NodeSnapshot]) -> int:
    stream.write(json.dumps(head) + "\n")
    count = 0
    for snapshot in snapshots:
        stream.write(encode(snapshot) + "\n")
        count += 1
    return count


# What one line may hold, so that a hostile line of 1 MiB costs its parse and little more: at most MAX_GPUS GPUs,
# and of each GPU at most _ENTRIES processes, Xids (the daemon drains at most 256 Xid events a tick,
# sample/nvml.py) or counts (model.RANK_WAITS names 7), an error for each field, names and UUIDs of at most
# _TEXT characters (NVML's buffers for them are 96 bytes), and readings no larger than a real GPU's.
_ENTRIES = 256
_TEXT = 256


def _limited(kind: Any, most: int) -> Any:
    return Annotated[kind, msgspec.Meta(max_length=most)]


def _bounded(kind: type, most: float) -> Any:
    return Annotated[kind, msgspec.Meta(ge=0, le=kind(most))]


_Reading = Annotated[float, msgspec.Meta(ge=0, lt=_LARGEST)]
_Count = Annotated[int, msgspec.Meta(ge=0, lt=int(_LARGEST))]
_Pid = Annotated[int, msgspec.Meta(ge=0, le=1 << 22)]  # Linux's pids are below 2^22
_Text = Annotated[str, msgspec.Meta(max_length=_TEXT)]
_Message = Annotated[str, msgspec.Meta(max_length=4 * _TEXT)]
_ENTRY_TYPES: dict[str, Any] = {  # what one GPU's entry of each column is, where it is not a _Reading
    "index": _Count,
    "uuid": _Text | None,
    "name": _Text | None,
    "health": Literal["ok", "lost", "hung"] | None,
    "pids": _limited(tuple[_Pid, ...], _ENTRIES) | None,  # decoded straight into GpuSample's tuples
    **{name: _limited(tuple[_Count, ...], _ENTRIES) | None for name in _COUNTS},
    "errors": _limited(dict[_Text, _Message], len(_FIELDS)) | None,
    **{name: _Count | None for name in _INTS - {"index"}},
    **{name: _bounded(int if name in _INTS else float, most(kind)) | None for name, kind in KINDS.items()},
}


def _column(name: str) -> Any:
    column = _limited(list[_ENTRY_TYPES.get(name, _Reading | None)], MAX_GPUS)  # type: ignore[misc]
    return column if name == "index" else column | None


# The line's schema, one column per GpuSample field (in its order): msgspec checks every type, range and
# length while it parses, and names the place of what is wrong ("at `$.gpus.power_watts[3]`").
_Columns = msgspec.defstruct("_Columns", [(name, _column(name), None) for name in _FIELDS], forbid_unknown_fields=True)
_Line = msgspec.defstruct("_Line", [("t", Annotated[float, msgspec.Meta(gt=-_LARGEST, lt=_LARGEST)]),
                                    ("gpus", _Columns)])
_DECODE = msgspec.json.Decoder(_Line).decode


def _empty_for_none(column: list[Any]) -> list[Any]:
    """A tuple column with a GPU's null read as no values."""
    return [x or () for x in column] if None in column else column


_CONVERT: dict[str, Callable[[list[Any]], list[Any]]] = {
    "health": lambda column: [_HEALTH[v] if v is not None else GpuHealth.OK for v in column],
    **{name: _empty_for_none for name in _TUPLES},
    "errors": lambda column: [tuple(e.items()) if e else () for e in column],
}
_CONVERT_AT = [(_FIELDS.index(name), convert) for name, convert in _CONVERT.items()]


_KINDS = {"`object`": "an object", "`array`": "a list", "`str`": "text", "`int`": "a whole number",
          "`float`": "a number", "`bool`": "true or false", "`null`": "null"}


def _plain(said: str) -> str:
    """msgspec's 'Expected `array`, got `str` - at `$.gpus.index`' as a snapshot's reader says it: 'not a
    snapshot: expected a list, got text, at gpus.index'."""
    said = re.sub(r" - at `\$\.?([^`]*)`", lambda m: f", at {m.group(1)}" if m.group(1) else "", said)
    said = said.replace("Object contains unknown field", "unknown GPU field")
    if not said.startswith("Expected "):
        return said
    words = re.sub(r"`([a-z |]+)`", lambda m: " or ".join(_KINDS.get(f"`{k}`", k) for k in m.group(1).split(" | ")),
                   said)
    return "not a snapshot: " + words[0].lower() + words[1:]


def _decode_columns(line: str | bytes) -> tuple[float, list[Any]]:
    """A snapshot line's time and GpuSample field columns (None for a field the line leaves out), checked."""
    try:
        raw = _DECODE(line)
    except msgspec.ValidationError as exc:
        raise ValueError(_plain(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"not valid JSON ({str(exc).removeprefix('JSON is malformed: ')})") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    columns: list[Any] = list(msgspec.structs.astuple(raw.gpus))  # type: ignore[attr-defined]
    count = len(columns[0])
    if set(map(len, filter(None, columns))) - {count}:
        name, column = next((n, c) for n, c in zip(_FIELDS, columns) if c is not None and len(c) != count)
        raise ValueError(f"'{name}' must be a list with one entry per GPU ({count})")
    if len(set(columns[0])) != count:
        raise ValueError("the same GPU index twice in one sample")
    for position, convert in _CONVERT_AT:
        if columns[position] is not None:
            columns[position] = convert(columns[position])
    return raw.t, columns  # type: ignore[attr-defined]


def read(stream: Iterable[str] | TextLines, path: str, skips: SkipLog | None = None) -> Iterator[NodeSnapshot]:
    return each_snapshot(stretches(stream, path, skips))


class _Run:
    """Consecutive lines with the same GPUs and the same columns, gathered into one SnapshotBlock.
    Each line's columns are appended as it arrives, while its values are fresh in memory. Repeated
    names, UUIDs and process lists become one object each (`shared`): a day repeats the same few, and a
    block is smaller to keep and to hand to another process."""

    def __init__(self, t: float, columns: list[Any], shared: dict[Any, Any]):
        self.layout, self.shape, self.shared = columns[0], _shape(columns), shared
        if len(shared) > _SHARED:
            shared.clear()
        self.times: list[float] = []
        self.columns: list[list[Any] | None] = [None if absent else [] for absent in self.shape]
        # the line before's column, by slot, for each shared column the run has
        self._last: dict[int, list[Any] | None] = {slot: None for slot in _SHARED_SLOTS if columns[slot] is not None}
        self.add(t, columns)

    def takes(self, columns: list[Any]) -> bool:
        return columns[0] == self.layout and _shape(columns) == self.shape

    def add(self, t: float, columns: list[Any]) -> None:
        self.times.append(t)
        for slot, last in self._last.items():
            column = columns[slot]
            if column == last:  # as on the line before: its objects again
                columns[slot] = last
            else:
                columns[slot] = self._last[slot] = list(map(self.shared.setdefault, column, column))
        for joined, column in zip(self.columns, columns):
            if joined is not None:
                joined.extend(column)

    def block(self) -> NodeSnapshot | SnapshotBlock:
        if len(self.times) == 1:
            return NodeSnapshot(self.times[0], tuple(samples_of(self.columns, len(self.layout))))
        return SnapshotBlock(self.times, tuple(self.layout), tuple(self.columns))


_SHARED_SLOTS = [_FIELDS.index(name) for name in ("uuid", "name", "pids")]
# Distinct values kept to be shared, at most (then forgotten): a day repeats a few dozen, and each may be a process
# list of _ENTRIES pids (9 KiB), so that a trace whose every line names new ones holds 40 MiB of them, not gigabytes.
_SHARED = 1 << 12


def _shape(columns: list[Any]) -> list[bool]:
    """Which columns a line leaves out."""
    return list(map(operator.is_, columns, itertools.repeat(None)))


# Lines gathered into one block at most: as many as the detectors check for steadiness at once. A small
# block is still in the processor's cache when it is handed on, and when a replay that reads ahead
# pickles, sends and detects on it: a day of an 8-GPU node replays in two thirds of the time it takes
# with blocks of 1,024 lines (bench/replay_throughput.py).
_RUN_LINES = 128


def stretches(stream: Iterable[str] | TextLines, path: str, skips: SkipLog | None = None, most: int = _RUN_LINES
              ) -> Iterator[NodeSnapshot | SnapshotBlock]:
    """The recording's snapshots; consecutive ones with the same GPUs and columns as column blocks of at most
    `most` lines (a reader that keeps little of each, as the incident report does, asks for short ones: a block
    of 64 GPUs' 128 lines holds 6 MiB of readings)."""
    skips = skips if skips is not None else SkipLog()
    blocks: Iterator[tuple[int, list[str]] | tuple[int, list[bytes]]] = (
        stream.byte_blocks() if isinstance(stream, TextLines) else line_blocks(stream))
    head_block = next(blocks, None)
    head_number, head_lines = head_block if head_block is not None else (1, [])
    first = head_lines[0] if head_lines else ""
    try:
        head = msgspec.json.decode(first) if first.strip() else None
    except (msgspec.DecodeError, RecursionError):
        head = None
    if not isinstance(head, dict) or FORMAT_KEY not in head:
        raise TraceError(f"{path}:1: not a stall-watchdog recording (no {FORMAT_KEY!r} header)")
    if head[FORMAT_KEY] != FORMAT_VERSION:
        raise TraceError(f"{path}:1: recording format version {head[FORMAT_KEY]!r}; this version reads "
                         f"{FORMAT_VERSION}")
    # A clock that steps back is kept, as in an nvidia-smi log: the detectors notice the step and say so.
    run: _Run | None = None
    shared: dict[Any, Any] = {}
    gpus = TraceGpus()
    for number, lines in itertools.chain([(head_number + 1, head_lines[1:])], blocks):
        for offset, line in enumerate[str | bytes](lines):
            if not line or line.isspace():  # (strip() would copy every line to find out)
                continue
            try:
                t, columns = _decode_columns(line)
                if run is None or columns[0] != run.layout:
                    gpus.admit(columns[0])
            except ValueError as exc:
                if run is not None:  # what came before a malformed line is handed on before its error
                    yield run.block()
                    run = None
                skips.malformed(f"{path}:{number + offset}: {_utf8_problem(line) or exc}")
                continue
            if run is not None and run.takes(columns) and len(run.times) < most:
                run.add(t, columns)
                continue
            if run is not None:
                yield run.block()
            run = _Run(t, columns, shared)
    if run is not None:
        yield run.block()


def _utf8_problem(line: str | bytes) -> str | None:
    if isinstance(line, bytes):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"not UTF-8 text (byte {exc.start})"
    return None
