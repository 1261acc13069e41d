"""One structured line per event on stderr, journald-friendly: `level=info event=episode_fired
signature=busy_spin gpus=0-7 summary="..."`. Secrets never reach a log line: receivers log their
name, never their URL or token."""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger("stall_watchdog")

# Levels by name, so a call site reads `level=logfmt.WARNING`.
DEBUG, INFO, WARNING, ERROR = logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR


def _escape(c: str) -> str:
    if c == "\n":
        return "\\n"
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def _value(value: Any) -> str:
    """One field's value: quoted when it holds a space, quote or `=`; control characters (CR, ESC, the
    C1 range, line and paragraph separators) written as escapes, so text a rank chose (a function name,
    a file name) can neither forge a log line nor move a terminal's cursor."""
    text = str(value)
    if text != "" and text.isprintable() and not any(c in text for c in ' "=\\'):
        return text
    text = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(c if c.isprintable() or c == " " else _escape(c) for c in text) + '"'


def line(level: str, event: str, **fields: Any) -> str:
    parts = [f"level={level}", f"event={event}"]
    parts += [f"{key}={_value(value)}" for key, value in fields.items() if value is not None]
    return " ".join(parts)


def event(name: str, level: int = INFO, **fields: Any) -> None:
    log.log(level, line(logging.getLevelName(level).lower(), name, **fields))


def setup(level: int = INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(level)
    log.propagate = False
