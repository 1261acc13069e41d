"""How many GPUs a log without an `index` column holds, and which rows form one sample.

nvidia-smi prints the GPUs of one sample in enumeration order a few milliseconds apart, with the sampling
interval between samples: the count is voted from the timestamp gaps, and samples that nvidia-smi cut
short are found by checking the phase of the block boundaries over a look-ahead.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Iterator

from watchdog.sample.errors import SkipLog, TraceError
from watchdog.sample.smi_samples import Run

_MAX_GPUS = 32
_CHUNK = 128  # gaps per voting chunk


def _score_counts(gaps: list[float]) -> tuple[float, int]:
    """(how clearly, count): the row count per sample whose block boundaries, at the best phase, fall
    on large gaps while the gaps inside blocks stay small. The smallest count that explains the gaps
    wins (2N explains them too)."""
    floor = 0.0005
    ordered = sorted(gaps)
    best: tuple[float, int] = (0.0, 1)
    for count in range(2, min(_MAX_GPUS, len(gaps) // 3) + 1):
        # If count is right, the largest 1/count of the gaps are the boundaries; the rest are inside
        # samples, and almost none of those may be large.
        inside_high = ordered[int(0.95 * (len(ordered) * (count - 1) // count - 1))]
        # ... and at the right phase every boundary is a real gap (a low percentile stays large).
        low_boundary = max(sorted(gaps[phase::count])[len(gaps[phase::count]) // 4] for phase in range(count))
        score = max(low_boundary, floor) / max(inside_high, floor)
        if score > best[0] * 1.5:
            best = (score, count)
    return best


def _infer_gpu_count(times: list[float]) -> int:
    """GPUs per sample of a log without index or uuid, from the first rows' timestamps. Chunks of the
    log vote, so a sample that nvidia-smi cut short only spoils its own chunk."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    votes: Counter[int] = Counter()
    for start in range(0, len(gaps), _CHUNK):
        part = gaps[start:start + _CHUNK]
        if len(part) >= 6:
            score, count = _score_counts(part)
            if score >= 4:
                votes[count] += 1
    if votes:
        return votes.most_common(1)[0][0]
    ordered = sorted(gaps)
    if ordered and ordered[len(ordered) // 2] > 0 and ordered[len(ordered) // 10] >= 0.5 * ordered[len(ordered) // 2]:
        return 1  # no grouping explains the gaps, and they are even: one GPU
    raise TraceError("cannot tell the GPUs apart: the log has no index or uuid column and its rows are "
                     "not grouped in time; add index to --query-gpu")


_Row = tuple[int, float, int]  # (line, time, the row's number in the RowStore)
_LOOKAHEAD_SAMPLES = 16


def _best_phase(times: list[float], previous: float | None, count: int) -> int:
    """How many leading rows to drop so that block boundaries fall on the largest gaps.

    Decided over a look-ahead of many samples, by the median boundary gap, so one slow nvidia-smi query
    inside a sample (seen: 4.4 s between GPU 0 and GPU 1) does not shift the phase, while a sample that
    nvidia-smi cut short (a lone GPU 0 row before a stall) does."""
    gaps = [times[0] - previous if previous is not None else float("inf")]
    gaps += [b - a for a, b in zip(times, times[1:])]
    scores = []
    for offset in range(count):
        boundary = sorted(gaps[offset::count])
        scores.append(boundary[len(boundary) // 2] if boundary else 0.0)
    best = max(range(count), key=lambda o: scores[o])
    return best if scores[best] > 2 * max(scores[0], 0.0005) else 0


def group_by_time(rows: Iterator[_Row], path: str, skips: SkipLog) -> Iterator[Run]:
    """Rows in enumeration order, `count` per sample, the count inferred from the timestamps; each row's GPU
    is its place in its sample."""
    rows = iter(rows)
    head = list(itertools.islice(rows, 4096))
    if not head:
        return
    try:
        count = _infer_gpu_count([item[1] for item in head])
    except TraceError as exc:
        raise TraceError(f"{path}: {exc}") from None
    if count == 1:  # each row a sample of its own, and none can be cut short: taken a block at a time
        rows = itertools.chain(head, rows)
        while chunk := list(itertools.islice(rows, 4096)):
            yield Run([item[1] for item in chunk], (0,), [item[2] for item in chunk])
        return
    buffer: deque[_Row] = deque(head)
    look = _LOOKAHEAD_SAMPLES * count
    layout = tuple(range(count))
    previous: float | None = None

    while True:
        while len(buffer) < look:
            item = next(rows, None)
            if item is None:
                break
            buffer.append(item)
        if len(buffer) < count:
            if buffer:
                skips.skip(f"{path}:{buffer[0][0]}: last sample has {len(buffer)} of {count} rows (log cut short)")
            return
        block_times = [buffer[i][1] for i in range(min(len(buffer), count + 1))]
        inner = max((b - a for a, b in zip(block_times, block_times[1:count])), default=0.0)
        after = block_times[count] - block_times[count - 1] if len(block_times) > count else float("inf")
        before = block_times[0] - previous if previous is not None else float("inf")
        if inner >= min(before, after):  # a boundary that is not the widest gap around: check the phase
            # over the look-ahead only: the buffer begins with the rows the count was voted on (4,096), and a
            # sample cut short far ahead would outvote the phase here, dropping whole rows that are not short
            drop = _best_phase([item[1] for item in itertools.islice(buffer, look)], previous, count)
            if drop:
                skips.skip(f"{path}:{buffer[0][0]}: sample cut short by nvidia-smi ({drop} of {count} rows); "
                       "dropped")
                for _ in range(drop):
                    previous = buffer.popleft()[1]
                continue
        block = [buffer.popleft() for _ in range(count)]
        previous = block[-1][1]
        yield Run([block[0][1]], layout, [item[2] for item in block])
