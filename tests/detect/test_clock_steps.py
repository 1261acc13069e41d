"""Wall clocks step: a judgement weighs time observed, never a jump of the clock (detect/stream_clock.py).

A checkpoint pause that a local-time log's spring DST change, an NTP step, a sample stamped a day off or a
second nvidia-smi writer on the same file stretches must not page critical; the steps are said once."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from tests.conftest import REPO
from watchdog.config import Config
from watchdog.detect.engine import DetectorEngine
from watchdog.detect.stream_clock import StreamClock
from watchdog.vocabulary.model import EventKind, GpuSample, NodeSnapshot, Severity

HEADER = ("timestamp, index, utilization.gpu [%], power.draw [W], enforced.power.limit [W], memory.used [MiB]\n")
GPUS = 4


def pausing(t: float, pause: tuple[float, float]) -> bool:
    return pause[0] <= t < pause[1]


def rows(stamped: Iterable[tuple[float, float]], pause: tuple[float, float]) -> str:
    """nvidia-smi rows, local time, for each (true time, stamp): training at 98% and 560 W, or a checkpoint
    pause (0%, idle power, memory held) while the true time is inside `pause`."""
    out = []
    for true, stamp in stamped:
        day, rest = divmod(int(stamp) + 7200, 86400)
        hh, rest = divmod(rest, 3600)
        mm, ss = divmod(rest, 60)
        util, power = (0, 62.0) if pausing(true, pause) else (98, 560.0)
        for gpu in range(GPUS):
            out.append(f"2026/03/{29 + day:02d} {hh:02d}:{mm:02d}:{ss:02d}.000, {gpu}, {util} %, {power} W, "
                       f"700.00 W, 40000 MiB\n")
    return "".join(out)


def replay(log: Path) -> tuple[list[dict], str]:
    result = subprocess.run([sys.executable, "-m", "watchdog", "replay", str(log), "--json"], capture_output=True,
                            text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return [json.loads(line) for line in result.stdout.splitlines()], result.stderr


def critical(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("severity") == "critical"]


def test_spring_dst_during_a_checkpoint_is_a_gap_not_an_hour_of_idle(tmp_path: Path) -> None:
    """A 90 s pause from t=600; the local clock jumps an hour forward at t=640, inside it."""
    log = tmp_path / "dst.csv"
    log.write_text(HEADER + rows(((t, t if t < 640 else t + 3600) for t in range(1200)), (600, 690)))
    events, err = replay(log)
    assert critical(events) == [], events
    assert err.count("jumped forward") == 1 and "by 3600 s" in err  # an hour, not the hour and the interval


def test_autumn_dst_is_said_as_the_hour_it_stepped_back(tmp_path: Path) -> None:
    log = tmp_path / "autumn.csv"
    log.write_text(HEADER + rows(((t, t if t < 640 else t - 3600) for t in range(1200)), (600, 690)))
    events, err = replay(log)
    assert critical(events) == [], events
    assert err.count("stepped back") == 1 and "the last by 3600 s" in err, err  # was "by 3599 s"
    text = subprocess.run([sys.executable, "-m", "watchdog", "replay", str(log)], capture_output=True, text=True,
                          cwd=REPO, timeout=120).stdout
    # the footer spans the samples as read (1,200 one a second), not the stamps' last minus first (0 s: before)
    assert "(19 min 59 s observed: the clock was stepped)" in text, text[-400:]


def test_one_sample_stamped_a_day_off_is_not_a_day_idle(tmp_path: Path) -> None:
    for off in (86400, -86400):
        log = tmp_path / f"day{off}.csv"
        log.write_text(HEADER + rows(((t, t + off if t == 630 else t) for t in range(1200)), (600, 660)))
        events, _ = replay(log)
        assert critical(events) == [], (off, events)
        assert not any("24.0 h" in json.dumps(e) for e in events)


def test_two_writers_on_one_log_are_not_a_stretched_checkpoint(tmp_path: Path) -> None:
    """Two `nvidia-smi -l 1` writers append to one file, the second 3 s behind: the stamps step back at every
    other sample. A 200 s checkpoint stays 200 s (it was read as 26 minutes, and paged critical)."""
    stamped = [pair for t in range(1500) for pair in ((t, t), (t - 3, t - 3))]
    log = tmp_path / "two.csv"
    log.write_text(HEADER + rows(stamped, (600, 800)))
    events, err = replay(log)
    assert critical(events) == [], events
    for event in events:
        if event["event"] == "resolved":
            assert event.get("duration_seconds", 0) < 300, event
    assert err.count("stepped back") == 1


def test_live_an_ntp_step_forward_during_a_pause_does_not_page() -> None:
    """The daemon's ticks, one snapshot at a time: a 15-minute NTP step during a 30 s pause."""
    engine = DetectorEngine(Config())
    start = time.time()
    events = []
    for t in range(400):
        stamp = start + t + (900 if t >= 215 else 0)
        util, power = (0.0, 62.0) if 200 <= t < 230 else (0.98, 560.0)
        gpus = tuple(GpuSample(index=g, utilization_ratio=util, power_watts=power, power_limit_watts=700.0,
                               memory_used_bytes=40 * 2**30, memory_total_bytes=80 * 2**30) for g in range(GPUS))
        events += engine.observe(NodeSnapshot(stamp, gpus))
    assert [e for e in events if e.severity is Severity.CRITICAL and e.event is not EventKind.SUSPECTED] == []
    assert engine.clock.jumps == 1 and engine.clock.steps == 0


def test_the_clock_costs_at_most_one_interval_a_step() -> None:
    clock = StreamClock()
    steady, _ = clock.read([float(t) for t in range(100)])
    assert steady == [float(t) for t in range(100)]
    times, _ = clock.read([100 + 3600.0, 101 + 3600.0, 102.0, 103.0, 104.0])  # an hour ahead for two samples
    assert times == [100.0, 101.0, 102.0, 103.0, 104.0]
    assert (clock.jumps, clock.steps) == (1, 1)
    slow = StreamClock()  # sampled every 5 minutes: a cadence, not a gap
    assert slow.read([300.0 * n for n in range(10)])[0] == [300.0 * n for n in range(10)]
    assert slow.jumps == 0


def test_two_writers_keep_the_sampling_interval_and_join_where_they_are() -> None:
    """A second writer 4 s behind on a 10-s log: its samples join the stream at the time of the first writer's,
    and the interval stays 10 s (it was never learnt while the two clocks took turns, and the rules then read
    a 10-s log as sampled every second: a checkpoint's spinning GPUs paged critical in bench/accuracy.py
    --perturb --only writers)."""
    clock = StreamClock()
    times, steps = clock.read([s for t in range(0, 200, 10) for s in (float(t), t - 4.0)])
    assert times == [float(t) for t in range(0, 200, 10) for _ in range(2)]
    assert clock.interval == 10.0 and steps[-1] == 10.0 and clock.steps == 1
