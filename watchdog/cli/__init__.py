"""The `stall-watchdog` command: the parser (cli/parser.py) and one module per verb family.

Exit codes: 0 success; 1 runtime failure (unreadable trace, no NVML, write error); 2 usage or
configuration error; `doctor` adds 3 (a warning, with --strict) and 4 (an error).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from watchdog.cli.common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, error
from watchdog.cli.parser import build_parser
from watchdog.config import ConfigError
from watchdog.sample.errors import TraceError
from watchdog.stacks.formats import StackFormatError

__all__ = ["build_parser", "main"]


def _positive(value: float | None, name: str, parser: argparse.ArgumentParser) -> None:
    if value is not None and not (0 < value <= 7 * 86400):  # NaN fails this too
        parser.error(f"{name} must be a number of seconds > 0 (at most a week), got {value:g}")


def _verb_parser(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser of the verb (and sub-verb) `argv` names: its usage is the one to show for its flags."""
    current = parser
    for token in argv:
        verbs = next((a for a in current._actions if isinstance(a, argparse._SubParsersAction)), None)
        if verbs is None:
            break
        if token in verbs.choices:
            current = verbs.choices[token]
    return current


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    args, unknown = parser.parse_known_args(given)
    if unknown:
        _verb_parser(parser, given).error(f"unrecognized arguments: {' '.join(unknown)}")
    for name in ("interval_seconds", "duration_seconds"):
        _positive(getattr(args, name, None), "--" + name.replace("_", "-"), parser)
    interval = getattr(args, "interval_seconds", None)
    if interval is not None and interval < 0.05:
        parser.error(f"--interval-seconds must be at least 0.05 (nvidia-smi's own floor is 0.1), got {interval:g}")
    try:
        return int(args.func(args))
    except ConfigError as exc:
        error(f"invalid configuration:\n{exc}")
        return EXIT_USAGE
    except (TraceError, StackFormatError) as exc:
        error(str(exc))
        return EXIT_FAILURE
    except BrokenPipeError:
        return EXIT_OK  # `| head` closed the pipe
    except KeyboardInterrupt:
        return 130
