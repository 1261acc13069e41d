"""The telemetry the daemon keeps for incident bundles gives back exactly the snapshots it was handed, for the
last minutes only, and holds what does not change from tick to tick once."""

from __future__ import annotations

import dataclasses

from tests.traces.corpus import make, snapshots
from watchdog.act.kept_telemetry import KeptTelemetry
from watchdog.vocabulary.model import GpuHealth, NodeSnapshot


def test_snapshots_come_back_exactly_for_the_window_kept() -> None:
    stream = list(snapshots(make("hang_spin", 4), live=True))
    # What a live sample carries besides readings, changing now and then: processes, stack counts, health.
    stream = [dataclasses.replace(s, gpus=tuple(
        g._replace(pids=(4000 + g.index,) if n > 20 else (), rank_waits=(1, g.index, n // 7, n // 9, 0, 5, 1),
                   health=GpuHealth.LOST if (n, g.index) == (30, 1) else g.health, clock_event_reasons=1 << 40,
                   ecc_corrected=n // 50)
        for g in s.gpus)) for n, s in enumerate(stream)]
    kept = KeptTelemetry()
    for snapshot in stream:
        kept.append(snapshot, 120.0)
    newest = stream[-1].time_seconds
    expected = [s for s in stream if newest - s.time_seconds <= 120.0]
    assert 0 < len(expected) < len(stream)
    assert list(kept) == expected
    assert len(kept) == len(expected)


def test_what_does_not_change_is_held_once() -> None:
    stream: list[NodeSnapshot] = list(snapshots(make("healthy_train", 2), messy=False))[:300]
    kept = KeptTelemetry()
    for snapshot in stream:
        kept.append(snapshot, 1e9)
    rests = {id(rest) for _, _, tick in kept._ticks for rest in tick}
    # Of what is not a reading, only the idle clock-event reason changes here: one rest a GPU for each of its states.
    states = {(g.index, g.clock_event_reasons) for s in stream for g in s.gpus}
    assert len(rests) == len(states) < len(stream) / 10
    assert list(kept) == stream
