"""nvidia-smi CSV logs, as people already record them:

    nvidia-smi --query-gpu=timestamp,index,utilization.gpu,power.draw,... --format=csv[,noheader][,nounits] -l 1

Any subset and order of the usual fields; values with or without units; `[N/A]` and `[Not Supported]`
read as missing. Without an `index` (or `uuid`) column, nvidia-smi still prints the GPUs of one sample
in enumeration order a few milliseconds apart: the GPU count is inferred from the timestamp gaps and
each row gets its position in its sample. What each cell means is stated once, in smi_cells.py.
"""

from __future__ import annotations

import csv
import itertools
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from watchdog.sample.errors import SkipLog, TraceError
from watchdog.sample.lines import TextLines, line_blocks
from watchdog.sample.smi_cells import (
    Cells,
    Column,
    GpuLost,
    Layout,
    column_times,
    index_cell,
    looks_like_header,
    misspelt_fields,
    parse_header,
    parse_timestamp,
)
from watchdog.sample.smi_gpu_count import group_by_time
from watchdog.sample.smi_samples import RowBlock, RowStore, assemble, by_identity, gpu_ordinal
from watchdog.vocabulary.model import (
    SMI_SAYS,
    GpuHealth,
    GpuSample,
    NodeSnapshot,
    SnapshotBlock,
    each_snapshot,
)

RowParser = Callable[[list[str]], tuple[float | None, int | None, str | None, GpuSample]]


def _row_parser(layout: Layout) -> RowParser:
    """Build a function turning one CSV row into (time, index, uuid, sample), naming the column of what
    is wrong with it."""

    def parse(row: list[str]) -> tuple[float | None, int | None, str | None, GpuSample]:
        if len(row) != layout.width:
            raise ValueError(f"expected {layout.width} columns, got {len(row)}")
        values: dict[str, object] = {}
        health = GpuHealth.OK
        for rule in layout.numeric:
            try:
                number = rule.convert(row[rule.position])
            except GpuLost:
                health = GpuHealth.LOST
                continue
            except ValueError as exc:
                raise ValueError(f"column {rule.header!r}: {exc}") from None
            if number is not None:
                values[rule.target] = number
        bits: int | None = None
        for rule in layout.reasons:
            try:
                bit = rule.convert(row[rule.position])
            except ValueError as exc:
                raise ValueError(f"column {rule.header!r}: {exc}") from None
            if bit is not None:
                bits = bit if bits is None else bits | bit
        if bits is not None:
            values["clock_event_reasons"] = bits
        t = index = None
        if layout.timestamp is not None:
            try:
                t = parse_timestamp(row[layout.timestamp])
            except ValueError as exc:
                raise ValueError(f"column 'timestamp': {exc}") from None
        if layout.index is not None:
            try:
                index = index_cell(row[layout.index])
            except ValueError as exc:
                raise ValueError(f"column 'index': {exc}") from None
        uuid = row[layout.uuid].strip() if layout.uuid is not None else None
        name = row[layout.name].strip() if layout.name is not None else None
        sample = GpuSample(index=index or 0, uuid=uuid, name=name, health=health, **values)  # type: ignore[arg-type]
        return t, index, uuid, sample

    return parse


_Row = tuple[int, float, int | None, str | None, GpuSample]


def _block_parser(layout: Layout) -> Callable[[list[str]], tuple[list[float], list[Any]] | None]:
    """Build a function turning a block of lines into (times, GpuSample field columns: None for a field
    the log does not have), a column at a time, through the same cell rules as the row parser: the block
    is split once, each column is a slice of it, and each distinct cell text is converted once. It gives
    up (None) on anything but plain, complete rows of readable cells; the block is then read row by row,
    which names the line and the column of what is wrong (or builds the sample of a lost GPU)."""
    width = layout.width
    slots = {name: position for position, name in enumerate(GpuSample._fields)}
    converters = [(rule.position, slots[rule.target], Cells(rule.convert)) for rule in layout.numeric]
    for position, name, convert in ((layout.index, "index", index_cell), (layout.uuid, "uuid", str.strip),
                                    (layout.name, "name", str.strip)):
        if position is not None:
            converters.append((position, slots[name], Cells(convert)))
    reason_cells = [(rule.position, Cells(rule.convert)) for rule in layout.reasons]
    stamps = Cells(parse_timestamp)
    t_pos = layout.timestamp
    assert t_pos is not None  # the reader asks for a timestamp column before it builds a parser
    separators = operator.methodcaller("count", ",")

    def parse(lines: list[str]) -> tuple[list[float], list[Any]] | None:
        text = ",".join(lines)
        if '"' in text or "\r" in text:
            return None  # quoting or carriage returns: the csv module, row by row
        per_line = list(map(separators, lines))
        if min(per_line) != width - 1 or max(per_line) != width - 1:
            return None  # blank or ragged lines
        cells = text.split(",")
        fields: list[Any] = [None] * len(GpuSample._fields)
        try:
            times = column_times(cells[t_pos::width], stamps)
            for position, slot, converted in converters:
                fields[slot] = _converted(cells[position::width], converted)
            if reason_cells:
                fields[slots["clock_event_reasons"]] = _combine_reasons(
                    [list(map(converted.__getitem__, cells[position::width])) for position, converted in reason_cells])
        except ValueError:
            return None
        return times, fields

    return parse


def _converted(texts: list[str], converted: Cells) -> list[Any]:
    """A column's cells through its converter; a column that reads the same in every row of the block (a GPU's name,
    its power limit, a field it never reports) converted once."""
    first = texts[0]
    if texts[-1] == first and texts[len(texts) // 2] == first and texts.count(first) == len(texts):
        return [converted[first]] * len(texts)
    return list(map(converted.__getitem__, texts))


def _combine_reasons(columns: list[list[int | None]]) -> list[int | None]:
    """OR the per-reason bits (and the hex mask) of each row; None where no column says anything."""
    bits = columns[0]
    for column in columns[1:]:
        bits = [a if b is None else b if a is None else a | b for a, b in zip(bits, column)]
    return bits


def read_smi_csv(
    stream: Iterable[str] | TextLines, path: str, fields: list[str] | None = None, skips: SkipLog | None = None,
) -> Iterator[NodeSnapshot]:
    """Snapshots from an nvidia-smi CSV log. `fields` gives the columns of a log written with noheader.
    A malformed row raises TraceError naming path:line, unless `skips` is lenient: then it is skipped and
    counted. Samples nvidia-smi itself cut short are always dropped and counted in `skips`."""
    return each_snapshot(smi_csv_stretches(stream, path, fields, skips))


def smi_csv_stretches(
    stream: Iterable[str] | TextLines, path: str, fields: list[str] | None = None, skips: SkipLog | None = None,
) -> Iterator[NodeSnapshot | SnapshotBlock]:
    """read_smi_csv's snapshots, runs of them handed on as column blocks (smi_samples.py: a sample lacking a GPU
    of its run marks that row absent): a replay's detectors take them as they are."""
    skips = skips if skips is not None else SkipLog()
    blocks = line_blocks(stream)
    head = next(blocks, None)
    if head is None or not head[1]:
        return
    first_line, head_lines = head
    try:
        first = next(csv.reader(head_lines[:1]), [])
    except csv.Error as exc:
        raise TraceError(f"{path}:1: not a CSV header ({exc})") from None
    if looks_like_header(first):
        columns = parse_header(first)
        head_lines = head_lines[1:]
        first_line += 1
    elif fields:
        columns = parse_header(fields)
        misspelt = misspelt_fields(columns)
        if misspelt:
            raise TraceError(f"{path}: --csv-fields: " + "; ".join(misspelt))
    else:
        raise TraceError(f"{path}:1: no header line; pass --csv-fields with the --query-gpu list the log was "
                         "written with")
    layout = _layout(columns, path, 1)
    identified = _identified(layout)
    parse_row, parse_block = _row_parser(layout), _block_parser(layout)

    def by_row(first: int, lines: list[str]) -> Iterator[_Row | str | _Header]:
        """The rows of a block one at a time, and in their place what is wrong with a malformed one; a header
        ends them (the lines after it are read by its layout)."""
        for line, text in enumerate(lines, start=first):
            try:
                row = next(csv.reader([text]), [])
            except csv.Error as exc:
                yield f"{path}:{line}: not a CSV row ({exc})"
                continue
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            try:
                t, index, uuid, sample = parse_row(row)
            except ValueError as exc:  # no header is a row: its timestamp is a field's name
                if looks_like_header(row):
                    yield _Header(line, row)
                    return
                if any(said in text for said in SMI_SAYS):  # nvidia-smi's own word in place of rows
                    skips.skip(f"{path}:{line}: nvidia-smi's own message, not a row: {text.strip()[:160]}")
                    continue
                yield f"{path}:{line}: {exc}"
                continue
            assert t is not None
            yield line, t, index, uuid, sample

    def row_blocks() -> Iterator[_Rows]:
        nonlocal parse_row, parse_block
        for first, lines in itertools.chain([(first_line, head_lines)], blocks):
            while lines:
                parsed = parse_block(lines)
                if parsed is not None:
                    times, fields = parsed
                    count = len(times)
                    yield _Rows(range(first, first + count), times, fields[0] or [None] * count,
                                fields[1] or [None] * count, None, fields)
                    break
                # row by row; a malformed row is reported after the rows before it
                read: list[_Row] = []
                header = None
                for item in by_row(first, lines):
                    if isinstance(item, _Header):
                        header = item
                    elif isinstance(item, str):
                        if read:
                            yield _rows_of(read)
                            read = []
                        skips.malformed(item)
                    else:
                        read.append(item)
                if read:
                    yield _rows_of(read)
                if header is None:
                    break
                # a header met mid-file (`cat` of two logs) is the header of the lines after it
                layout = _layout(parse_header(header.fields), path, header.line)
                if _identified(layout) != identified:
                    raise TraceError(f"{path}:{header.line}: this header tells the GPUs apart by "
                                     f"{_IDENTITY[_identified(layout)]}, the log's first header by "
                                     f"{_IDENTITY[identified]}: two kinds of log joined?")
                parse_row, parse_block = _row_parser(layout), _block_parser(layout)
                lines, first = lines[header.line + 1 - first:], header.line + 1

    store = RowStore()
    if identified:
        ordinals: dict[str, int] = {}

        def named() -> Iterator[RowBlock]:
            for block in row_blocks():
                indexes = _numbered(block.indexes, block.uuids, ordinals)
                yield RowBlock(store.add(block.lines, block.columns()), block.lines, block.times, indexes)

        samples = by_identity(named(), store, path, skips)
    else:
        rows = itertools.chain.from_iterable(
            zip(block.lines, block.times, itertools.count(store.add(block.lines, block.columns())))
            for block in row_blocks())
        samples = group_by_time(rows, path, skips)
    yield from assemble(samples, store)


@dataclass(frozen=True)
class _Header:
    """A header line met among the rows."""

    line: int
    fields: list[str]


def _numbered(indexes: list[int | None], uuids: list[str | None], ordinals: dict[str, int]) -> list[int]:
    """Each row's GPU: its index, or where it has none (a log naming its GPUs by uuid) its uuid's number in the order
    first seen. A block of uuids seen before is looked up at once."""
    if None not in indexes:
        return indexes  # type: ignore[return-value]  # an index column: every row's
    if indexes.count(None) == len(indexes):
        known = list(map(ordinals.get, uuids))  # type: ignore[arg-type]  # a uuid column: a str in every row
        if None not in known:
            return known  # type: ignore[return-value]
    return [gpu_ordinal(ordinals, uuid or "") if index is None else index for index, uuid in zip(indexes, uuids)]


def _rows_of(rows: list[_Row]) -> _Rows:
    numbers, times, indexes, uuids, samples = map(list, zip(*rows))
    return _Rows(numbers, times, indexes, uuids, samples)


def _layout(columns: list[Column], path: str, line: int) -> Layout:
    if all(c.name != "timestamp" for c in columns):
        raise TraceError(f"{path}:{line}: the header has no timestamp column; add timestamp to --query-gpu")
    return Layout.of(columns)


def _identified(layout: Layout) -> bool:
    """Whether the log names each row's GPU (an index or uuid column), or leaves it to the rows' order in time."""
    return layout.index is not None or layout.uuid is not None


_IDENTITY = {True: "index or uuid", False: "the order of the rows in time"}


class _Rows(NamedTuple):
    """A block of parsed rows, column by column: its samples, or the block parser's GpuSample field
    columns (None for a field the log does not have) to build them from where needed."""

    lines: Sequence[int]
    times: list[float]
    indexes: list[int | None]
    uuids: list[str | None]
    samples: list[GpuSample] | None
    fields: list[list[Any] | None] | None = None

    def columns(self) -> list[list[Any] | None]:
        """The rows' GpuSample field columns (None: a field the log lacks)."""
        if self.fields is not None:
            return self.fields
        samples: list[GpuSample] = self.samples  # type: ignore[assignment]  # samples or fields: one is there
        if not samples:
            return [None] * len(GpuSample._fields)
        return [list[Any](column) for column in zip(*samples)]
