"""What every verb shares: exit codes, the error line, and opening NVML with an explanation."""

from __future__ import annotations

import sys

from watchdog.boundary.untrusted_data import CONTROL_ESCAPES
from watchdog.config import Config
from watchdog.sample.nvml import NvmlSource, NvmlUnavailable

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


_CONTROL = {c: escape for c, escape in CONTROL_ESCAPES.items() if c not in (0x0a, 0x09)}
# A file name that is not UTF-8 reaches Python as surrogates, which would go out as the raw bytes (0x9b is an
# 8-bit terminal's CSI): each is written as the byte it stands for, \xNN (any other surrogate as \uNNNN).
_CONTROL.update({c: f"\\x{c - 0xdc00:02x}" if 0xdc80 <= c <= 0xdcff else f"\\u{c:04x}" for c in range(0xd800, 0xe000)})
_ONE_LINE = {**_CONTROL, 0x0a: "\\n", 0x09: "\\t"}


def shown(text: str, one_line: bool = False) -> str:
    """Text for a terminal: control characters (an escape sequence in a pasted log or a file's name would
    retitle the window or clear the screen) written as \\xNN; new lines and tabs kept, unless `one_line`
    (a field another machine fills, printed on a line of ours: a new line in it would forge the next one)."""
    return text.translate(_ONE_LINE if one_line else _CONTROL)


def error(message: str) -> None:
    print(f"stall-watchdog: {shown(message)}", file=sys.stderr)


def open_nvml(config: Config, hint: str | None) -> NvmlSource | None:
    """An opened NVML source; None when there is none here. With a `hint`, say why and what to do
    instead; without one the caller falls back quietly."""
    source = NvmlSource(call_timeout_seconds=config.sample.nvml_call_timeout_seconds)
    try:
        source.open()
    except NvmlUnavailable as exc:
        if hint is not None:
            error(f"{exc}\n{hint}")
        return None
    return source
