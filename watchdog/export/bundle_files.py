"""An incident bundle's files as its page reads them (export/report.py from_bundle): each untrusted, whoever wrote
the folder. A regular file only, never through a link, opened non-blocking (a named pipe is an error, not a wait);
JSON bounded in bytes and in the objects it builds, and holding at its top what the daemon writes there; the
telemetry read 96 KiB at a time and drawn from an even stride of at most KEPT_SNAPSHOTS of its snapshots."""

from __future__ import annotations

import math
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from watchdog.boundary import rank_files, untrusted_data
from watchdog.export.report_readings import Drawn
from watchdog.sample import recording
from watchdog.sample.errors import SkipLog
from watchdog.sample.lines import TextLines

KEPT_SNAPSHOTS = 9_600  # of a bundle's telemetry, evenly, to draw (8 times the points a panel draws): bounded memory
MAX_JSON_BYTES = 16 << 20  # a bundle's summary.json, stacks.json or doctor.json (the daemon's are KiBs)
_LATEST = datetime(9999, 12, 30, tzinfo=timezone.utc).timestamp()  # the last day a page can write, in any zone


class BundleDamaged(ValueError):
    """A bundle's file that cannot be read, or holds what the daemon never writes there; the message names it."""


def load_json(path: Path, kind: type = object) -> object:
    """A bundle's JSON file (None where it is absent): a regular file, not through a link, bounded in bytes and in
    the objects it builds, holding a `kind` (dict or list) at its top."""
    try:
        data = rank_files.read_given(path, MAX_JSON_BYTES, timeout_seconds=30.0, follow=False)
    except rank_files.RankFileError as exc:
        if exc.missing:
            return None
        raise BundleDamaged(str(exc)) from None
    try:
        value = untrusted_data.loads_json(data, str(path))
    except RecursionError:
        raise BundleDamaged(f"{path}: nested too deeply to read") from None
    except UnicodeDecodeError as exc:
        raise BundleDamaged(f"{path}: not JSON (byte {exc.start} is not UTF-8 text)") from None
    except ValueError as exc:  # not JSON, not UTF-8, or more than a reader may build (TooMuchData)
        raise BundleDamaged(exc if isinstance(exc, untrusted_data.TooMuchData)
                            else f"{path}: not JSON ({untrusted_data.one_line(str(exc))[:80]})") from None
    if not isinstance(value, kind):
        raise BundleDamaged(f"{path}: holds {_json_kind(value)} where the daemon writes {_json_kind(kind())}")
    return value


def _json_kind(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "true or false", type(None): "null"}.get(
        type(value), "a number")


def telemetry(path: Path) -> Drawn:
    """What the timeline draws of a bundle's telemetry.jsonl (nothing where it is absent: a dump's bundle), read
    96 KiB at a time (sample/lines.py: a 64-GPU line is 14 KiB), the file opened as load_json opens its own."""
    drawn = Drawn(most=KEPT_SNAPSHOTS)
    try:
        fd = rank_files.open_given(path, follow=False)
    except rank_files.RankFileError as exc:
        if exc.missing:
            return drawn
        raise BundleDamaged(str(exc)) from None
    skips = SkipLog(hint="")  # report has no --lenient to offer
    with open(fd, "rb") as f:
        lines = TextLines(_UpTo(f, os.fstat(fd).st_size), str(path), skips)
        for stretch in recording.stretches(lines, str(path), skips, most=8):
            drawn.add(stretch)
    return drawn


class _UpTo:
    """A file read no further than its size when it was opened: one a writer still appends to ends."""

    def __init__(self, stream: IO[bytes], size: int):
        self._stream, self._left = stream, size

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(self._left if size < 0 else min(size, self._left)) if self._left > 0 else b""
        self._left -= len(data)
        return data


def seconds_at(value: object, where: str) -> float:
    """A time a bundle's file gives (an ISO-8601 text, or epoch seconds as an action's `at`) as epoch seconds,
    between 1970 and the year 9999 a page can write; BundleDamaged naming `where` otherwise."""
    if isinstance(value, str):
        try:
            stamp = datetime.fromisoformat(value)
        except ValueError:
            raise BundleDamaged(f"{where}: not a time ({untrusted_data.one_line(value)[:40]!r})") from None
        seconds = (stamp if stamp.tzinfo else stamp.replace(tzinfo=timezone.utc)).timestamp()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:
            seconds = math.inf
    else:
        raise BundleDamaged(f"{where}: holds {_json_kind(value)} where the daemon writes a time")
    if not 0 <= seconds <= _LATEST:  # NaN too
        raise BundleDamaged(f"{where}: not a time between 1970 and 9999 ({seconds:.6g})")
    return seconds


def listed(value: object, where: str) -> list[Any]:
    """A list a bundle's file holds (none: empty); BundleDamaged naming `where` for another kind."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise BundleDamaged(f"{where}: holds {_json_kind(value)} where the daemon writes a list")
    return value


def mapping(value: object, where: str) -> dict[str, Any]:
    """An object a bundle's file holds (none: empty); BundleDamaged naming `where` for another kind."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BundleDamaged(f"{where}: holds {_json_kind(value)} where the daemon writes an object")
    return value


def text(value: object) -> str:
    """A value of a bundle's file as a page's cell shows it: lists joined, never Python's own notation."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ", ".join(text(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}: {text(v)}" for k, v in value.items())
    return str(value)


def stacks(path: Path) -> dict[str, Any]:
    """The first job's stacks of a bundle's stacks.json: its groups (members, where, activity, frames), outliers
    and host activity, each of the kind the daemon writes; BundleDamaged naming the file and the field."""
    where = str(path)
    jobs = listed(load_json(path, list), where)
    first = mapping(jobs[0], f"{where}: [0]") if jobs else {}
    groups = []
    for n, raw in enumerate(listed(first.get("groups"), f"{where}: groups")):
        group = mapping(raw, f"{where}: groups[{n}]")
        frames = [mapping(f, f"{where}: groups[{n}].frames[{i}]")
                  for i, f in enumerate(listed(group.get("frames"), f"{where}: groups[{n}].frames"))]
        groups.append({"members": [text(m) for m in listed(group.get("members"), f"{where}: groups[{n}].members")],
                       "where": text(group.get("where")), "activity": text(group.get("activity")),
                       "frames": [{k: text(f.get(k)) for k in ("function", "file", "line")} for f in frames]})
    host = {text(m): mapping(h, f"{where}: host_activity.{m}")
            for m, h in mapping(first.get("host_activity"), f"{where}: host_activity").items()}
    return {"groups": groups, "outliers": [text(m) for m in listed(first.get("outliers"), f"{where}: outliers")],
            "host": host}


def findings(path: Path) -> list[dict[str, str]]:
    """A bundle's doctor.json: each finding's severity, check, evidence and fix as text."""
    out = []
    for n, raw in enumerate(listed(load_json(path, list), str(path))):
        found = mapping(raw, f"{path}: [{n}]")
        out.append({k: text(found.get(k)) for k in ("severity", "check", "evidence", "fix")})
    return out
