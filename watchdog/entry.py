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
    one_math_thread()
    from watchdog.cli import main as command

    return command(args)


def one_math_thread() -> None:
    """numpy loaded with one OpenBLAS thread: its library starts a thread per core when loaded (up to 64 on a
    large GPU node) for matrix products no command of ours makes. The setting is read then and taken out again,
    so that no program the daemon starts (an action's command, a receiver's) inherits it; one the environment
    gives is kept."""
    import os

    if "OPENBLAS_NUM_THREADS" in os.environ:
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import numpy  # noqa: F401  # its OpenBLAS reads the setting as it loads
    finally:
        del os.environ["OPENBLAS_NUM_THREADS"]
