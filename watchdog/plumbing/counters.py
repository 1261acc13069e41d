"""Thread-safe counters shared by the loop and its workers. The actions count into them and the metrics
collector renders them; neither knows the other. The names come from the series table (export/series.py)
through the composition root, so a misspelt counter fails at once instead of exporting nothing."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable


class Counters:
    def __init__(self, names: Iterable[str]):
        self._lock = threading.Lock()
        self._values: dict[str, Counter[tuple[str, ...]]] = {name: Counter() for name in names}

    def inc(self, name: str, *labels: str, amount: float = 1.0) -> None:
        with self._lock:
            self._values[name][labels] += amount  # type: ignore[assignment]

    def snapshot(self) -> dict[str, dict[tuple[str, ...], float]]:
        with self._lock:
            return {name: dict(values) for name, values in self._values.items()}

    def get(self, name: str, *labels: str) -> float:
        with self._lock:
            return self._values[name][labels]
