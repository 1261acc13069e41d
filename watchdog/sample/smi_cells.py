"""What one cell of an nvidia-smi CSV log means, stated once for both ways a log is read (row by row,
and a column at a time: watchdog/sample/smi_csv.py): the fields nvidia-smi names and the GpuSample field
each fills, units, the words for a missing reading and a lost GPU, timestamps, clock-event reasons, and
the converter of every column a header names. A converter raises ValueError with what is wrong with a
cell; the row reader puts the column's name in front of it. The most a real GPU reads, by the kind of
field (`most`), is stated here once: a JSON Lines recording's reader checks its readings against it too."""

from __future__ import annotations

import contextlib
import difflib
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from watchdog.vocabulary.model import HEALTH_COUNTERS

# nvidia-smi field name -> (GpuSample field, unit nvidia-smi uses when the log has no units)
NUMERIC: dict[str, tuple[str, str]] = {
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
PREFERENCE = ["enforced.power.limit", "power.limit", "power.draw", "power.draw.instant", "power.draw.average"]

REASON_BITS = {
    "gpu_idle": 0x1, "applications_clocks_setting": 0x2, "sw_power_cap": 0x4, "hw_slowdown": 0x8,
    "sync_boost": 0x10, "sw_thermal_slowdown": 0x20, "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80, "display_clock_setting": 0x100,
}
REASON_PREFIXES = ("clocks_event_reasons.", "clocks_throttle_reasons.")

# The units a cell may be written in, by the unit its field is measured in, each with its factor to the field's
# base unit: a cell in watts where a utilization belongs is a log whose columns are not what they are said to be
# (--csv-fields in the wrong order), never a number to read.
_SCALES: dict[str, dict[str, float]] = {
    "%": {"%": 0.01},
    "W": {"W": 1.0, "mW": 0.001},
    "MiB": {"MiB": 2.0**20, "GiB": 2.0**30, "KiB": 1024.0, "B": 1.0, "MB": 2.0**20, "GB": 2.0**30},
    "MHz": {"MHz": 1e6, "GHz": 1e9, "kHz": 1e3, "Hz": 1.0},
    "C": {"C": 1.0},
    "": {"": 1.0},
}
# The most a real GPU reads, by the unit its field is measured in, written in that unit. Past it a cell is
# malformed, never a value: a column that is not what its header says (540 W read as 540% utilization), a broken
# sensor, or a number the detectors cannot hold (their utilization sums are fixed-point int64, detect/levels.py:
# a utilization of 1e11 overflows them). Power: the largest boards draw 1.4 kW; clocks run below 3.5 GHz; memory:
# 288 GB a GPU now, 4 TiB leaves room; a GPU is shut down near 100 C; counts (ECC errors, PCIe replays) past
# 2^40 are not counts.
_MOST = {"%": 100.0, "W": 10_000.0, "MHz": 10_000.0, "MiB": 4.0 * 2**20, "C": 200.0, "": 2.0**40}
# The kind of each GpuSample field the most applies to: those nvidia-smi logs, and those only NVML gives.
KINDS = {**{target: unit for target, unit in NUMERIC.values()}, "sm_activity_ratio": "%",
         **{name: "" for name in HEALTH_COUNTERS}}


def most(unit: str) -> float:
    """The most a real GPU reads in a field measured in `unit`, in the field's base unit (100 % -> 1.0)."""
    return _MOST[unit] * _SCALES[unit][unit]


def _too_large(text: str, default_unit: str) -> ValueError:
    return ValueError(f"{text.strip()[:40]!r} is out of range: no GPU reads more than {_MOST[default_unit]:,.0f}"
                      + (f" {default_unit}" if default_unit else ""))


_ANY_UNIT = {unit for scales in _SCALES.values() for unit in scales}
MISSING = {"", "n/a", "[n/a]", "[not supported]", "not supported", "[unknown error]", "[insufficient permissions]"}
LOST = {"[gpu is lost]", "gpu is lost", "[gpu requires reset]"}
MAX_GPU_INDEX = 1023  # far above any node's GPUs, far below what would cost memory to number
_NUMBER = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?)\s*([A-Za-z%]*)\s*$")
_HEADER = re.compile(r"^\s*([A-Za-z_.]+)\s*(?:\[([^\]]*)\])?\s*$")
_TIME_FORMATS = ("%Y/%m/%d %H:%M:%S.%f", "%Y/%m/%d %H:%M:%S", "%Y-%m-%d %H:%M:%S.%f", "%Y-%m-%dT%H:%M:%S.%f",
                 "%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M:%S")
INTEGER_FIELDS = {"memory_used_bytes", "memory_total_bytes", *HEALTH_COUNTERS}


class Cells(dict[str, Any]):
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


_minute_seconds = Cells(_minute).__getitem__


@functools.lru_cache(maxsize=64)
def _day_seconds(date: str) -> float:
    return datetime.strptime(date, "%Y/%m/%d").replace(tzinfo=timezone.utc).timestamp()


def parse_number(text: str, unit: str, default_unit: str) -> float | None:
    """'71.25 W' -> 71.25; '55 %' -> 0.55; '[N/A]' -> None. Units convert to the field's base unit; a unit of
    another kind than the field's `default_unit` (watts in a utilization column) is an error."""
    number, _, written = text.strip().partition(" ")
    scales, largest = _SCALES[default_unit], most(default_unit)
    scale = scales.get(written or unit or default_unit)
    if scale is not None:
        try:
            value = float(number) * scale  # the common case: nvidia-smi's own "71.25 W"
        except ValueError:
            pass
        else:
            if 0 <= value <= largest:  # "nan", "inf", 400 digits and negatives go to the strict path
                return value
            if largest < value < float("inf"):
                raise _too_large(text, default_unit)
    lowered = text.strip().lower()
    if lowered in MISSING:
        return None
    match = _NUMBER.match(text)
    if match is None:
        raise ValueError(f"cannot read {text.strip()!r} as a number")
    digits, written = match.groups()
    if digits.startswith("-"):
        raise ValueError(f"negative value {text.strip()!r}")
    said = written or unit or default_unit
    scale = scales.get(said)
    if scale is None and said in _ANY_UNIT:
        raise ValueError(f"{text.strip()!r} is in {said or 'no unit'}, where this field is measured in "
                         f"{default_unit or 'no unit'}: are the columns what the header (or --csv-fields) says?")
    if scale is None:
        raise ValueError(f"unknown unit {written or unit!r} in {text.strip()!r}")
    value = float(digits) * scale
    if not value <= largest:
        raise _too_large(text, default_unit)
    return value


_COUNT = re.compile(r"\s*\d{1,15}\s*", re.ASCII)


def as_count(text: str, value: float) -> int:
    """A health counter's cell: a whole number, written without a unit."""
    if not _COUNT.fullmatch(text):
        raise ValueError(f"{text.strip()[:40]!r} is not a count (a whole number)")
    return int(value)


_IDENTITY = ("timestamp", "index", "uuid", "name")  # the fields that say when a row is and which GPU


@dataclass(frozen=True)
class Column:
    position: int
    name: str  # nvidia-smi field name, lower case
    unit: str
    header: str  # as written, for error messages


def parse_header(fields: list[str]) -> list[Column]:
    columns = []
    for position, raw in enumerate(fields):
        match = _HEADER.match(raw)
        name, unit = (match.group(1).lower(), match.group(2) or "") if match else (raw.strip().lower(), "")
        columns.append(Column(position, name, unit.strip(), raw.strip()))
    return columns


def misspelt_fields(columns: list[Column]) -> list[str]:
    """Field names given by hand (--csv-fields) that are not fields this reader uses but close to one: a typo
    would otherwise leave the column unread and the verdict without it. Names far from every field are fields
    nvidia-smi has and the reader does not use (pstate, fan.speed): those are left alone."""
    reasons = (prefix + reason for prefix in REASON_PREFIXES for reason in (*REASON_BITS, "active"))
    known = [*NUMERIC, *_IDENTITY, *reasons]
    said = []
    for col in columns:
        if col.name not in known:
            close = difflib.get_close_matches(col.name, known, n=1, cutoff=0.85)
            if close:
                said.append(f"unknown field {col.name!r} (did you mean {close[0]!r}?)")
    return said


def looks_like_header(fields: list[str]) -> bool:
    names = {c.name for c in parse_header(fields)}
    return bool(names & {*NUMERIC, *_IDENTITY})


def column_times(texts: list[str], stamps: Cells) -> list[float]:
    """A block's timestamp cells as parse_timestamp reads them. A log that stamps each row on its own
    (milliseconds apart) would miss the cell cache on every row: where every cell is nvidia-smi's own
    "2025/07/27 00:22:27.858" (or without the fraction), all of one length, the column is read as bytes at
    once, each minute (17 characters) through the minute cache where it changes and the seconds from their
    digits, the same numbers parse_timestamp gives; anything else cell by cell."""
    if len(set(texts)) * 2 > len(texts):
        if texts[0][:1].isspace():  # a column after the first: ", 2025/07/27 00:22:27.858"
            texts = list(map(str.lstrip, texts))
        with contextlib.suppress(ValueError):  # not nvidia-smi's own form (UnicodeError among these)
            read = _fixed_times(texts)
            if read is not None:
                return read
    return list(map(stamps.__getitem__, texts))


def _fixed_times(texts: list[str]) -> list[float] | None:
    import numpy as np  # only here: the readers of pasted logs and tables do without it

    width = len(texts[0])
    digits = width - 20  # of the fraction: "SS.fff" after the minute, or none ("SS", width 19)
    if not (width == 19 or 1 <= digits <= 9) or set(map(len, texts)) != {width}:
        return None
    rows = np.frombuffer("".join(texts).encode("ascii"), np.uint8).reshape(len(texts), width)
    second = rows[:, 17:] - np.uint8(ord("0"))  # each character's digit; wrapped round (above 9) where it is none
    if (second[:, :2] > 9).any() or (width > 19 and ((rows[:, 19] != ord(".")).any() or (second[:, 3:] > 9).any())):
        return None
    fraction = max(digits, 0)
    # Each digit's weight in the seconds times 10**fraction (the point's weight 0): exact integers, divided once,
    # give the float float() reads of the same digits.
    weights = [10 ** (fraction + 1), 10 ** fraction, *([0] if fraction else []),
               *(10 ** n for n in range(fraction - 1, -1, -1))]
    seconds = (second.astype(np.int64) @ np.array(weights, np.int64)) / float(10 ** fraction)
    if seconds.max() >= 61:
        return None
    # Where the minute changes: its 17 characters as two 8-byte words and one byte, each against the row before.
    words = np.ascontiguousarray(rows[:, :16]).view(np.uint64)
    changed = (words[1:, 0] != words[:-1, 0]) | (words[1:, 1] != words[:-1, 1]) | (rows[1:, 16] != rows[:-1, 16])
    begins = [0, *(np.flatnonzero(changed) + 1).tolist()]
    values = [_minute_seconds(texts[row][:17]) for row in begins]
    return (np.repeat(values, np.diff([*begins, len(texts)])) + seconds).tolist()


class GpuLost(ValueError):
    """A cell saying the GPU is lost or needs a reset: not a malformed cell, a state of the GPU (the row
    reader builds the lost sample; the column reader leaves such a block to it)."""


def number_cell(unit: str, default_unit: str, target: str) -> Callable[[str], Any]:
    """The converter of a numeric column filling GpuSample field `target`: a float in the field's base unit,
    a whole number for byte counts, a count (no unit, no fraction) for a health counter; None if missing."""
    integer, count = target in INTEGER_FIELDS, target in HEALTH_COUNTERS

    def convert(text: str) -> Any:
        if text.strip().lower() in LOST:
            raise GpuLost(text)
        value = parse_number(text, unit, default_unit)
        if value is None or not integer:
            return value
        return as_count(text, value) if count else int(value)
    return convert


def reason_cell(bit: int) -> Callable[[str], int | None]:
    """The converter of one clock-event reason's column: its bit when Active, 0 when Not Active."""
    def convert(text: str) -> int | None:
        state = text.strip().lower()
        if state in MISSING:
            return None
        if state not in ("active", "not active"):
            raise ValueError(f"expected 'Active' or 'Not Active', got {state!r}")
        return bit if state == "active" else 0
    return convert


MASK_BITS = 64  # NVML's clock-event reasons are an unsigned long long
_MASK = re.compile(rf"\s*(?:0[xX])?0*([0-9a-fA-F]{{1,{MASK_BITS // 4}}})\s*", re.ASCII)


def mask_cell(text: str) -> int | None:
    """The converter of clocks_event_reasons.active: the reasons' bits, written in hexadecimal. What int() would
    read besides (a sign, underscores, a number wider than MASK_BITS that no array holds) is not a mask."""
    match = _MASK.fullmatch(text)
    if match is None:
        if text.strip().lower() in MISSING:
            return None
        raise ValueError(f"cannot read {text.strip()[:40]!r} as a bit mask ({MASK_BITS} bits at most, in "
                         "hexadecimal)")
    return int(match.group(1), 16)


def index_cell(text: str) -> int:
    """nvidia-smi's GPU index: 0 to MAX_GPU_INDEX (a node enumerates its GPUs from 0; -1 or 10**30 is no GPU)."""
    try:
        index = int(text)
    except ValueError:
        raise ValueError(f"cannot read {text.strip()[:40]!r} as a GPU index") from None
    if not 0 <= index <= MAX_GPU_INDEX:
        raise ValueError(f"GPU index {text.strip()[:40]} is out of range (0 to {MAX_GPU_INDEX})")
    return index


@dataclass(frozen=True)
class Rule:
    """How to read one column: where it is, the GpuSample field it fills, its converter, its header."""

    position: int
    target: str
    convert: Callable[[str], Any]
    header: str


@dataclass(frozen=True)
class Layout:
    """The columns of a log as their rules: the numeric ones (one per GpuSample field), the reason columns
    (the hex mask first; their bits are OR'd into clock_event_reasons), and where the row's identity is."""

    width: int
    numeric: list[Rule]
    reasons: list[Rule]
    timestamp: int | None
    index: int | None
    uuid: int | None
    name: int | None

    @classmethod
    def of(cls, columns: list[Column]) -> Layout:
        numeric: list[Rule] = []  # where two columns fill the same field, the one PREFERENCE lists first
        for col in sorted(columns, key=lambda c: PREFERENCE.index(c.name) if c.name in PREFERENCE else 99):
            if col.name in NUMERIC and all(rule.target != NUMERIC[col.name][0] for rule in numeric):
                target, default_unit = NUMERIC[col.name]
                numeric.append(Rule(col.position, target, number_cell(col.unit, default_unit, target), col.header))
        reasons: list[Rule] = []
        for col in columns:
            for prefix in REASON_PREFIXES:
                if col.name.startswith(prefix):
                    reason = col.name[len(prefix):]
                    if reason == "active":
                        reasons.insert(0, Rule(col.position, "clock_event_reasons", mask_cell, col.header))
                    elif reason in REASON_BITS:
                        reasons.append(Rule(col.position, "clock_event_reasons", reason_cell(REASON_BITS[reason]),
                                            col.header))
        by_name = {c.name: c.position for c in columns}
        return cls(len(columns), numeric, reasons, *(by_name.get(k) for k in _IDENTITY))
