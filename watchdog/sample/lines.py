"""Text lines of a trace file, read safely: each line at most MAX_LINE_BYTES (a 50 MB line or /dev/zero
is an error naming the line, or under --lenient a skipped line, never gigabytes of memory), decoded as UTF-8
(bytes that are not text are a malformed line, skipped under --lenient), a leading byte-order mark dropped.

Readers take lines in blocks (`blocks()`): a day of nvidia-smi log is read 96 KiB at a time and split
with one call, rather than a million readline() calls. Any other iterable of text lines (a test's
StringIO, an open text file) is grouped into blocks by `line_blocks`.

What the lines add up to is bounded too: a trace names at most MAX_GPUS distinct GPUs (`TraceGpus`), so
that a file naming new GPUs on every line cannot grow the detectors' columns without end.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Iterator
from typing import Protocol

from watchdog.sample.errors import SkipLog, TraceError

MAX_LINE_BYTES = 1 << 20
MAX_SKIPPED_BYTES = 64 << 20  # of one line over MAX_LINE_BYTES, read past under --lenient
# The distinct GPUs one trace may name. The largest nodes hold 8 to 16 GPUs (a DGX-2 16, a few PCIe chassis
# 20): 64 leaves room for any of them. The detectors keep a column for every GPU a trace ever named
# (detect/frames.py): without a bound, lines that each name 1,024 new GPUs grow them to gigabytes.
MAX_GPUS = 64
# Read at a time: the rows of one read stay in the processor's cache while they are parsed, grouped into
# a block, and detected on. 96 KiB of an 8-GPU node's nvidia-smi log is about 120 samples, close to the
# 128 ticks the detectors check for steadiness at once; in alternating runs of a day's replay
# (bench/replay_throughput.py), 64 KiB and 128 KiB were 5-10% slower, and 256 KiB a quarter slower.
_READ_BYTES = 96 << 10
_BLOCK_LINES = 4096

Block = tuple[int, list[str]]  # (number of the first line, the lines without their newline)


class Readable(Protocol):
    """What TextLines reads from: a binary file, or anything with its read."""

    def read(self, size: int = -1, /) -> bytes: ...


class TextLines:
    """The lines of a binary stream, in blocks: decoded (`blocks()`) or as bytes (`byte_blocks()`, for a
    parser that takes bytes and checks UTF-8 itself)."""

    def __init__(self, stream: Readable, path: str, skips: SkipLog):
        self._stream, self._path, self._skips = stream, path, skips
        self.number = 0  # lines handed out so far

    def blocks(self) -> Iterator[Block]:
        for first, data, raw in self._raw_blocks():
            yield first, self._decode(first, data, raw)

    def byte_blocks(self) -> Iterator[tuple[int, list[bytes]]]:
        for first, _, raw in self._raw_blocks():
            yield first, raw

    def _raw_blocks(self) -> Iterator[tuple[int, bytes, list[bytes]]]:
        rest = b""
        while True:
            chunk = self._stream.read(_READ_BYTES)
            if self.number == 0 and not rest:
                chunk = chunk.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark
            if not chunk:
                if rest:  # a last line without its newline
                    yield from self._cut(rest + b"\n")
                return
            rest += chunk
            cut = rest.rfind(b"\n") + 1
            if cut:
                yield from self._cut(rest[:cut])
                rest = rest[cut:]
            if len(rest) > MAX_LINE_BYTES:  # a line still without its end
                self._too_long(self.number + 1)
                rest = self._past_line()
                yield from self._cut(b"\n")  # skipped: a blank line keeps the numbering

    def _past_line(self) -> bytes:
        """What follows the end of the line being read, the rest of that line read and dropped; an error
        past MAX_SKIPPED_BYTES of it (/dev/zero, or a binary file, under --lenient)."""
        dropped = 0
        while chunk := self._stream.read(_READ_BYTES):
            end = chunk.find(b"\n")
            if end >= 0:
                return chunk[end + 1:]
            dropped += len(chunk)
            if dropped > MAX_SKIPPED_BYTES:
                raise TraceError(f"{self._path}:{self.number + 1}: no end of line in "
                                 f"{MAX_SKIPPED_BYTES // 2**20} MiB: not a trace")
        return b""

    def _cut(self, data: bytes) -> Iterator[tuple[int, bytes, list[bytes]]]:
        raw = data.split(b"\n")
        raw.pop()  # after the final newline
        first = self.number + 1
        self.number += len(raw)
        if len(data) > MAX_LINE_BYTES:
            long = [offset for offset, line in enumerate(raw) if len(line) > MAX_LINE_BYTES]
            for offset in long:
                self._too_long(first + offset)
                raw[offset] = b""  # skipped: a blank line keeps the numbering
            if long:
                data = b"\n".join(raw) + b"\n"
        yield first, data, raw

    def _too_long(self, number: int) -> None:
        """A line over MAX_LINE_BYTES: an error, or under --lenient a counted skip (the caller drops it)."""
        self._skips.malformed(f"{self._path}:{number}: line longer than {MAX_LINE_BYTES // 2**20} MiB: not a trace")

    def _decode(self, first: int, data: bytes, raw: list[bytes]) -> list[str]:
        try:
            return data.decode("utf-8").split("\n")[:-1]
        except UnicodeDecodeError:
            pass
        lines = []
        for offset, line in enumerate(raw):
            try:
                lines.append(line.decode("utf-8"))
            except UnicodeDecodeError as exc:
                self._skips.malformed(f"{self._path}:{first + offset}: not UTF-8 text (byte {exc.start})")
                lines.append("")  # skipped under --lenient: a blank line keeps the numbering
        return lines


class TraceGpus:
    """The GPUs a trace has named so far, at most MAX_GPUS: a line that would name more is malformed."""

    def __init__(self) -> None:
        self._named: set[int] = set()

    def admit(self, gpus: Collection[int]) -> None:
        """Note the GPUs a line names; ValueError, noting none, if they would make the trace's more than MAX_GPUS."""
        if self._named.issuperset(gpus):
            return
        new = [gpu for gpu in dict.fromkeys(gpus) if gpu not in self._named]
        room = MAX_GPUS - len(self._named)
        if len(new) > room:
            raise ValueError(f"more than {MAX_GPUS} GPUs in one trace (GPU {new[room]} is one too many): "
                             "no node has that many")
        self._named.update(new)


def line_blocks(source: Iterable[str] | TextLines, first: int = 1) -> Iterator[Block]:
    """Blocks of lines from a TextLines (fast) or any iterable of text lines."""
    if isinstance(source, TextLines):
        yield from source.blocks()
        return
    lines = iter(source)
    while block := list(itertools.islice(lines, _BLOCK_LINES)):
        yield first, [line.rstrip("\r\n") for line in block]
        first += len(block)
