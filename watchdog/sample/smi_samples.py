"""Which rows of an nvidia-smi log make one sample, and runs of samples handed on as column blocks.

A log names each row's GPU (an index or uuid column: `by_identity`) or leaves it to the rows' order in time
(smi_gpu_count.py). Either way the samples are found touching only each row's GPU and time (samples that each
list the same GPUs as the one before, in nvidia-smi's order or each in one of its own, cut a run of them at a time;
a sample that does not, and the ones beside it, a row at a time), and runs of them leave as SnapshotBlocks
gathered from the block parser's columns (`assemble`): nothing builds a GpuSample per row, whatever the log's
shape. A sample's rows go in the order of their GPUs' indexes (rows written interleaved read like nvidia-smi's
own order); a sample that lacks a GPU of its run marks that GPU's row absent (a dropped row, a GPU out for a
while) rather than ending the run; a run ends where a GPU joins it.
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from watchdog.sample.errors import SkipLog, TraceError
from watchdog.sample.lines import MAX_GPUS, TraceGpus
from watchdog.vocabulary.model import SAMPLE_DEFAULTS, GpuSample, NodeSnapshot, SnapshotBlock

_INDEX = GpuSample._fields.index("index")
_RUN_ROWS = 4096  # rows a block handed on holds at most: about what one read of the log parses (lines.py)
_FIRST_SPLIT = 0.5
_SPAN_SAMPLES = 16  # the samples the block cutter looks at first, after an irregular one (by_identity)
_GAPS = 8  # the gaps between samples the sampling interval is learnt from, again every _GAPS samples


class Run(NamedTuple):
    """Samples of the same GPUs: their times, their GPUs in index order, and the numbers of their rows in the
    RowStore, sample after sample, each sample's in the order of its GPUs."""

    starts: list[float]
    layout: tuple[int, ...]
    rows: Sequence[int]


class RowBlock(NamedTuple):
    """A block of parsed rows as the cutters take it: where its rows are in the store, their lines, times and
    GPUs."""

    first: int
    lines: Sequence[int]
    times: list[float]
    indexes: Sequence[int]
    rows: list[int] | None = None  # the rows' numbers where they are not first, first + 1, ... (some refused)


class RowStore:
    """The parsed blocks of a log whose rows are not all handed on, each row addressed by a running number."""

    def __init__(self) -> None:
        self._blocks: deque[tuple[int, Sequence[int], Sequence[Sequence[Any] | None]]] = deque()
        self.next = 0  # the number the next row added gets

    def add(self, lines: Sequence[int], columns: Sequence[Sequence[Any] | None]) -> int:
        """Keep a block's lines and GpuSample field columns (None: the log lacks the field); the number of its
        first row."""
        base = self.next
        self._blocks.append((base, lines, columns))
        self.next += len(lines)
        return base

    def line(self, row: int) -> int:
        for base, lines, _ in self._blocks:
            if row < base + len(lines):
                return lines[row - base]
        raise IndexError(row)

    def release(self, before: int) -> None:
        """Forget the blocks whose rows all come before row `before`."""
        while self._blocks and self._blocks[0][0] + len(self._blocks[0][1]) <= before:
            self._blocks.popleft()

    def gather(self, rows: Sequence[int]) -> list[Sequence[Any] | None]:
        """The columns of these rows, in this order; a row of -1 holds every field's default."""
        absent = -1 in rows
        low = min(set(rows).difference((-1,))) if absent else min(rows)
        high = max(rows)
        spanned = [block for block in self._blocks if block[0] + len(block[1]) > low and block[0] <= high]
        base = spanned[0][0]
        if len(spanned) == 1:
            columns = spanned[0][2]
        else:  # a run across two reads of the log: their columns joined (a field one lacks: its default)
            columns = [None if all(block[2][slot] is None for block in spanned) else
                       [value for block in spanned for value in _filled(block[2][slot], default, len(block[1]))]
                       for slot, default in enumerate(SAMPLE_DEFAULTS)]
        if not absent and high - low == len(rows) - 1 and rows[0] == low and rows[-1] == high and (
                list(rows) == list(range(low, high + 1))):
            return [None if column is None else column[low - base:high + 1 - base] for column in columns]
        if absent:
            size = sum(len(block[1]) for block in spanned)
            positions = [size if row < 0 else row - base for row in rows]
        else:
            positions = list(map(operator.sub, rows, itertools.repeat(base)))
        picked: list[Sequence[Any] | None] = []
        for column, default in zip(columns, SAMPLE_DEFAULTS):
            if column is None:
                picked.append(None)
            else:
                source = [*column, default] if absent else column
                picked.append(list(map(source.__getitem__, positions)))
        return picked


def _filled(column: Sequence[Any] | None, default: Any, count: int) -> Sequence[Any]:
    return [default] * count if column is None else column


def by_identity(blocks: Iterator[RowBlock], store: RowStore, path: str, skips: SkipLog) -> Iterator[Run]:
    """The samples of a log whose rows name their GPU: a GPU seen again in a sample starts the next one, and so
    does a row more than half the sampling interval (half a second at least) after the row before it: a sample
    that lacked a GPU, then one that begins with it. The same GPU twice at the same time, and a
    row that would make the trace's GPUs more than it may name, are malformed rows."""
    gpus = TraceGpus()
    cut = _Cut()
    span = _SPAN_SAMPLES
    for block in blocks:
        try:
            gpus.admit(set(block.indexes))
        except ValueError:
            block = _admitted(block, gpus, store, path, skips)
        count, start, failures = len(block.times), 0, 0
        numbers = block.rows or range(block.first, block.first + count)
        while start < count:
            # Whole regular samples from `start` at once, a part of the block at a time (twice as long each time the
            # part was regular throughout: a block with an irregular sample every few is not read whole for each);
            # then row by row from the first row they leave, until a sample begun after it closes (more of them
            # each time the block cutter takes nothing: a stretch of irregular samples costs it a bounded number
            # of tries), and again at once from there.
            if block.rows is None:
                end = min(count, start + span * max(len(cut.order), 1))
                part = block if not start and end == count else RowBlock(
                    block.first + start, block.lines[start:end], block.times[start:end], block.indexes[start:end])
                run, taken = cut.regular(part)
                if run is not None:
                    yield run
                    failures = 0
                else:
                    failures += 1
                start += taken
                if taken and start == end:
                    span = min(2 * span, count)  # samples, never more than the block holds rows
                    continue
                span = _SPAN_SAMPLES
            wanted = 1 << max(0, failures - 1) if block.rows is None else count + 1
            closed = 0
            seen, rows, layout, stamps = cut.seen, cut.rows, cut.layout, cut.stamps
            for n in range(start, count):
                row, t, index = numbers[n], block.times[n], block.indexes[n]
                if index in seen or (stamps and t - stamps[-1] > cut.split):
                    kept = cut.kept(index, t)
                    if kept < 0:
                        skips.malformed(f"{path}:{store.line(row)}: GPU {index} twice at the same time")
                        continue
                    yield cut.close(kept)
                    seen, rows, layout, stamps = cut.seen, cut.rows, cut.layout, cut.stamps
                    closed += n > start
                seen.add(index)
                layout.append(index)
                rows.append(row)
                stamps.append(t)
                if closed >= wanted:
                    start = n + 1
                    break
            else:
                start = count
    if cut.rows:
        yield cut.close(len(cut.rows))


def _admitted(block: RowBlock, gpus: TraceGpus, store: RowStore, path: str, skips: SkipLog) -> RowBlock:
    """The block less its rows that would make the trace's GPUs more than it may name (each a malformed row)."""
    kept = []
    for n, index in enumerate(block.indexes):
        try:
            gpus.admit((index,))
            kept.append(n)
        except ValueError as exc:
            skips.malformed(f"{path}:{store.line(block.first + n)}: {exc}")
    return RowBlock(block.first, [block.lines[n] for n in kept], [block.times[n] for n in kept],
                    [block.indexes[n] for n in kept], [block.first + n for n in kept])


class _Cut:
    """by_identity's state: the open sample's GPUs, rows and times, the GPUs of the last whole sample, and the
    sampling interval learnt from the last samples' starts."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.layout: list[int] = []
        self.rows: list[int] = []
        self.stamps: list[float] = []
        self.order: list[int] = []  # the GPUs of the last whole sample, in the order its rows came
        self.last = 0.0
        self.starts: deque[float] = deque(maxlen=_GAPS + 1)
        # How long after the row before a row begins the next sample: half the interval, learnt from the samples'
        # starts, and never less than half a second (nvidia-smi -l samples every second or slower; a log written
        # faster, -lms, is cut by its GPUs alone, as is one whose sample is slow to print).
        self.split = _FIRST_SPLIT
        self.closed = 0

    def kept(self, index: int, t: float) -> int:
        """How many of the open sample's rows stay in it when a row of GPU `index` at time `t` ends it; -1 where
        that row repeats one of the sample's (the same GPU at the same time). Where the rows are stamped once a
        sample, and one lacked a GPU and the next began with it before the interval is learnt, the rows at this
        time begin the next sample."""
        if index not in self.seen or t != self.stamps[-1]:
            return len(self.rows)
        k = self.stamps.index(t)
        return -1 if k == 0 or index in self.layout[k:] else k

    def close(self, k: int) -> Run:
        """The open sample's first k rows as a sample; the rest stay open."""
        start, layout, rows, self.last = self.stamps[0], self.layout, self.rows, self.stamps[k - 1]
        if k == len(layout):
            self.layout, self.rows, self.stamps, self.seen = [], [], [], set()
        else:
            layout, rows = layout[:k], rows[:k]
            self.layout, self.rows, self.stamps = self.layout[k:], self.rows[k:], self.stamps[k:]
            self.seen = set(self.layout)
        self.order = layout
        self._started([start])
        if all(a < b for a, b in itertools.pairwise(layout)):
            return Run([start], tuple(layout), rows)
        return Run([start], tuple(sorted(layout)), _by_gpu(layout, rows))

    def _started(self, starts: list[float]) -> None:
        self.starts.extend(starts[-(_GAPS + 1):])
        self.closed += len(starts)
        if len(self.starts) > 1 and (len(self.starts) <= _GAPS or self.closed >= _GAPS):
            self.closed = 0
            gaps = sorted(b - a for a, b in itertools.pairwise(self.starts))
            self.split = max(gaps[len(gaps) // 2] / 2, _FIRST_SPLIT)

    def regular(self, block: RowBlock) -> tuple[Run | None, int]:
        """The whole samples at the start of a block that go through the last whole sample's GPUs in turn, no row of
        a sample more than half the interval after the row before it and no GPU twice at the same time, as one run,
        and how many of the block's rows it took: all of them where the whole block is so (the last sample begun
        stays open), else up to the first sample that is not (the one before it stays open: what that sample's first
        row means is the row cutter's to say). In nvidia-smi's own order the samples are slices; where each sample
        lists the same GPUs in an order of its own (rows interleaved), each is put in index order. (None, 0) where
        fewer than two samples are so: the rows are cut one at a time."""
        order, pending, indexes, times = self.order, len(self.rows), block.indexes, block.times
        width, count = len(order), len(times)
        if not width or block.rows is not None or pending + count <= width:
            return None, 0
        ordered = sorted(order)
        if any(a >= b for a, b in itertools.pairwise(ordered)):
            return None, 0
        begins = range(0, pending + count, width)  # in stamps: the rows that begin a sample
        # The samples from the first that are regular, the last begun counted: first as slices in nvidia-smi's order,
        # then, where that falls short, as samples each in an order of its own.
        good, in_order = 0, order == ordered and self.layout == order[:pending]
        if in_order:
            expected = list(itertools.islice(itertools.cycle(order), pending, pending + count))
            good = len(begins) if indexes == expected else (pending + _first_difference(indexes, expected)) // width
        every: list[int] = []
        if good < len(begins):
            every = [*self.layout, *indexes]
            mixed = _first_unlike(every, len(begins) - 1, width, ordered)
            begun = every[begins[-1]:]
            if mixed == len(begins) - 1 and len(set(begun)) == len(begun) and set(begun) <= set(ordered):
                mixed += 1
            if mixed > good:
                in_order, good = False, mixed
        stamps = [*self.stamps, *times]
        if not pending and stamps[0] == self.last:
            return None, 0
        good = next((k for k, i in enumerate(begins[1:good], start=1) if stamps[i] == stamps[i - 1]), good)
        if width > 1:  # a sample (the open one too, as far as it goes) spanning more than the split: its rows' gaps
            split, rows_in = self.split, len(stamps)
            good = next((k for k, i in enumerate(begins[:good])
                         if stamps[min(i + width, rows_in) - 1] - stamps[i] > split
                         and max(map(operator.sub, stamps[i + 1:i + width], stamps[i:i + width - 1])) > split), good)
        if good < 2:
            return None, 0
        tail = begins[good - 1] if good < len(begins) else begins[-1]  # the sample that stays open
        end = begins[good] if good < len(begins) else len(stamps)  # and the row after it
        every_row = [*self.rows, *range(block.first, block.first + end - pending)]
        if in_order:
            rows = every_row[:tail]
            self.layout = order[:end - tail]
        else:
            rows = _each_by_gpu(every, every_row, good - 1 if good < len(begins) else len(begins) - 1, width)
            self.layout = every[tail:end]
        starts = stamps[0:tail:width]
        self.stamps, self.rows = stamps[tail:end], every_row[tail:]
        self.seen, self.last = set(self.layout), stamps[end - 1]
        self._started(starts)
        return Run(starts, tuple(ordered), rows), end - pending


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first place two lists of the same length differ (they do somewhere), found by halving: list comparisons
    at C speed rather than a Python loop over every row."""
    low, high = 0, len(a)  # a[:low] == b[:low]; they differ before high
    while high - low > 1:
        middle = (low + high) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle
    return low


def _first_unlike(gpus: list[int], samples: int, width: int, ordered: list[int]) -> int:
    """The first of `samples` samples of `width` rows each (`gpus`, sample after sample) whose GPUs are not
    `ordered` in some order; `samples` where all are."""
    if not samples:
        return 0
    grid = np.array(gpus[:samples * width]).reshape(samples, width)
    unlike = np.flatnonzero((np.sort(grid, axis=1) != np.array(ordered)).any(axis=1))
    return int(unlike[0]) if len(unlike) else samples


def _each_by_gpu(gpus: list[int], rows: list[int], samples: int, width: int) -> list[int]:
    """The rows of the first `samples` samples of `width` rows each, each sample's in index order (no GPU twice
    in a sample: _by_gpu on each)."""
    grid = np.array(gpus[:samples * width]).reshape(samples, width)
    order = np.argsort(grid, axis=1, kind="stable")
    picked = np.array(rows[:samples * width]).reshape(samples, width)[np.arange(samples)[:, None], order]
    return picked.ravel().tolist()


def _by_gpu(gpus: Sequence[int], rows: Sequence[int]) -> list[int]:
    """A sample's rows in index order (its GPUs as listed, each row beside its GPU; no GPU twice)."""
    return [row for _, row in sorted(zip(gpus, rows))]


def assemble(runs: Iterator[Run], store: RowStore) -> Iterator[NodeSnapshot | SnapshotBlock]:
    """Runs of samples as SnapshotBlocks of at most about _RUN_ROWS rows (a block of one sample as its
    snapshot): a block's GPUs are its first sample's, a later sample lacking some marks their rows absent, and a
    sample naming a GPU the block lacks begins the next. What was read before a malformed line is handed on
    before its error."""
    held: list[Run] = []
    layout: tuple[int, ...] = ()
    rows = 0
    try:
        for run in runs:
            if held and (rows >= _RUN_ROWS or (run.layout != layout and not set(run.layout) <= set(layout))):
                yield _stretch(held, layout, store)
                store.release(min(run.rows))
                held, rows = [], 0
            if not held:
                layout = run.layout
            held.append(run)
            rows += len(run.rows)
    except TraceError:
        if held:
            yield _stretch(held, layout, store)
        raise
    if held:
        yield _stretch(held, layout, store)


def _stretch(held: list[Run], layout: tuple[int, ...], store: RowStore) -> NodeSnapshot | SnapshotBlock:
    rows: list[int] = []
    starts: list[float] = []
    whole = True
    for run in held:
        starts += run.starts
        if run.layout == layout:
            rows += run.rows
            continue
        whole = False
        width = len(run.layout)
        for n in range(0, len(run.rows), width):
            place = dict(zip(run.layout, run.rows[n:n + width]))
            rows += [place.get(gpu, -1) for gpu in layout]
    columns = store.gather(rows)
    columns[_INDEX] = list(layout) * len(starts)
    present = None if whole else [row >= 0 for row in rows]
    block = SnapshotBlock(starts, layout, tuple(columns), present)
    return block.snapshots()[0] if len(starts) == 1 else block


def gpu_ordinal(ordinals: dict[str, int], uuid: str) -> int:
    """The number of a GPU a log names by its uuid alone, in the order first seen. Past MAX_GPUS uuids a new one is
    not kept: its number is one too many for the trace's bound, which refuses its row."""
    number = ordinals.get(uuid)
    if number is None:
        number = len(ordinals)
        if number < MAX_GPUS:
            ordinals[uuid] = number
    return number
