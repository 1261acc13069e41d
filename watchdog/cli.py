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
from pathlib import Path
from types import FrameType
from typing import Protocol

from watchdog import __version__, logfmt
from watchdog.act.stack_formats import StackFormatError
from watchdog.act.stack_formats import load as load_dumps
from watchdog.act.stack_report import StackReport, capture_job, report_saved, write_captures
from watchdog.act.stacks import StackCapturer
from watchdog.config import Config, ConfigError, load_config
from watchdog.detect.engine import DetectorEngine
from watchdog.export import report as report_html
from watchdog.export.stack_text import render as render_stacks
from watchdog.export.timeline import TextTimeline, json_line
from watchdog.model import EpisodeEvent, EventKind, NodeSnapshot, gpu_list
from watchdog.sample import recording, sim
from watchdog.sample.errors import TraceError
from watchdog.sample.ranks import RankDiscovery, RankInfo, group_jobs
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
                fired.append(event)
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
    if args.report:
        episodes = _episodes_for_report(fired)
        page = report_html.render(report_html.ReportData(
            f"replay of {args.trace}", kept, episodes, naive_time=trace.naive_time,
            verdict="; ".join(str(e["summary"]) for e in episodes[:3]) or "no episode"))
        Path(args.report).write_text(page, encoding="utf-8")
        print(f"report: {args.report}", file=sys.stderr)
    return EXIT_OK


def _episodes_for_report(events: list[EpisodeEvent]) -> list[dict[str, object]]:
    """Fired (or escalated) episodes with the time they ended, for shading the timeline."""
    episodes: dict[tuple[str, float], dict[str, object]] = {}
    for e in events:
        key = (e.signature.value, e.onset_seconds)
        entry = episodes.setdefault(key, {"signature": e.signature.value, "onset": e.onset_seconds,
                                          "at": e.at_seconds, "end": None, "severity": e.severity.value,
                                          "summary": e.summary})
        if e.event is EventKind.RESOLVED:
            entry["end"] = e.at_seconds
        else:
            entry["severity"], entry["summary"] = e.severity.value, e.summary
    return list(episodes.values())


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


# -- stacks --------------------------------------------------------------------------------------
def _print_reports(reports: list[StackReport], as_json: bool) -> None:
    for number, report in enumerate(reports):
        if as_json:
            print(json.dumps(report.to_json()))
        else:
            print(("\n" if number else "") + render_stacks(report))


def _describe_pids(discovery: RankDiscovery, pids: list[int]) -> tuple[list[RankInfo], list[int]]:
    """The processes named with --pid, and the pids that do not exist."""
    ranks = [r for r in (discovery.describe(pid) for pid in pids) if r is not None]
    return ranks, sorted(set(pids) - {r.pid for r in ranks})


def cmd_stacks_dump(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    discovery = RankDiscovery()
    if args.pid:
        ranks, missing = _describe_pids(discovery, args.pid)
        if missing:
            _error(f"warning: no such process: {', '.join(map(str, missing))}")
    else:
        found = _ranks_on_gpus(discovery, args.gpu, config)
        if found is None:
            return EXIT_FAILURE
        ranks = found
    if not ranks:
        _error("no training ranks found (looked for processes on the GPUs, or with RANK/LOCAL_RANK and WORLD_SIZE "
               "in their environment); name them with --pid")
        return EXIT_FAILURE
    s = config.stacks
    capturer = StackCapturer(s.py_spy_command, s.timeout_seconds, s.native, s.max_parallel)
    reports = [capture_job(job, capturer, discovery, s.observe_seconds, s.flight_recorder)
               for job in group_jobs(ranks)]
    _print_reports(reports, args.json)
    if args.out:
        for report in reports:
            folder = Path(args.out) / report.job.replace(":", "_").replace("/", "_") if len(reports) > 1 else args.out
            written = write_captures(folder, report)
            print(f"wrote {len(written)} files to {folder}", file=sys.stderr)
    if all(c.result != "ok" for r in reports for c in r.captures):
        return EXIT_FAILURE
    return EXIT_OK


def _ranks_on_gpus(discovery: RankDiscovery, gpus: list[int] | None, config: Config) -> list[RankInfo] | None:
    """--gpu N / --all: the compute processes NVML lists; without NVML, --all scans for launched ranks."""
    from watchdog.sample.nvml import NvmlSource, NvmlUnavailable

    source = NvmlSource(call_timeout_seconds=config.sample.nvml_call_timeout_seconds)
    try:
        source.open()
    except NvmlUnavailable as exc:
        if gpus:
            _error(f"--gpu needs NVML: {exc}. Name the processes with --pid instead.")
            return None
        return discovery.scan()
    try:
        snapshot = source.sample()
    finally:
        source.close()
    if gpus:
        snapshot = NodeSnapshot(snapshot.time_seconds, tuple(g for g in snapshot.gpus if g.index in gpus))
    return discovery.from_snapshot(snapshot) or ([] if gpus else discovery.scan())


def cmd_stacks_analyze(args: argparse.Namespace) -> int:
    dumps = [dump for path in args.files for dump in load_dumps(path)]
    name = args.files[0] if len(args.files) == 1 else f"{len(args.files)} files"
    _print_reports([report_saved(dumps, name)], args.json)
    return EXIT_OK


# -- run -----------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    from watchdog.daemon import Daemon, Source
    from watchdog.export.server import Endpoint, EndpointError
    from watchdog.sample.nvml import NvmlSource, NvmlUnavailable

    logfmt.setup()
    config = load_config(args.config)
    source: Source
    if config.source.kind == "sim":
        source = sim.SimSource(scenario(config.source.scenario), config.sample.interval_seconds,
                               config.source.start_offset_seconds, config.source.pids or None)
    else:
        source = NvmlSource(call_timeout_seconds=config.sample.nvml_call_timeout_seconds)
    try:
        source.open()
    except NvmlUnavailable as exc:
        _error(f"{exc}\nNo NVIDIA GPU here? To see the watchdog work without one, set `source: {{kind: sim, "
               "scenario: spin_hang}` in the config, or run `stall-watchdog replay sim:odd_rank`.")
        return EXIT_FAILURE
    try:
        daemon = Daemon(config, source, config_path=args.config)
    except ValueError as exc:  # a receiver's secret that cannot be read
        _error(str(exc))
        return EXIT_USAGE
    try:
        endpoint = Endpoint(config.export, daemon.registry, daemon.healthy)
    except EndpointError as exc:
        _error(str(exc))
        return EXIT_FAILURE
    signal.signal(signal.SIGTERM, lambda *_: daemon.stop_requested.set())
    signal.signal(signal.SIGINT, lambda *_: daemon.stop_requested.set())
    signal.signal(signal.SIGHUP, lambda *_: daemon.reload_requested.set())
    endpoint.start()

    def ready() -> None:
        status = f"watching {source.gpu_count} GPUs ({config.source.kind}); metrics on {endpoint.url}"
        daemon.notifier.ready(status)
        logfmt.event("started", gpus=source.gpu_count, source=config.source.kind, metrics=endpoint.url,
                     bundles=config.bundles.directory, systemd=daemon.notifier.enabled or None)

    try:
        daemon.run(on_ready=ready, max_ticks=args.max_ticks)
    finally:
        logfmt.event("stopping", ticks=daemon.ticks)
        endpoint.stop()
        daemon.shutdown()
    return EXIT_OK


# -- demo ----------------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> int:
    from watchdog.demo import DemoError, run

    try:
        return run(args.duration_seconds, args.port, Path(args.folder) if args.folder else None)
    except DemoError as exc:
        _error(str(exc))
        return EXIT_FAILURE


# -- report --------------------------------------------------------------------------------------
def cmd_report(args: argparse.Namespace) -> int:
    folder = Path(args.bundle)
    if not (folder / "summary.json").exists() or not (folder / "telemetry.jsonl").exists():
        _error(f"{folder}: not an incident bundle (no summary.json and telemetry.jsonl)")
        return EXIT_FAILURE
    path = report_html.write_for_bundle(folder)
    print(path)
    return EXIT_OK


# -- doctor --------------------------------------------------------------------------------------
EXIT_DOCTOR_WARNING, EXIT_DOCTOR_ERROR = 3, 4


def cmd_doctor(args: argparse.Namespace) -> int:
    from watchdog.detect.doctor import ERROR, WARNING, examine
    from watchdog.export.doctor_text import render as render_doctor
    from watchdog.sample.node_facts import gather
    from watchdog.sample.nvml import read_inventory

    facts = gather(read_inventory)
    discovery = RankDiscovery()
    if args.pid:
        ranks, missing = _describe_pids(discovery, args.pid)
        if missing:
            _error(f"no such process: {', '.join(map(str, missing))}")
            return EXIT_FAILURE
    elif args.all_ranks:
        ranks = discovery.scan()
        if not ranks:
            _error("warning: no running ranks found (RANK/LOCAL_RANK with WORLD_SIZE); node checks only")
    else:
        ranks = []
    groups = [job.ranks for job in group_jobs(ranks)] or [()]
    worst = 0
    for job_ranks in groups:
        findings = examine(facts, job_ranks)
        title = f"doctor: node{' and job ' + job_ranks[0].job_key if job_ranks else ''}"
        if args.json:
            print(json.dumps({"job": job_ranks[0].job_key if job_ranks else None,
                              "findings": [f.to_json() for f in findings]}))
        else:
            print(render_doctor(findings, title))
        if any(f.severity == ERROR for f in findings):
            worst = max(worst, EXIT_DOCTOR_ERROR)
        elif args.strict and any(f.severity == WARNING for f in findings):
            worst = max(worst, EXIT_DOCTOR_WARNING)
    return worst


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
    replay.add_argument("--report", metavar="OUT.html",
                        help="also draw the trace's timeline with its episodes as a self-contained HTML page")
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

    stacks = verbs.add_parser(
        "stacks", help="capture or analyse the training ranks' Python stacks and name the odd one out",
        description="Where is every rank, and which one is different? `dump` captures live stacks with py-spy; "
                    "`analyze` reads saved ones.")
    stack_verbs = stacks.add_subparsers(dest="stacks_verb", metavar="VERB")
    stack_verbs.required = True
    dump = stack_verbs.add_parser(
        "dump", help="capture the ranks' stacks now (py-spy, nonblocking) and name the outliers",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Capture every selected rank's Python stack with py-spy in parallel, watch their CPU and "
                    "I/O for a second, group identical stacks, name the ranks the others wait on, and say "
                    "whether it is a hang or a wait. Needs the same user as the ranks, or root / CAP_SYS_PTRACE.",
        epilog="Examples:\n  stall-watchdog stacks dump --all\n  stall-watchdog stacks dump --gpu 3 --gpu 4 --json\n"
               "  stall-watchdog stacks dump --pid 4711 --pid 4712 --out /tmp/stacks\n")
    chosen = dump.add_mutually_exclusive_group(required=True)
    chosen.add_argument("--pid", type=int, action="append", metavar="PID", help="a process to capture (repeat)")
    chosen.add_argument("--gpu", type=int, action="append", metavar="N",
                        help="the processes NVML lists on GPU N (repeat)")
    chosen.add_argument("--all", action="store_true",
                        help="every GPU process; without NVML, every process with RANK and WORLD_SIZE set")
    dump.add_argument("--json", action="store_true", help="one JSON object per job")
    dump.add_argument("--out", metavar="DIR", help="also write each rank's py-spy JSON and the analysis here")
    dump.add_argument("--config", metavar="FILE", help="YAML configuration (the stacks section)")
    dump.set_defaults(func=cmd_stacks_dump)
    analyse = stack_verbs.add_parser(
        "analyze", help="group saved stack dumps and name the outliers",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Read saved dumps (py-spy --json output, py-spy text as pasted into issues, or a folder "
                    "written by `stacks dump --out`) and print the grouped picture with the outliers.",
        epilog="Examples:\n  stall-watchdog stacks analyze node48.txt\n"
               "  stall-watchdog stacks analyze /tmp/stacks --json\n")
    analyse.add_argument("files", nargs="+", metavar="FILE")
    analyse.add_argument("--json", action="store_true", help="a JSON object: groups, outliers, summary, verdict")
    analyse.set_defaults(func=cmd_stacks_analyze)

    run = verbs.add_parser(
        "run", help="the daemon: sample, detect, capture, alert and serve /metrics until stopped",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Sample every GPU each interval, run the detectors, and when an episode fires capture the "
                    "job's stacks, write an incident bundle and alert. Serves /metrics and /healthz. SIGHUP "
                    "reloads the configuration; SIGTERM stops. Under systemd (Type=notify) it reports readiness "
                    "and pings the watchdog from the loop.",
        epilog="Examples:\n  stall-watchdog run --config /etc/stall-watchdog/config.yaml\n"
               "  stall-watchdog run --config sim.yaml   # with source: {kind: sim, scenario: spin_hang}\n")
    run.add_argument("--config", metavar="FILE", help="YAML configuration (defaults when omitted)")
    run.add_argument("--max-ticks", type=int, metavar="N", help=argparse.SUPPRESS)
    run.set_defaults(func=cmd_run)

    demo = verbs.add_parser(
        "demo", help="see it work: the real daemon on a simulated 8-GPU node with real hung ranks",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start 8 real torch.distributed ranks (gloo, CPU) on a simulated 8-GPU node and run the real "
                    "daemon over them: healthy training, then rank 4 gets stuck in its data loader while the other "
                    "seven wait in all_reduce. Within about a minute it prints the verdict with the culprit rank and "
                    "its stack, the incident bundle, its report and the metrics URL, and keeps serving /metrics "
                    "until Ctrl+C. No GPU and no root needed.",
        epilog="Examples:\n  stall-watchdog demo\n  stall-watchdog demo --duration-seconds 90 --folder ./demo\n")
    demo.add_argument("--duration-seconds", type=float, metavar="S", help="stop by itself after this long")
    demo.add_argument("--port", type=int, default=9944, help="metrics port (another free one if taken)")
    demo.add_argument("--folder", metavar="DIR", help="where the bundles go (default: a new temporary folder)")
    demo.set_defaults(func=cmd_demo)

    rep = verbs.add_parser(
        "report", help="(re)build an incident bundle's report.html",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write BUNDLE/report.html: the per-GPU timeline around the onset with the episode shaded, "
                    "the verdict, the ranks, the grouped stacks with the outliers highlighted, and the doctor's "
                    "findings. Self-contained: open it from disk, no network needed.",
        epilog="Example:\n"
               "  stall-watchdog report /var/lib/stall-watchdog/incidents/20260101T000500Z-waiting-gpu0-1-2\n")
    rep.add_argument("bundle", metavar="BUNDLE")
    rep.set_defaults(func=cmd_report)

    doctor = verbs.add_parser(
        "doctor", help="diagnose the node and the job's NCCL setup (P2P, ACS, IOMMU, IB, interfaces, kernel)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Check the environment faults behind most stalls: P2P and ACS, IOMMU mode, PCIe link width, "
                    "NVLink, InfiniBand ports, the kernel, mixed GPU models; and, for running ranks, "
                    "NCCL_SOCKET_IFNAME, NCCL_IB_DISABLE, NCCL_P2P_DISABLE, CUDA_VISIBLE_DEVICES, timeouts and "
                    "the Flight Recorder settings. Each finding gives the evidence and the fix.",
        epilog="Exit codes: 0 no error (warnings are printed), 4 an error was found, 3 a warning with --strict; "
               "1 runtime failure, 2 usage.\nExamples:\n  stall-watchdog doctor\n"
               "  stall-watchdog doctor --all-ranks --json\n"
               "  stall-watchdog doctor --strict || exit 1   # in a Slurm prolog\n")
    who = doctor.add_mutually_exclusive_group()
    who.add_argument("--pid", type=int, action="append", metavar="PID", help="check this rank's settings (repeat)")
    who.add_argument("--all-ranks", action="store_true", help="check every running rank's settings, per job")
    doctor.add_argument("--json", action="store_true", help="one JSON object per job")
    doctor.add_argument("--strict", action="store_true", help="exit 3 on warnings too")
    doctor.set_defaults(func=cmd_doctor)

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
    except (TraceError, StackFormatError) as exc:
        _error(str(exc))
        return EXIT_FAILURE
    except BrokenPipeError:
        return EXIT_OK  # `| head` closed the pipe
    except KeyboardInterrupt:
        return 130
