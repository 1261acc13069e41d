"""An incident bundle's files as its page reads them (export/report.py from_bundle): each untrusted, whoever wrote
the folder. A regular file only, never through a link, opened non-blocking (a named pipe is an error, not a wait);
JSON bounded in bytes and in the objects it builds, and holding at its top what the daemon writes there; the
telemetry read 96 KiB at a time and drawn from an even stride of at most KEPT_SNAPSHOTS of its snapshots."""

from __future__ import annotations

from pathlib import Path

from watchdog.boundary import rank_files, untrusted_data
from watchdog.export.report_readings import Drawn
from watchdog.sample import recording
from watchdog.sample.errors import SkipLog
from watchdog.sample.lines import TextLines

KEPT_SNAPSHOTS = 9_600  # of a bundle's telemetry, evenly, to draw (8 times the points a panel draws): bounded memory
MAX_JSON_BYTES = 16 << 20  # a bundle's summary.json, stacks.json or doctor.json (the daemon's are KiBs)


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
    with open(fd, "rb") as f:
        for stretch in recording.stretches(TextLines(f, str(path), SkipLog(hint="")), str(path), most=8):
            drawn.add(stretch)
    return drawn
