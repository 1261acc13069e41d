"""The `stall-watchdog` command's entry point: `--version` answered before the command's modules (pydantic,
numpy) are imported, everything else handed to watchdog.cli."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--version"]:
        from watchdog import VERSION_LINE

        print(VERSION_LINE)
        return 0
    from watchdog.cli import main as command

    return command(args)
