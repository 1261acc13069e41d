"""Errors and warnings shared by the trace readers."""

from __future__ import annotations

from dataclasses import dataclass, field


class TraceError(Exception):
    """A trace line that cannot be read. The message names the file and line."""


@dataclass
class SkipLog:
    """Lines skipped under --lenient: counted, the first few kept for the warning."""

    count: int = 0
    first: list[str] = field(default_factory=list)

    def skip(self, message: str) -> None:
        self.count += 1
        if len(self.first) < 5:
            self.first.append(message)
