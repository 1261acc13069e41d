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


def _value(value: Any) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' "=\n\t'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


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
