"""`record`: live NVML or a scenario to a JSON Lines recording (the format `replay` reads)."""

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
from typing import Protocol

from watchdog.cli.common import EXIT_FAILURE, EXIT_OK, error, open_nvml
from watchdog.config import load_config
from watchdog.plumbing.schedule import Ticker
from watchdog.plumbing.signals import SignalEvents
from watchdog.sample import recording, sim
from watchdog.sample.errors import TraceError
from watchdog.sample.replay import SIM_PREFIX, scenario
from watchdog.vocabulary.model import NodeSnapshot


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
            with SignalEvents({signal.SIGINT: stop, signal.SIGTERM: stop}), _output(args.out) as write:
                written, dropped = record_live(source, write, started, interval, args.duration_seconds, stop)
        finally:
            source.close()
    if dropped:
        error(f"{dropped} line(s) could not be written")
        return EXIT_FAILURE
    if args.out != "-":
        print(f"recorded {written - 1} samples to {args.out}", file=sys.stderr)
    return EXIT_OK
