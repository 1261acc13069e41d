"""`replay` (the detectors over a trace at full speed) and `record` (live NVML or a scenario to JSON Lines)."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol

from watchdog.cli.common import EXIT_FAILURE, EXIT_OK, error, open_nvml
from watchdog.config import load_config
from watchdog.detect.engine import DetectorEngine
from watchdog.export import report as report_html
from watchdog.export.timeline import TextTimeline, json_line
from watchdog.model import EpisodeEvent, EventKind, NodeSnapshot, gpu_list
from watchdog.sample import recording, sim
from watchdog.sample.errors import TraceError
from watchdog.sample.replay import SIM_PREFIX, open_trace, scenario
from watchdog.schedule import Ticker


# -- replay --------------------------------------------------------------------------------------
def cmd_replay(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    fields = [f.strip() for f in args.csv_fields.split(",")] if args.csv_fields else None
    engine = DetectorEngine(config)
    out = sys.stdout
    kept: list[NodeSnapshot] = []  # for --report: thinned as it grows
    stride = 1
    fired: list[EpisodeEvent] = []
    with open_trace(args.trace, lenient=args.lenient, csv_fields=fields) as trace:
        timeline = None if args.json else TextTimeline(out, args.trace, trace.naive_time)
        first = last = None
        samples = gpus = 0
        for snapshot in trace.snapshots:
            if first is None:
                first = snapshot.time_seconds
            last = snapshot.time_seconds
            samples += 1
            gpus = max(gpus, len(snapshot.gpus))
            if args.report and samples % stride == 0:
                kept.append(snapshot)
                if len(kept) > 4 * report_html.MAX_POINTS:
                    kept, stride = kept[::2], stride * 2
            for event in engine.observe(snapshot):
                if event.event is EventKind.SUSPECTED:
                    continue  # a look at the stacks, live; nothing to report from a trace
                fired.append(event)
                if timeline is None:
                    out.write(json_line(event, trace.naive_time) + "\n")
                else:
                    timeline.event(event)
        if engine.clock_steps:
            error(f"warning: the trace's clock stepped back {engine.clock_steps} time(s) (the last by "
                  f"{engine.last_step_seconds:.0f} s: DST or an NTP step?); later samples were read as following "
                  "on, so event times after a step are shifted by the step")
        if trace.skips.count:
            error(f"warning: {trace.skips.count} line(s) or sample(s) skipped; first: "
                  + "; ".join(trace.skips.first[:3]))
    if samples == 0:
        error(f"{args.trace}: no samples in the trace")
        return EXIT_FAILURE
    if timeline is not None:
        assert first is not None and last is not None
        still_open = [f"{ep.finding.signature.value} ({ep.fired_severity.value}) on {gpu_list(ep.finding.gpus)}"
                      for ep in engine.tracker.episodes.values() if ep.fired_severity is not None]
        timeline.footer(first, last, samples, gpus, still_open)
    if args.report:
        episodes = report_html.episodes_from_events(fired)
        page = report_html.render(report_html.ReportData(
            f"replay of {args.trace}", kept, episodes, naive_time=trace.naive_time,
            verdict="; ".join(str(e["summary"]) for e in episodes[:3]) or "no episode"))
        try:
            Path(args.report).write_text(page, encoding="utf-8")
        except OSError as exc:
            error(f"--report {args.report}: cannot write: {exc.strerror or exc}")
            return EXIT_FAILURE
        print(f"report: {args.report}", file=sys.stderr)
    return EXIT_OK


# -- record --------------------------------------------------------------------------------------
def _live(interval: float, duration: float | None, sample: Callable[[], NodeSnapshot], stop: threading.Event
          ) -> Iterator[NodeSnapshot]:
    """Samples on the daemon's schedule (monotonic, no drift; a late tick is skipped, not bunched up)."""
    ticker = Ticker()
    started = ticker.monotonic()
    while not stop.is_set():
        yield sample()
        if duration is not None and ticker.monotonic() - started >= duration:
            return
        delay, _ = ticker.advance(interval)
        if delay > 0:
            stop.wait(delay)


def _write_lines(write: Callable[[str], object], head: dict[str, object], snapshots: Iterator[NodeSnapshot]
                 ) -> tuple[int, int]:
    """Write a recording; a write error (a full disk) drops that line, says so once, and goes on."""
    written = dropped = 0
    warned: set[str] = set()
    lines = [json.dumps(head)]
    for snapshot in snapshots:
        lines.append(recording.encode(snapshot))
        for line in lines:
            try:
                write(line + "\n")
                written += 1
            except BrokenPipeError:
                raise  # the reader went away (`| head`): stop, nothing to report
            except OSError as exc:
                dropped += 1
                if str(exc) not in warned:
                    warned.add(str(exc))
                    error(f"warning: cannot write the recording ({exc}); dropping samples until it works")
        lines = []
    return written, dropped


class LiveSource(Protocol):
    driver_version: str | None

    @property
    def gpu_count(self) -> int: ...

    def sample(self) -> NodeSnapshot: ...


def record_live(source: LiveSource, write: Callable[[str], object], started: str, interval: float,
                duration: float | None, stop: threading.Event) -> tuple[int, int]:
    """The record loop over an opened source: (lines written, lines dropped)."""
    head = recording.header("nvml", started, interval_seconds=interval,
                            driver_version=source.driver_version, gpus=source.gpu_count)
    return _write_lines(write, head, _live(interval, duration, source.sample, stop))


@contextmanager
def _output(path: str) -> Iterator[Callable[[str], None]]:
    """A line writer straight to the file descriptor: no buffer, so a line that fails to write (a full
    disk) is gone and nothing is left over to fail again at close."""
    if path == "-":
        sys.stdout.flush()
        fd, owned = sys.stdout.fileno(), False
    else:
        try:
            fd, owned = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), True
        except OSError as exc:
            raise TraceError(f"{path}: cannot write: {exc.strerror or exc}") from None

    def write(line: str) -> None:
        data = memoryview(line.encode("utf-8"))
        while data:
            data = data[os.write(fd, data):]

    try:
        yield write
    finally:
        if owned:
            os.close(fd)


def _simulated(name: str, interval: float, duration: float | None) -> Iterator[NodeSnapshot]:
    snapshots: Iterator[NodeSnapshot] = sim.run(scenario(name), interval_seconds=interval)
    if duration is None:
        return snapshots
    first: float | None = None

    def within(snapshot: NodeSnapshot) -> bool:
        nonlocal first
        first = snapshot.time_seconds if first is None else first
        return snapshot.time_seconds - first <= duration

    return itertools.takewhile(within, snapshots)


def cmd_record(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    interval = args.interval_seconds or config.sample.interval_seconds
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if args.simulate:
        head = recording.header(f"{SIM_PREFIX}{scenario(args.simulate).name}", started, interval_seconds=interval)
        with _output(args.out) as write:
            written, dropped = _write_lines(write, head, _simulated(args.simulate, interval, args.duration_seconds))
    else:
        source = open_nvml(config, "No GPU here? Try `stall-watchdog record --simulate spin_hang` or "
                                   "`stall-watchdog replay sim:odd_rank`.")
        if source is None:
            return EXIT_FAILURE
        try:
            with _output(args.out) as write:
                written, dropped = record_live(source, write, started, interval, args.duration_seconds, stop)
        finally:
            source.close()
    if dropped:
        error(f"{dropped} line(s) could not be written")
        return EXIT_FAILURE
    if args.out != "-":
        print(f"recorded {written - 1} samples to {args.out}", file=sys.stderr)
    return EXIT_OK
