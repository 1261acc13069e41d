"""The `stall-watchdog` command's entry point: `--version` answered before the command's modules (the configuration,
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
    if args and args[0] in ("run", "coordinate"):
        # Their stop and reload signals are caught from here, before the imports and the configuration (half a
        # second, in which a SIGTERM, a Ctrl+C or a reload killed the process), and handed on once the command's
        # own handlers are in.
        from watchdog.plumbing.signals import hold

        hold()
    from watchdog.cli import main as command

    return command(args)
