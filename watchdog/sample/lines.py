"""Text lines of a trace file, read safely: each line at most MAX_LINE_BYTES (a 50 MB line or /dev/zero
is an error naming the line, not gigabytes of memory), decoded as UTF-8 (bytes that are not text are a
malformed line, skipped under --lenient), a leading byte-order mark dropped."""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO

from watchdog.sample.errors import SkipLog, TraceError

MAX_LINE_BYTES = 1 << 20


class TextLines:
    """Iterates decoded lines (with their newline, as a text file would); readline() for a header."""

    def __init__(self, stream: BinaryIO, path: str, skips: SkipLog):
        self._stream, self._path, self._skips = stream, path, skips
        self.number = 0

    def readline(self) -> str:
        return next(self, "")

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        raw = self._stream.readline(MAX_LINE_BYTES + 1)
        if not raw:
            raise StopIteration
        self.number += 1
        if len(raw) > MAX_LINE_BYTES:
            raise TraceError(f"{self._path}:{self.number}: line longer than {MAX_LINE_BYTES // 2**20} MiB: "
                             "not a trace")
        if self.number == 1:
            raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark (Windows editors write one)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            self._skips.malformed(f"{self._path}:{self.number}: not UTF-8 text (byte {exc.start})")
            return "\n"  # skipped under --lenient: a blank line keeps the numbering
