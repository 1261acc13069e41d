"""The `stall-watchdog` command: verbs, their help, and exit codes.

Exit codes: 0 success; 1 runtime failure (unreadable trace, no NVML, write error); 2 usage or
configuration error.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from types import FrameType
from typing import Protocol

from watchdog import __version__
from watchdog.config import ConfigError, load_config
from watchdog.detect.engine import DetectorEngine
from watchdog.export.timeline import TextTimeline, json_line
from watchdog.model import NodeSnapshot, gpu_list
from watchdog.sample import recording, sim
from watchdog.sample.errors import TraceError
from watchdog.sample.replay import SIM_PREFIX, open_trace, scenario

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

_SCENARIO_HELP = "\n".join(f"  sim:{name:<16} {s.description}" for name, s in sim.SCENARIOS.items())


def _error(message: str) -> None:
    print(f"stall-watchdog: {message}", file=sys.stderr)


# -- replay --------------------------------------------------------------------------------------
def cmd_replay(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    fields = [f.strip() for f in args.csv_fields.split(",")] if args.csv_fields else None
    engine = DetectorEngine(config)
    out = sys.stdout
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
            for event in engine.observe(snapshot):
                if timeline is None:
                    out.write(json_line(event, trace.naive_time) + "\n")
                else:
                    timeline.event(event)
        if trace.skips.count:
            _error(f"warning: {trace.skips.count} line(s) or sample(s) skipped; first: "
                   + "; ".join(trace.skips.first[:3]))
    if samples == 0:
        _error(f"{args.trace}: no samples in the trace")
        return EXIT_FAILURE
    if timeline is not None:
        assert first is not None and last is not None
        still_open = [f"{ep.finding.signature.value} ({ep.fired_severity.value}) on {gpu_list(ep.finding.gpus)}"
                      for ep in engine.tracker.episodes.values() if ep.fired_severity is not None]
        timeline.footer(first, last, samples, gpus, still_open)
    return EXIT_OK


# -- record --------------------------------------------------------------------------------------
class _Stop:
    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True


def _live(interval: float, duration: float | None, sample: Callable[[], NodeSnapshot], stop: _Stop
          ) -> Iterator[NodeSnapshot]:
    """Samples on the monotonic clock with no drift; a late tick is skipped, not bunched up."""
    started = time.monotonic()
    next_tick = started
    while not stop.requested:
        yield sample()
        if duration is not None and time.monotonic() - started >= duration:
            return
        next_tick += interval
        delay = next_tick - time.monotonic()
        if delay < -interval:
            next_tick = time.monotonic()
            delay = 0.0
        end = time.monotonic() + max(0.0, delay)
        while not stop.requested and time.monotonic() < end:
            time.sleep(min(0.2, max(0.0, end - time.monotonic())))


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
                    _error(f"warning: cannot write the recording ({exc}); dropping samples until it works")
        lines = []
    return written, dropped


class LiveSource(Protocol):
    driver_version: str | None

    @property
    def gpu_count(self) -> int: ...

    def sample(self) -> NodeSnapshot: ...


def record_live(source: LiveSource, write: Callable[[str], object], started: str, interval: float,
                duration: float | None, stop: _Stop) -> tuple[int, int]:
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


def cmd_record(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    interval = args.interval_seconds or config.sample.interval_seconds
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    stop = _Stop()
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    if args.simulate:
        chosen = scenario(args.simulate)
        head = recording.header(f"{SIM_PREFIX}{chosen.name}", started, interval_seconds=interval)
        snapshots: Iterator[NodeSnapshot] = sim.run(chosen, interval_seconds=interval)
        if args.duration_seconds is not None:
            limit = args.duration_seconds
            first: float | None = None

            def within(snapshot: NodeSnapshot) -> bool:
                nonlocal first
                first = snapshot.time_seconds if first is None else first
                return snapshot.time_seconds - first <= limit

            snapshots = itertools.takewhile(within, snapshots)
        with _output(args.out) as write:
            written, dropped = _write_lines(write, head, snapshots)
    else:
        from watchdog.sample.nvml import NvmlSource, NvmlUnavailable

        source = NvmlSource(call_timeout_seconds=config.sample.nvml_call_timeout_seconds)
        try:
            source.open()
        except NvmlUnavailable as exc:
            _error(f"{exc}\nNo GPU here? Try `stall-watchdog record --simulate spin_hang` or "
                   "`stall-watchdog replay sim:odd_rank`.")
            return EXIT_FAILURE
        try:
            with _output(args.out) as write:
                written, dropped = record_live(source, write, started, interval, args.duration_seconds, stop)
        finally:
            source.close()
    if dropped:
        _error(f"{dropped} line(s) could not be written")
        return EXIT_FAILURE
    if args.out != "-":
        print(f"recorded {written - 1} samples to {args.out}", file=sys.stderr)
    return EXIT_OK


# -- check-config --------------------------------------------------------------------------------
def cmd_check_config(args: argparse.Namespace) -> int:
    load_config(args.file)
    print(f"{args.file}: ok")
    return EXIT_OK


# -- parser --------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stall-watchdog",
        description="Catch stalled multi-GPU training jobs: busy-spin hangs (100%% util at idle power), "
                    "zero-util hangs, ranks waiting on one odd GPU, chronic under-use.",
        epilog="Exit codes: 0 ok, 1 runtime failure, 2 usage or configuration error.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"stall-watchdog {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    verbs.required = True

    replay = verbs.add_parser(
        "replay", help="run the detectors over a recorded trace at full speed",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run the stall detectors over a trace and print every episode transition "
                    "(fired, escalated, resolved).\n\nTRACE is one of:\n"
                    "  an nvidia-smi CSV log  nvidia-smi --query-gpu=timestamp,index,utilization.gpu,"
                    "power.draw,... --format=csv -l 1\n"
                    "  a JSON Lines recording written by `stall-watchdog record`\n"
                    f"  a built-in scenario:\n{_SCENARIO_HELP}",
        epilog="Examples:\n  stall-watchdog replay sim:odd_rank\n"
               "  stall-watchdog replay gpus.csv --json | jq .summary\n"
               "  stall-watchdog replay gpus.csv --csv-fields timestamp,index,utilization.gpu,power.draw\n",
    )
    replay.add_argument("trace", metavar="TRACE", help="CSV log, JSON Lines recording, or sim:SCENARIO")
    replay.add_argument("--config", metavar="FILE", help="YAML configuration (defaults when omitted)")
    replay.add_argument("--json", action="store_true",
                        help="one JSON object per episode event instead of a readable timeline")
    replay.add_argument("--lenient", action="store_true",
                        help="skip malformed lines (counted and reported) instead of stopping at the first")
    replay.add_argument("--csv-fields", metavar="LIST",
                        help="the --query-gpu list of a CSV log written with noheader")
    replay.set_defaults(func=cmd_replay)

    record = verbs.add_parser(
        "record", help="record the live GPUs (NVML) to a JSON Lines trace",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Sample every GPU through NVML on a fixed interval and write one JSON line per sample "
                    "(the format `replay` reads). Stop with Ctrl+C or --duration-seconds.",
        epilog="Examples:\n  stall-watchdog record --out node.jsonl --interval-seconds 1\n"
               "  stall-watchdog record --simulate spin_hang --out spin.jsonl   # no GPU needed\n",
    )
    record.add_argument("--out", default="-", metavar="FILE", help="output file (default: standard output)")
    record.add_argument("--interval-seconds", type=float, metavar="S",
                        help="sampling interval (default: sample.interval_seconds from the config, 1 s)")
    record.add_argument("--duration-seconds", type=float, metavar="S", help="stop after this long")
    record.add_argument("--simulate", metavar="SCENARIO",
                        help=f"write a built-in scenario instead of reading NVML ({', '.join(sim.SCENARIOS)})")
    record.add_argument("--config", metavar="FILE", help="YAML configuration")
    record.set_defaults(func=cmd_record)

    check = verbs.add_parser(
        "check-config", help="validate a configuration file",
        description="Validate a YAML configuration and report every problem with its key path.",
        epilog="Example:\n  stall-watchdog check-config /etc/stall-watchdog/config.yaml",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument("file", metavar="FILE")
    check.set_defaults(func=cmd_check_config)
    return parser


def _positive(value: float | None, name: str, parser: argparse.ArgumentParser) -> None:
    if value is not None and value <= 0:
        parser.error(f"{name} must be > 0, got {value:g}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("interval_seconds", "duration_seconds"):
        _positive(getattr(args, name, None), "--" + name.replace("_", "-"), parser)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        _error(f"invalid configuration:\n{exc}")
        return EXIT_USAGE
    except TraceError as exc:
        _error(str(exc))
        return EXIT_FAILURE
    except BrokenPipeError:
        return EXIT_OK  # `| head` closed the pipe
    except KeyboardInterrupt:
        return 130
