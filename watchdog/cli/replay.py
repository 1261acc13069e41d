"""`replay`: the detectors over one trace or many at full speed, one timeline per trace.

Many traces (files, or folders of them) are replayed side by side in worker processes, one per core
by default; each trace's timeline is printed whole, in the order given.
"""

from __future__ import annotations

import argparse
import gc
import io
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

import numpy as np

from watchdog.cli.common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, error
from watchdog.config import Config, load_config
from watchdog.detect.engine import DetectorEngine
from watchdog.export import report as report_html
from watchdog.export.timeline import TextTimeline, json_line
from watchdog.sample import read_ahead
from watchdog.sample.errors import TraceError
from watchdog.sample.replay import SIM_PREFIX, TRACE_SUFFIXES, open_trace
from watchdog.vocabulary.model import (
    EpisodeEvent,
    EventKind,
    GpuSample,
    NodeSnapshot,
    SnapshotBlock,
    snapshot_range,
    snapshot_times,
)
from watchdog.vocabulary.words import gpu_list

_BATCH = 2048  # snapshots handed to the engine at once
# What the detectors need read at least once: without utilization no hang can be seen; without power, memory-
# controller utilization and SM activity all three, no busy spin (its legs are those readings).
_SPIN = ("power_watts", "memory_utilization_ratio", "sm_activity_ratio")
_SLOTS = {name: GpuSample._fields.index(name) for name in ("utilization_ratio", *_SPIN)}


class _Readings:
    """Which of the readings the detectors need a trace has held at least once (looked for until found)."""

    def __init__(self) -> None:
        self.unseen = set(_SLOTS)

    def note(self, batch: SnapshotBlock | list[NodeSnapshot]) -> None:
        for name in list(self.unseen):
            if isinstance(batch, SnapshotBlock):
                values = batch.columns[_SLOTS[name]]
                found = values is not None and (bool(np.isfinite(values).any()) if hasattr(values, "dtype") else
                                                any(v is not None and v == v for v in values))
            else:
                found = any(getattr(g, name) is not None for s in batch for g in s.gpus)
            if found:
                self.unseen -= {name} if name == "utilization_ratio" else set(_SPIN)  # one of the spin's is enough

    def warnings(self) -> list[str]:
        if "utilization_ratio" in self.unseen:
            return ["no utilization reading in the whole trace (the column is absent or [N/A] throughout): no hang "
                    "can be seen in it"]
        if all(name in self.unseen for name in _SPIN):
            return ["no power reading in the whole trace (absent or [N/A] throughout), nor memory-controller "
                    "utilization or SM activity: a busy spin cannot be told from work in it"]
        return []


@dataclass(frozen=True)
class ReplayOptions:
    config: Config
    csv_fields: list[str] | None
    lenient: bool
    json: bool
    report: str | None
    label: bool  # name the trace on each JSON line (many traces in one output)
    read_ahead: bool = False  # read the trace in a second process while this one detects


def cmd_replay(args: argparse.Namespace) -> int:
    # A replay makes millions of short-lived tuples and no reference cycles worth hunting for: the
    # collector's default pace would spend a fifth of the run walking the windows.
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    config = load_config(args.config)
    try:
        traces = expand_traces(args.trace)
    except TraceError as exc:
        error(str(exc))
        return EXIT_FAILURE
    if args.report and len(traces) > 1:
        error("--report draws one trace; give one TRACE with it")
        return EXIT_USAGE
    folder = Path(args.report).parent if args.report else None
    if folder is not None and not os.access(folder, os.W_OK | os.X_OK):  # known before the replay
        error(f"--report {args.report}: cannot write: {folder} "
              f"{'is not a folder one may write in' if folder.is_dir() else 'is no folder'}")
        return EXIT_FAILURE
    options = ReplayOptions(config, [f.strip() for f in args.csv_fields.split(",")] if args.csv_fields else None,
                            args.lenient, args.json, args.report, label=len(traces) > 1)
    jobs = args.jobs or os.cpu_count() or 1
    if len(traces) == 1:
        ahead = jobs > 1 and not traces[0].startswith(SIM_PREFIX) and read_ahead.available()
        return replay_trace(traces[0], replace(options, read_ahead=ahead), sys.stdout)
    status = EXIT_OK
    for text, warnings, code in _replay_all(traces, options, jobs):
        sys.stdout.write(text)
        sys.stdout.flush()
        for line in warnings:
            error(line)
        status = max(status, code)
    return status


def expand_traces(specs: Iterable[str]) -> list[str]:
    """The traces named on the command line, a folder standing for the trace files in it and its subfolders
    (sorted by path; a link to a folder is not followed, so a loop of links cannot make it walk forever)."""
    traces: list[str] = []
    for spec in specs:
        path = Path(spec)
        if not spec.startswith(SIM_PREFIX) and path.is_dir():
            found = sorted(str(file) for folder, _, names in os.walk(path) for name in names
                           if (file := Path(folder, name)).suffix.lower() in TRACE_SUFFIXES and file.is_file())
            if not found:
                raise TraceError(f"{spec}: no trace files in the folder or its subfolders (looked for "
                                 f"{', '.join(TRACE_SUFFIXES)})")
            traces += found
        else:
            traces.append(spec)
    return traces


def _replay_all(traces: list[str], options: ReplayOptions, jobs: int) -> Iterator[tuple[str, list[str], int]]:
    if jobs <= 1:
        yield from map(_replay_captured, traces, [options] * len(traces))
        return
    with ProcessPoolExecutor(max_workers=min(jobs, len(traces))) as pool:
        yield from pool.map(_replay_captured, traces, [options] * len(traces))


def _replay_captured(spec: str, options: ReplayOptions) -> tuple[str, list[str], int]:
    """One trace's replay, its timeline and its warnings kept for the caller to print whole."""
    out, warnings = io.StringIO(), list[str]()
    try:
        code = replay_trace(spec, options, out, warnings.append)
    except TraceError as exc:
        warnings.append(str(exc))
        code = EXIT_FAILURE
    return out.getvalue(), warnings, code


def _batches(stretches: Iterator[NodeSnapshot | SnapshotBlock]) -> Iterator[list[NodeSnapshot] | SnapshotBlock]:
    """A reader's blocks as they come, its single snapshots in lists of up to _BATCH; what came before a
    reader error is handed on before the error."""
    batch: list[NodeSnapshot] = []
    try:
        for item in stretches:
            if isinstance(item, SnapshotBlock):
                if batch:
                    yield batch
                    batch = []
                yield item
                continue
            batch.append(item)
            if len(batch) == _BATCH:
                yield batch
                batch = []
    except TraceError:
        if batch:
            yield batch
        raise
    if batch:
        yield batch


def replay_trace(spec: str, options: ReplayOptions, out: TextIO, say: Callable[[str], None] = error) -> int:
    """Replay one trace, writing its timeline (or JSON lines) to `out`; warnings go to `say`."""
    engine = DetectorEngine(options.config)
    kept: list[NodeSnapshot] = []  # for --report: thinned as it grows
    stride = 1
    fired: list[EpisodeEvent] = []
    opened = read_ahead.open_trace_ahead if options.read_ahead else open_trace
    with opened(spec, lenient=options.lenient, csv_fields=options.csv_fields) as trace:
        timeline = None if options.json else TextTimeline(out, spec, trace.naive_time)
        first = last = None
        samples = 0
        gpus: set[int] = set()  # every GPU seen, in any sample (not the most one sample held)
        readings = _Readings()
        for batch in _batches(trace.stretches):
            times = snapshot_times(batch, 0, len(batch))
            if isinstance(batch, SnapshotBlock):
                gpus.update(batch.layout)
            else:
                gpus.update(g.index for s in batch for g in s.gpus)
            if readings.unseen:
                readings.note(batch)
            if first is None:
                first = times[0]
            last = times[-1]
            samples += len(batch)
            if options.report:
                for offset, number in enumerate(range(samples - len(batch) + 1, samples + 1)):
                    if number % stride == 0:
                        kept.extend(snapshot_range(batch, offset, offset + 1))
                        if len(kept) > 4 * report_html.MAX_POINTS:
                            kept, stride = kept[::2], stride * 2
            for event in engine.observe(batch):
                if event.event is EventKind.SUSPECTED:
                    continue  # a look at the stacks, live; nothing to report from a trace
                fired.append(event)
                if timeline is None:
                    line = json_line(event, trace.naive_time, spec if options.label else None)
                    out.write(line + "\n")
                else:
                    timeline.event(event)
        clock = engine.clock
        where = f"{spec}: " if options.label else ""
        if clock.steps:
            say(f"warning: {where}the trace's clock stepped back {clock.steps} time(s) (the last by "
                f"{clock.last_step_seconds:.0f} s: DST, an NTP step, or two writers on one file?); later samples "
                "were read as following on, so event times after a step are shifted by the step")
        if clock.jumps:
            say(f"warning: {where}the trace's clock jumped forward {clock.jumps} time(s) (the last by "
                f"{clock.last_jump_seconds:.0f} s: DST, an NTP step, or samples missing); the time across a jump "
                "was not observed and counts as one sample interval, so event times after it are shifted")
        if samples:
            for said in readings.warnings():
                say(f"warning: {where}{said}")
        if trace.skips.count:
            say(f"warning: {trace.skips.count} line(s) or sample(s) skipped; first: "
                + "; ".join(trace.skips.first[:3]))
    if samples == 0:
        say(f"{spec}: no samples in the trace")
        return EXIT_FAILURE
    if timeline is not None:
        assert first is not None and last is not None
        still_open = [f"{ep.finding.signature.value} ({ep.fired_severity.value}) on {gpu_list(ep.finding.gpus)}"
                      for ep in engine.open_episodes() if ep.fired_severity is not None]
        timeline.footer(first, last, samples, len(gpus), still_open,
                        None if engine.clock.now is None else engine.clock.now - first)
    if options.report:
        episodes = report_html.episodes_from_events(fired)
        worst = max(episodes, key=lambda e: (e["severity"] == "critical", e["severity"] == "warning"), default=None)
        culprits = tuple(sorted({int(g) for e in episodes for g in e["culprit_gpus"]}))  # type: ignore[attr-defined]
        page = report_html.render(report_html.ReportData(
            f"replay of {spec}", report_html.Drawn(kept), episodes, naive_time=trace.naive_time,
            severity=report_html.overall_severity(episodes), culprit_gpus=culprits,
            headline=str(worst["headline"]) if worst else "no episode: nothing stalled in this trace",
            verdict=(f"{len(episodes)} episodes; the worst: " if len(episodes) > 1 else "")
            + (str(worst["summary"]) if worst else ""), open_until="at the recording's end"))
        try:
            Path(options.report).write_text(page, encoding="utf-8")
        except OSError as exc:
            say(f"--report {options.report}: cannot write: {exc.strerror or exc}")
            return EXIT_FAILURE
        print(f"report: {options.report}", file=sys.stderr)
    return EXIT_OK
