"""Errors and warnings shared by the trace readers."""

from __future__ import annotations

from dataclasses import dataclass, field


class TraceError(Exception):
    """A trace line that cannot be read. The message names the file and line."""


@dataclass
class SkipLog:
    """What a reader left out: counted, the first few kept for the warning. `lenient` decides whether a
    malformed line stops the replay (the default) or is skipped too; `hint` follows the error's message (a reader
    without --lenient, `report`, says none)."""

    lenient: bool = False
    hint: str = " (--lenient skips such lines, counts them and goes on)"
    count: int = 0
    first: list[str] = field(default_factory=list)

    def skip(self, message: str) -> None:
        self.count += 1
        if len(self.first) < 5:
            self.first.append(message)

    def malformed(self, message: str) -> None:
        """A line that cannot be read: an error naming it, or under --lenient a counted skip."""
        if not self.lenient:
            raise TraceError(message + self.hint)
        self.skip(message)
