"""Shared test helpers: where the real data lives, and small builders for snapshots."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import pytest

from watchdog.config import Config
from watchdog.detect.engine import DetectorEngine
from watchdog.model import EpisodeEvent, NodeSnapshot

REPO = Path(__file__).resolve().parent.parent
REALDATA = Path(os.environ.get("STALL_WATCHDOG_REALDATA", REPO.parent / "shared" / "realdata"))


def realdata(*parts: str) -> Path:
    """A file under ../shared/realdata; the test skips (with the reason) when a clone has no ../shared."""
    path = REALDATA.joinpath(*parts)
    if not REALDATA.is_dir():
        pytest.skip(f"real data not found at {REALDATA} (CI provides ../shared; a fresh clone may not)")
    assert path.exists(), f"{path} is missing from the real data"
    return path


def run_engine(snapshots: Iterable[NodeSnapshot], config: Config | None = None) -> list[EpisodeEvent]:
    engine = DetectorEngine(config or Config())
    events: list[EpisodeEvent] = []
    for snapshot in snapshots:
        events.extend(engine.observe(snapshot))
    return events
