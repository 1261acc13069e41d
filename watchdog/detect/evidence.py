"""What a per-GPU detector returns when its condition holds on this tick."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from watchdog.vocabulary.model import Signature


@dataclass(slots=True)  # not frozen: a frozen dataclass is three times slower to build, and busy_spin builds
class Evidence:  # one per spinning GPU per tick; nothing changes one once built
    gpu: int
    signature: Signature
    since: float  # first sample of the window that shows the condition (the episode's onset)
    legs: tuple[str, ...] = ()
    facts: dict[str, float | str] = field(default_factory=dict)
    weak: bool = False  # busy_spin on power_fell and power_flat alone: counts only with the whole job
    early: bool = False  # busy_spin on its newest samples only: suspect it, confirm with the stacks (busy_spin.py)


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted, non-empty list."""
    rank = min(len(sorted_values) - 1, max(0, int(q * len(sorted_values))))
    return sorted_values[rank]


def run_start(times: Sequence[float], holds: Sequence[bool], share: float = 0.8) -> float:
    """Onset of a condition that `holds` at each of `times` (or not): the earliest sample that holds
    such that at least `share` of the samples from it to the newest hold too. Brief dips inside the
    run do not move the onset; the samples from before the condition began do not pull it earlier."""
    if all(holds):
        return times[0]
    held = itertools.accumulate(reversed(holds))  # from the newest back
    starts = [t for total, (t, ok, count) in enumerate(zip(reversed(times), reversed(holds), held), start=1)
              if ok and count >= share * total]
    return starts[-1] if starts else times[-1]
