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
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TextIO

from watchdog.model import GpuHealth, GpuSample, NodeSnapshot
from watchdog.sample.errors import SkipLog, TraceError
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
_INTEGER_FIELDS = {"memory_used_bytes", "memory_total_bytes"}


def parse_timestamp(text: str) -> float:
    """nvidia-smi's local, offset-less timestamp, read as if UTC (only differences are used)."""
    text = text.strip()
    # Fast path for nvidia-smi's own "2025/07/27 00:22:27.858": strptime is the slowest part of a row.
    if len(text) >= 19 and text[4] == "/" and text[7] == "/" and text[13] == ":" and text[16] == ":":
        try:
            day = _day_seconds(text[:10])
            fraction = float(text[19:]) if len(text) > 19 else 0.0
            return day + int(text[11:13]) * 3600 + int(text[14:16]) * 60 + int(text[17:19]) + fraction
        except ValueError:
            pass
    for fmt in _TIME_FORMATS:
        try:
            return datetime.strptime(text, fmt).replace(tzinfo=timezone.utc).timestamp()
        except ValueError:
            continue
    raise ValueError(f"cannot read {text!r} as a timestamp")


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
            if math.isfinite(value) and value >= 0:  # "nan", "inf" and negatives go to the strict path
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
    return float(digits) * scale


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


def _row_parser(columns: list[_Column]) -> RowParser:
    """Build a function turning one CSV row into (time, index, uuid, sample)."""
    numeric: list[tuple[int, str, str, str, str]] = []
    claimed: dict[str, str] = {}
    for col in sorted(columns, key=lambda c: _PREFERENCE.index(c.name) if c.name in _PREFERENCE else 99):
        if col.name in _NUMERIC:
            target, default_unit = _NUMERIC[col.name]
            if target in claimed:
                continue
            claimed[target] = col.name
            numeric.append((col.position, target, col.unit, default_unit, col.header))
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
                values[target] = int(number) if target in _INTEGER_FIELDS else number
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


def read_smi_csv(
    stream: TextIO, path: str, fields: list[str] | None = None, skips: SkipLog | None = None,
) -> Iterator[NodeSnapshot]:
    """Snapshots from an nvidia-smi CSV log. `fields` gives the columns of a log written with noheader.
    A malformed row raises TraceError naming path:line, unless `skips` is lenient: then it is skipped and
    counted. Samples nvidia-smi itself cut short are always dropped and counted in `skips`."""
    skips = skips if skips is not None else SkipLog()
    reader = csv.reader(stream, skipinitialspace=False)
    try:
        first = next(reader, None)
    except csv.Error as exc:
        raise TraceError(f"{path}:1: not a CSV header ({exc})") from None
    if first is None:
        return
    if _looks_like_header(first):
        columns = _parse_header(first)
        pending: list[tuple[int, list[str]]] = []
    elif fields:
        columns = _parse_header(fields)
        pending = [(1, first)]
    else:
        raise TraceError(f"{path}:1: no header line; pass --csv-fields with the --query-gpu list the log was "
                         "written with")
    names = {c.name for c in columns}
    if "timestamp" not in names:
        raise TraceError(f"{path}:1: the log has no timestamp column; add timestamp to --query-gpu")
    parse = _row_parser(columns)
    has_identity = "index" in names or "uuid" in names

    def rows() -> Iterator[tuple[int, float, int | None, str | None, GpuSample]]:
        for line, row in pending:
            yield from _parsed(line, row)
        while True:
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:
                skips.malformed(f"{path}:{reader.line_num}: not a CSV row ({exc})")
                continue
            yield from _parsed(reader.line_num, row)

    def _parsed(line: int, row: list[str]) -> Iterator[tuple[int, float, int | None, str | None, GpuSample]]:
        if not row or (len(row) == 1 and not row[0].strip()):
            return
        try:
            t, index, uuid, sample = parse(row)
        except ValueError as exc:
            skips.malformed(f"{path}:{line}: {exc}")
            return
        assert t is not None
        yield line, t, index, uuid, sample

    if has_identity:
        yield from _group_by_identity(rows(), path, skips)
    else:
        yield from group_by_time(rows(), path, skips)


def _group_by_identity(
    rows: Iterator[tuple[int, float, int | None, str | None, GpuSample]], path: str, skips: SkipLog,
) -> Iterator[NodeSnapshot]:
    """Rows with an index or uuid: a GPU seen again starts the next sample. The same GPU twice at the same
    time is a malformed row (one row per GPU per sample, as in a JSON Lines recording)."""
    ordinals: dict[str, int] = {}
    group: list[GpuSample] = []
    seen: set[int] = set()
    start = last = 0.0
    for line, t, index, uuid, sample in rows:
        if index is None:
            index = ordinals.setdefault(uuid or "", len(ordinals))
            sample = with_index(sample, index)
        if index in seen:
            if t == last:
                skips.malformed(f"{path}:{line}: GPU {index} twice at the same time")
                continue
            yield NodeSnapshot(start, tuple(group))
            group, seen = [], set()
        if not group:
            start = t
        group.append(sample)
        seen.add(index)
        last = t
    if group:
        yield NodeSnapshot(start, tuple(group))


