"""Judging one GPU's readings with one rule, as the engine would on the newest of them: the readings become
a stretch (detect/frames.py) and the rule is asked about the last tick's cell."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from watchdog.config import Config
from watchdog.detect.engine import DetectorEngine
from watchdog.detect.evidence import Evidence
from watchdog.detect.frames import Frames, Ticks
from watchdog.detect.stretch import Cells, Context, Stretch
from watchdog.vocabulary.model import GpuSample, NodeSnapshot

GIB = 2**30


def fresh_frames(config: Config | None = None) -> Frames:
    """The frames a fresh engine holds."""
    return DetectorEngine(config or Config()).frames


def stretch_of(samples: Sequence[tuple[float, GpuSample]], config: Config | None = None) -> Stretch:
    """The stretch a fresh engine would hold after these (time, sample) readings of one GPU."""
    stretch, _ = fresh_frames(config).add(Ticks.of_snapshots([NodeSnapshot(t, (sample,)) for t, sample in samples]))
    return stretch


def newest(stretch: Stretch) -> Cells:
    """The cell of the stretch's one GPU on its last tick."""
    last = np.array([len(stretch) - 1])
    return Cells(stretch, last, np.array([0]), last)


def judged(rule: Callable[[Cells, Any, Context], dict[int, Evidence]], readings: Sequence[dict], section: Any, *,
           step: float = 1.0, memory_min_bytes: int = GIB, base: dict | None = None,
           config: Config | None = None) -> Evidence | None:
    """The rule's evidence on the newest of these readings (fields of GpuSample, one per `step` seconds)."""
    samples = [(n * step, GpuSample(index=0, **{**(base or {}), **fields})) for n, fields in enumerate(readings)]
    config = config or Config()
    short = max(config.detectors.busy_spin.window_seconds, config.detectors.zero_util.window_seconds)
    return rule(newest(stretch_of(samples, config)), section, Context(short, memory_min_bytes)).get(0)
