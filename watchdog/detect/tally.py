"""Each GPU's running totals of utilization as of each row (a fixed-point sum and a count of readings: a
window's mean is two rows of them apart), kept over the longest window that asks for them (underuse's ten
minutes), apart from the stretch's other rows, which the detectors need for seconds only: 3 columns of 600
rows and more, not 26 (at 64 GPUs: 0.6 MiB, not 8)."""

from __future__ import annotations

import numpy as np

from watchdog.detect.row_buffers import appended


class Tally:
    """Rows numbered from the first ever (`first_row` is the first kept), their times, and the totals as of
    each (rows x GPUs, int64); `base`, the totals as of the row before the first kept (nothing: zeros)."""

    def __init__(self, times: np.ndarray, sums: np.ndarray, counts: np.ndarray, first_row: int,
                 base: np.ndarray):
        self.times, self.sums, self.counts, self.first_row, self.base = times, sums, counts, first_row, base
        self._store: list[np.ndarray | None] | None = None  # the buffers the rows are views of (row_buffers)
        self._lo = 0

    @classmethod
    def empty(cls, width: int = 0) -> Tally:
        return cls(np.empty(0), np.empty((0, width), np.int64), np.empty((0, width), np.int64), 0,
                   np.zeros((2, width), np.int64))

    def __len__(self) -> int:
        return len(self.times)

    def joined(self, times: np.ndarray, sums: np.ndarray, counts: np.ndarray) -> Tally:
        """These rows followed by the next ones'."""
        store, lo, parts = appended(self._store, self._lo, [self.times, self.sums, self.counts], [times, sums, counts])
        times, sums, counts = (part if part is not None else np.empty(0) for part in parts)
        joined = Tally(times, sums, counts, self.first_row, self.base)
        joined._store, joined._lo = store, lo
        return joined

    def rows_from(self, first: int) -> Tally:
        before = np.stack([self.sums[first - 1], self.counts[first - 1]]) if first else self.base
        rest = Tally(self.times[first:], self.sums[first:], self.counts[first:], self.first_row + first, before)
        rest._store, rest._lo = self._store, self._lo + first
        return rest

    def widened(self, width: int) -> Tally:
        """With columns for GPUs not seen before: nothing summed for them yet."""
        def wide(a: np.ndarray) -> np.ndarray:
            return np.hstack([a, np.zeros((a.shape[0], width - a.shape[1]), np.int64)])
        return Tally(self.times, wide(self.sums), wide(self.counts), self.first_row, wide(self.base))

    def before(self, rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The sum and count of each column as of the row before each of these rows."""
        prior = np.maximum(rows - 1, 0)
        first = rows > 0
        return (np.where(first, self.sums[prior, cols], self.base[0, cols]),
                np.where(first, self.counts[prior, cols], self.base[1, cols]))
