"""The command-line reference of the docs, made from the parser itself (make docs; a test keeps the docs in
step), so `--help` and the docs cannot drift apart."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Iterator

from watchdog.cli.parser import build_parser

WIDTH = 110  # the columns the help is laid out in, whatever the terminal that runs make docs


def _verbs(parser: argparse.ArgumentParser, path: str = "") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every verb's parser, depth first, in the order --help lists them ("stacks dump" after "stacks"), each laid
    out in WIDTH columns."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{path}{name}", _laid_out(sub)
                yield from _verbs(sub, f"{path}{name} ")


def _laid_out(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.formatter_class = functools.partial(parser.formatter_class, width=WIDTH)  # type: ignore[call-arg]
    return parser


def _runs(parser: argparse.ArgumentParser) -> bool:
    """A verb that runs (not a family, such as `stacks`, whose verbs follow it)."""
    return not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)


def synopsis_markdown() -> str:
    """One usage line per verb that runs, as its --help prints it (without -h)."""
    lines = [line.replace(" [-h]", "", 1).removeprefix("usage: ").removeprefix("       ").rstrip()
             for _, sub in _verbs(build_parser()) if _runs(sub) for line in sub.format_usage().splitlines()]
    return "```text\n" + "\n".join(line for line in lines if line) + "\n```\n"


def reference_markdown() -> str:
    """Every verb's whole --help, under a heading of its own."""
    parser = _laid_out(build_parser())
    parts = ["## stall-watchdog\n\n```text\n" + parser.format_help().rstrip() + "\n```\n"]
    parts += [f"## stall-watchdog {name}\n\n```text\n" + sub.format_help().rstrip() + "\n```\n"
              for name, sub in _verbs(parser)]
    return "\n".join(parts)
