"""nvidia-smi CSV logs, as people already record them:

    nvidia-smi --query-gpu=timestamp,index,utilization.gpu,power.draw,... --format=csv[,noheader][,nounits] -l 1

Any subset and order of the usual fields; values with or without units; `[N/A]` and `[Not Supported]`
read as missing. Without an `index` (or `uuid`) column, nvidia-smi still prints the GPUs of one sample
in enumeration order a few milliseconds apart: the GPU count is inferred from the timestamp gaps and
each row gets its position in its sample.
"""

from __future__ import annotations

import csv
import functools
import itertools
import operator
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, NamedTuple

from watchdog.model import (
    HEALTH_COUNTERS,
    SAMPLE_DEFAULTS,
    GpuHealth,
    GpuSample,
    NodeSnapshot,
    SnapshotBlock,
    each_snapshot,
    samples_of,
)
from watchdog.sample.errors import SkipLog, TraceError
from watchdog.sample.lines import TextLines, line_blocks
from watchdog.sample.smi_gpu_count import group_by_time, with_index

# nvidia-smi field name -> (GpuSample field, unit nvidia-smi uses when the log has no units)
_NUMERIC: dict[str, tuple[str, str]] = {
    "utilization.gpu": ("utilization_ratio", "%"),
    "utilization.memory": ("memory_utilization_ratio", "%"),
    "power.draw": ("power_watts", "W"),
    "power.draw.instant": ("power_watts", "W"),
    "power.draw.average": ("power_watts", "W"),
    "enforced.power.limit": ("power_limit_watts", "W"),
    "power.limit": ("power_limit_watts", "W"),
    "clocks.sm": ("sm_clock_hertz", "MHz"),
    "clocks.current.sm": ("sm_clock_hertz", "MHz"),
    "clocks.max.sm": ("sm_clock_max_hertz", "MHz"),
    "clocks.max.sm_clock": ("sm_clock_max_hertz", "MHz"),
    "memory.used": ("memory_used_bytes", "MiB"),
    "memory.total": ("memory_total_bytes", "MiB"),
    "temperature.gpu": ("temperature_celsius", "C"),
    # health (detect/gpu_health.py)
    "ecc.errors.corrected.volatile.total": ("ecc_corrected", ""),
    "ecc.errors.uncorrected.volatile.total": ("ecc_uncorrected", ""),
    "pcie.link.gen.current": ("pcie_link_gen", ""),
    "pcie.link.gen.gpucurrent": ("pcie_link_gen", ""),
    "pcie.link.gen.max": ("pcie_link_gen_max", ""),
    "pcie.link.gen.gpumax": ("pcie_link_gen_max", ""),
    "pcie.link.width.current": ("pcie_link_width", ""),
    "pcie.link.width.max": ("pcie_link_width_max", ""),
}
# Fields that name the same GpuSample field: the first listed wins when a log has both.
_PREFERENCE = ["enforced.power.limit", "power.limit", "power.draw", "power.draw.instant", "power.draw.average"]

_REASON_BITS = {
    "gpu_idle": 0x1, "applications_clocks_setting": 0x2, "sw_power_cap": 0x4, "hw_slowdown": 0x8,
    "sync_boost": 0x10, "sw_thermal_slowdown": 0x20, "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80, "display_clock_setting": 0x100,
}
_REASON_PREFIXES = ("clocks_event_reasons.", "clocks_throttle_reasons.")

_SCALE = {
    "%": 0.01, "W": 1.0, "mW": 0.001, "MiB": 2.0**20, "GiB": 2.0**30, "KiB": 1024.0, "B": 1.0,
    "MB": 2.0**20, "GB": 2.0**30, "MHz": 1e6, "GHz": 1e9, "kHz": 1e3, "Hz": 1.0, "C": 1.0, "": 1.0,
}
_MISSING = {"", "n/a", "[n/a]", "[not supported]", "not supported", "[unknown error]", "[insufficient permissions]"}
_LOST = {"[gpu is lost]", "gpu is lost", "[gpu requires reset]"}
_NUMBER = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?)\s*([A-Za-z%]*)\s*$")
_HEADER = re.compile(r"^\s*([A-Za-z_.]+)\s*(?:\[([^\]]*)\])?\s*$")
_TIME_FORMATS = ("%Y/%m/%d %H:%M:%S.%f", "%Y/%m/%d %H:%M:%S", "%Y-%m-%d %H:%M:%S.%f", "%Y-%m-%dT%H:%M:%S.%f",
                 "%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M:%S")
_INTEGER_FIELDS = {"memory_used_bytes", "memory_total_bytes", *HEALTH_COUNTERS}


class _Cells(dict[str, Any]):
    """One column's cell text -> value, remembered: a day of log repeats the same few thousand power
    readings and a hundred utilizations, and a dictionary lookup is several times cheaper than float().
    `convert` raises ValueError on anything it would not read cell by cell either."""

    def __init__(self, convert: Callable[[str], Any]):
        super().__init__()
        self._convert = convert

    def __missing__(self, text: str) -> Any:
        if len(self) >= 1 << 16:
            self.clear()
        value = self[text] = self._convert(text)
        return value


def parse_timestamp(text: str) -> float:
    """nvidia-smi's local, offset-less timestamp, read as if UTC (only differences are used)."""
    text = text.strip()
    # Fast path for nvidia-smi's own "2025/07/27 00:22:27.858": strptime is the slowest part of a row.
    try:
        return _minute_seconds(text[:17]) + _second(text[17:])
    except ValueError:
        pass
    for fmt in _TIME_FORMATS:
        try:
            return datetime.strptime(text, fmt).replace(tzinfo=timezone.utc).timestamp()
        except ValueError:
            continue
    raise ValueError(f"cannot read {text!r} as a timestamp")


def _second(text: str) -> float:
    value = float(text)
    if not 0 <= value < 61:  # NaN fails too
        raise ValueError(text)
    return value


def _minute(prefix: str) -> float:
    """"2025/07/27 00:22:" -> its Unix time (a day of log has 1,440 of them: see _minute_seconds)."""
    if not (len(prefix) == 17 and prefix[4] == prefix[7] and prefix[4] in "/-" and prefix[10] in " T"
            and prefix[13] == prefix[16] == ":"):
        raise ValueError(prefix)
    hours, minutes = int(prefix[11:13]), int(prefix[14:16])
    if not (0 <= hours < 24 and 0 <= minutes < 60):
        raise ValueError(prefix)
    return _day_seconds(prefix[:10].replace("-", "/")) + hours * 3600 + minutes * 60


_minute_seconds = _Cells(_minute).__getitem__


@functools.lru_cache(maxsize=64)
def _day_seconds(date: str) -> float:
    return datetime.strptime(date, "%Y/%m/%d").replace(tzinfo=timezone.utc).timestamp()


def parse_number(text: str, unit: str, default_unit: str) -> float | None:
    """'71.25 W' -> 71.25; '55 %' -> 0.55; '[N/A]' -> None. Units convert to the field's base unit."""
    number, _, written = text.strip().partition(" ")
    scale = _SCALE.get(written or unit or default_unit)
    if scale is not None:
        try:
            value = float(number)  # the common case: nvidia-smi's own "71.25 W"
        except ValueError:
            pass
        else:
            if 0 <= value < _LARGEST:  # "nan", "inf", 400 digits and negatives go to the strict path
                return value * scale
    lowered = text.strip().lower()
    if lowered in _MISSING:
        return None
    match = _NUMBER.match(text)
    if match is None:
        raise ValueError(f"cannot read {text.strip()!r} as a number")
    digits, written = match.groups()
    if digits.startswith("-"):
        raise ValueError(f"negative value {text.strip()!r}")
    scale = _SCALE.get(written or unit or default_unit)
    if scale is None:
        raise ValueError(f"unknown unit {written or unit!r} in {text.strip()!r}")
    if not float(digits) < _LARGEST:
        raise ValueError(f"{text.strip()[:40]!r} is out of range")
    return float(digits) * scale


_LARGEST = 1e15  # no reading is this large (a JSON Lines recording has the same bound)
_COUNT = re.compile(r"\s*\d{1,15}\s*", re.ASCII)


def _as_count(text: str, value: float) -> int:
    """A health counter's cell: a whole number, written without a unit."""
    if not _COUNT.fullmatch(text):
        raise ValueError(f"{text.strip()[:40]!r} is not a count (a whole number)")
    return int(value)


@dataclass(frozen=True)
class _Column:
    position: int
    name: str  # nvidia-smi field name, lower case
    unit: str
    header: str  # as written, for error messages


def _parse_header(fields: list[str]) -> list[_Column]:
    columns = []
    for position, raw in enumerate(fields):
        match = _HEADER.match(raw)
        name, unit = (match.group(1).lower(), match.group(2) or "") if match else (raw.strip().lower(), "")
        columns.append(_Column(position, name, unit.strip(), raw.strip()))
    return columns


def _looks_like_header(fields: list[str]) -> bool:
    names = {c.name for c in _parse_header(fields)}
    return bool(names & (set(_NUMERIC) | {"timestamp", "index", "uuid", "name"}))


RowParser = Callable[[list[str]], tuple[float | None, int | None, str | None, GpuSample]]


def _numeric_columns(columns: list[_Column]) -> list[tuple[int, str, str, str, str]]:
    """(position, GpuSample field, unit, default unit, header) of the numeric columns: where two
    columns fill the same field, the one _PREFERENCE lists first."""
    numeric: list[tuple[int, str, str, str, str]] = []
    claimed: dict[str, str] = {}
    for col in sorted(columns, key=lambda c: _PREFERENCE.index(c.name) if c.name in _PREFERENCE else 99):
        if col.name in _NUMERIC:
            target, default_unit = _NUMERIC[col.name]
            if target in claimed:
                continue
            claimed[target] = col.name
            numeric.append((col.position, target, col.unit, default_unit, col.header))
    return numeric


def _reason_columns(columns: list[_Column]) -> tuple[list[tuple[int, int, str]], tuple[int, str] | None]:
    """The clock-event reason columns: one per reason (position, bit, header), and the hex mask."""
    reasons: list[tuple[int, int, str]] = []
    active_mask: tuple[int, str] | None = None
    for col in columns:
        for prefix in _REASON_PREFIXES:
            if col.name.startswith(prefix):
                reason = col.name[len(prefix):]
                if reason == "active":
                    active_mask = (col.position, col.header)
                elif reason in _REASON_BITS:
                    reasons.append((col.position, _REASON_BITS[reason], col.header))
    return reasons, active_mask


def _row_parser(columns: list[_Column]) -> RowParser:
    """Build a function turning one CSV row into (time, index, uuid, sample)."""
    numeric = _numeric_columns(columns)
    reasons, active_mask = _reason_columns(columns)
    by_name = {c.name: c.position for c in columns}
    t_pos, i_pos, u_pos, n_pos = (by_name.get(k) for k in ("timestamp", "index", "uuid", "name"))
    width = len(columns)

    def parse(row: list[str]) -> tuple[float | None, int | None, str | None, GpuSample]:
        if len(row) != width:
            raise ValueError(f"expected {width} columns, got {len(row)}")
        values: dict[str, object] = {}
        health = GpuHealth.OK
        for position, target, unit, default_unit, header in numeric:
            text = row[position]
            if text.strip().lower() in _LOST:
                health = GpuHealth.LOST
                continue
            try:
                number = parse_number(text, unit, default_unit)
            except ValueError as exc:
                raise ValueError(f"column {header!r}: {exc}") from None
            if number is not None:
                try:
                    values[target] = (_as_count(text, number) if target in HEALTH_COUNTERS
                                      else int(number) if target in _INTEGER_FIELDS else number)
                except ValueError as exc:
                    raise ValueError(f"column {header!r}: {exc}") from None
        bits: int | None = None
        if active_mask is not None:
            text = row[active_mask[0]].strip()
            if text.lower() not in _MISSING:
                try:
                    bits = int(text, 16)
                except ValueError:
                    raise ValueError(f"column {active_mask[1]!r}: cannot read {text!r} as a bit mask") from None
        for position, bit, header in reasons:
            text = row[position].strip().lower()
            if text in _MISSING:
                continue
            if text not in ("active", "not active"):
                raise ValueError(f"column {header!r}: expected 'Active' or 'Not Active', got {text!r}")
            bits = (bits or 0) | (bit if text == "active" else 0)
        if bits is not None:
            values["clock_event_reasons"] = bits
        t = None
        if t_pos is not None:
            try:
                t = parse_timestamp(row[t_pos])
            except ValueError as exc:
                raise ValueError(f"column 'timestamp': {exc}") from None
        index = None
        if i_pos is not None:
            try:
                index = int(row[i_pos])
            except ValueError:
                raise ValueError(f"column 'index': cannot read {row[i_pos].strip()!r} as a GPU index") from None
        uuid = row[u_pos].strip() if u_pos is not None else None
        name = row[n_pos].strip() if n_pos is not None else None
        sample = GpuSample(index=index or 0, uuid=uuid, name=name, health=health, **values)  # type: ignore[arg-type]
        return t, index, uuid, sample

    return parse


_Row = tuple[int, float, int | None, str | None, GpuSample]


def _strict_number(unit: str, default_unit: str, integer: bool, count: bool = False) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        if text.strip().lower() in _LOST:
            raise ValueError(text)  # a typed state: the row by row path builds the lost sample
        value = parse_number(text, unit, default_unit)
        if value is None or not integer:
            return value
        return _as_count(text, value) if count else int(value)
    return convert


def _reason_state(bit: int) -> Callable[[str], int | None]:
    def convert(text: str) -> int | None:
        state = text.strip().lower()
        if state in _MISSING:
            return None
        if state not in ("active", "not active"):
            raise ValueError(text)
        return bit if state == "active" else 0
    return convert


def _hex_mask(text: str) -> int | None:
    return None if text.strip().lower() in _MISSING else int(text, 16)


def _block_parser(columns: list[_Column]) -> Callable[[list[str]], tuple[list[float], list[Any]] | None]:
    """Build a function turning a block of lines into (times, GpuSample field columns: None for a field
    the log does not have), a column at a time: the block is split once, each column is a slice of it,
    and each distinct cell text is converted once. It gives up (None) on anything but plain, complete
    rows; the block is then read row by row, which names the line and the column of what is wrong."""
    width = len(columns)
    by_name = {c.name: c.position for c in columns}
    slots = {name: position for position, name in enumerate(GpuSample._fields)}
    converters: list[tuple[int, int, _Cells]] = []  # (column position, GpuSample slot, cells)
    for position, target, unit, default_unit, _ in _numeric_columns(columns):
        converters.append((position, slots[target],
                           _Cells(_strict_number(unit, default_unit, target in _INTEGER_FIELDS,
                                                 target in HEALTH_COUNTERS))))
    for name, convert in (("index", int), ("uuid", str.strip), ("name", str.strip)):
        if name in by_name:
            converters.append((by_name[name], slots[name], _Cells(convert)))
    reasons, active_mask = _reason_columns(columns)
    reason_cells = [(position, _Cells(_reason_state(bit))) for position, bit, _ in reasons]
    if active_mask is not None:
        reason_cells.insert(0, (active_mask[0], _Cells(_hex_mask)))
    stamps = _Cells(parse_timestamp)
    t_pos = by_name["timestamp"]
    separators = operator.methodcaller("count", ",")

    def parse(lines: list[str]) -> tuple[list[float], list[Any]] | None:
        text = ",".join(lines)
        if '"' in text or "\r" in text:
            return None  # quoting or carriage returns: the csv module, row by row
        per_line = list(map(separators, lines))
        if min(per_line) != width - 1 or max(per_line) != width - 1:
            return None  # blank or ragged lines
        cells = text.split(",")
        fields: list[Any] = [None] * len(GpuSample._fields)
        try:
            times = _times(cells[t_pos::width], stamps)
            for position, slot, converted in converters:
                fields[slot] = list(map(converted.__getitem__, cells[position::width]))
            if reason_cells:
                fields[slots["clock_event_reasons"]] = _combine_reasons(
                    [list(map(converted.__getitem__, cells[position::width])) for position, converted in reason_cells])
        except ValueError:
            return None
        return times, fields

    return parse


_MINUTE, _SECONDS = operator.itemgetter(slice(0, 17)), operator.itemgetter(slice(17, None))


def _times(texts: list[str], stamps: _Cells) -> list[float]:
    """A block's timestamp cells as parse_timestamp reads them. A log that stamps each row on its own
    (milliseconds apart) would miss the cell cache on every row: its minutes are cached and its seconds
    read as numbers, a column at a time, on the same fast path parse_timestamp takes."""
    if len(set(texts)) * 2 <= len(texts):
        return list(map(stamps.__getitem__, texts))
    try:
        minutes = list(map(_minute_seconds, map(_MINUTE, texts)))
        seconds = list(map(float, map(_SECONDS, texts)))
    except ValueError:  # not nvidia-smi's own format: cell by cell
        return list(map(stamps.__getitem__, texts))
    total = sum(seconds)
    if total != total or min(seconds) < 0 or max(seconds) >= 61:  # NaN, or not a second of a minute
        return list(map(stamps.__getitem__, texts))
    return list(map(operator.add, minutes, seconds))


def _combine_reasons(columns: list[list[int | None]]) -> list[int | None]:
    """OR the per-reason bits (and the hex mask) of each row; None where no column says anything."""
    bits = columns[0]
    for column in columns[1:]:
        bits = [a if b is None else b if a is None else a | b for a, b in zip(bits, column)]
    return bits


def read_smi_csv(
    stream: Iterable[str] | TextLines, path: str, fields: list[str] | None = None, skips: SkipLog | None = None,
) -> Iterator[NodeSnapshot]:
    """Snapshots from an nvidia-smi CSV log. `fields` gives the columns of a log written with noheader.
    A malformed row raises TraceError naming path:line, unless `skips` is lenient: then it is skipped and
    counted. Samples nvidia-smi itself cut short are always dropped and counted in `skips`."""
    return each_snapshot(smi_csv_stretches(stream, path, fields, skips))


def smi_csv_stretches(
    stream: Iterable[str] | TextLines, path: str, fields: list[str] | None = None, skips: SkipLog | None = None,
) -> Iterator[NodeSnapshot | SnapshotBlock]:
    """read_smi_csv's snapshots, the regular stretches of the log (the same GPUs in the same order, as
    nvidia-smi writes them) handed on as column blocks: a replay's detectors take them as they are."""
    skips = skips if skips is not None else SkipLog()
    blocks = line_blocks(stream)
    head = next(blocks, None)
    if head is None or not head[1]:
        return
    first_line, head_lines = head
    try:
        first = next(csv.reader(head_lines[:1]), [])
    except csv.Error as exc:
        raise TraceError(f"{path}:1: not a CSV header ({exc})") from None
    if _looks_like_header(first):
        columns = _parse_header(first)
        head_lines = head_lines[1:]
        first_line += 1
    elif fields:
        columns = _parse_header(fields)
    else:
        raise TraceError(f"{path}:1: no header line; pass --csv-fields with the --query-gpu list the log was "
                         "written with")
    names = {c.name for c in columns}
    if "timestamp" not in names:
        raise TraceError(f"{path}:1: the log has no timestamp column; add timestamp to --query-gpu")
    parse_row = _row_parser(columns)
    parse_block = _block_parser(columns)

    def by_row(first: int, lines: list[str]) -> Iterator[_Row | str]:
        """The rows of a block one at a time, and in their place what is wrong with a malformed one."""
        for line, text in enumerate(lines, start=first):
            try:
                row = next(csv.reader([text]), [])
            except csv.Error as exc:
                yield f"{path}:{line}: not a CSV row ({exc})"
                continue
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            try:
                t, index, uuid, sample = parse_row(row)
            except ValueError as exc:
                yield f"{path}:{line}: {exc}"
                continue
            assert t is not None
            yield line, t, index, uuid, sample

    def row_blocks() -> Iterator[_Rows]:
        for first, lines in itertools.chain([(first_line, head_lines)], blocks):
            if not lines:
                continue
            parsed = parse_block(lines)
            if parsed is None:  # row by row; a malformed row is reported after the rows before it
                for malformed, items in itertools.groupby(by_row(first, lines), key=lambda item: isinstance(item, str)):
                    if malformed:
                        for message in items:
                            skips.malformed(message)  # type: ignore[arg-type]
                    else:
                        numbers, times, indexes, uuids, samples = map(list, zip(*items))
                        yield _Rows(numbers, times, indexes, uuids, samples)
                continue
            times, fields = parsed
            count = len(times)
            yield _Rows(range(first, first + count), times, fields[0] or [None] * count,
                        fields[1] or [None] * count, None, fields)

    if "index" in names or "uuid" in names:
        yield from _group_by_identity(row_blocks(), path, skips)
    else:
        rows = itertools.chain.from_iterable(zip(*block[:4], block.built()) for block in row_blocks())
        yield from group_by_time(rows, path, skips)


class _Rows(NamedTuple):
    """A block of parsed rows, column by column: its samples, or the block parser's GpuSample field
    columns (None for a field the log does not have) to build them from where needed."""

    lines: Sequence[int]
    times: list[float]
    indexes: list[int | None]
    uuids: list[str | None]
    samples: list[GpuSample] | None
    fields: list[list[Any] | None] | None = None

    def built(self, start: int = 0, stop: int | None = None) -> list[GpuSample]:
        """Samples of rows start..stop-1."""
        if self.samples is not None:
            return self.samples[start:stop]
        stop = len(self.times) if stop is None else stop
        fields: list[list[Any] | None] = self.fields  # type: ignore[assignment]  # samples or fields: one is there
        return samples_of([None if column is None else column[start:stop] for column in fields], stop - start,
                          _ROW_DEFAULTS)


_ROW_DEFAULTS = (0, *SAMPLE_DEFAULTS[1:])  # a log without an index column: each row gets its place later


def _joined(pending: list[GpuSample], fields: list[list[Any] | None], stop: int) -> tuple[list[Any] | None, ...]:
    """The columns of the `pending` samples followed by rows 0..stop-1 of a block's `fields`."""
    columns: list[list[Any] | None] = []
    for before, column, default in zip(zip(*pending), fields, _ROW_DEFAULTS):
        if column is not None:
            columns.append([*before, *column[:stop]])
        elif before.count(default) == len(before):
            columns.append(None)
        else:
            columns.append([*before, *itertools.repeat(default, stop)])
    return tuple(columns)


def _group_by_identity(blocks: Iterator[_Rows], path: str, skips: SkipLog) -> Iterator[NodeSnapshot | SnapshotBlock]:
    """Rows with an index or uuid: a GPU seen again starts the next sample. The same GPU twice at the same
    time is a malformed row (one row per GPU per sample, as in a JSON Lines recording).
    A block whose GPUs come in the order of the last whole sample (nvidia-smi's own order) is cut into
    samples by slicing, and handed on as one SnapshotBlock; any other block row by row."""
    ordinals: dict[str, int] = {}
    group: list[GpuSample] = []
    seen: list[int] = []
    start = last = 0.0
    order: list[int] = []  # the GPUs of the last whole sample, in their order
    for block in blocks:
        if None in block.indexes:
            named = [ordinals.setdefault(uuid or "", len(ordinals)) if index is None else index
                     for index, uuid in zip(block.indexes, block.uuids)]
            block = block._replace(indexes=list[int | None](named), samples=list(map(with_index, block.built(), named)),
                                   fields=None)
        lines, times, fields = block.lines, block.times, block.fields
        indexes: list[int] = block.indexes  # type: ignore[assignment]  # every one named just above
        count, width, pending = len(times), len(order), len(seen)
        if width and count >= width and seen == order[:pending] and indexes == list(
                itertools.islice(itertools.cycle(order), pending, pending + count)):
            cuts = range((width - pending) % width, count, width)  # rows that begin a sample
            if all(times[i] != (times[i - 1] if i else last) for i in cuts):
                tail = cuts[-1]
                stamps = [start, *times[cuts[0]:tail:width]]
                if fields is not None:
                    yield SnapshotBlock(stamps, tuple(order), _joined(group, fields, tail))
                else:
                    rows = [*group, *block.built(0, tail)]
                    yield from (NodeSnapshot(t, tuple(rows[n:n + width]))
                                for t, n in zip(stamps, range(0, len(rows), width)))
                group, seen, start, last = block.built(tail), indexes[tail:], times[tail], times[-1]
                continue
        for line, t, index, sample in zip(lines, times, indexes, block.built()):
            if index in seen:
                if t == last:
                    skips.malformed(f"{path}:{line}: GPU {index} twice at the same time")
                    continue
                yield NodeSnapshot(start, tuple(group))
                order = seen
                group, seen = [], []
            if not group:
                start = t
            group.append(sample)
            seen.append(index)
            last = t
    if group:
        yield NodeSnapshot(start, tuple(group))
