"""`doctor` (the node's and the job's NCCL setup), `report` (a bundle's page) and `check-config`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from watchdog.act.actions import problems as action_problems
from watchdog.act.alerts import build_receiver
from watchdog.boundary import privileges
from watchdog.cli.common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, error, shown
from watchdog.cli.coordinate import NotReady, ready
from watchdog.cli.stacks import describe_pids, proven_jobs
from watchdog.config import Config, load_config
from watchdog.doctor.checks import examine
from watchdog.doctor.facts import gather
from watchdog.doctor.finding import ERROR, WARNING
from watchdog.doctor.text import render as render_doctor
from watchdog.export import report as report_html
from watchdog.export.bundle_files import BundleDamaged
from watchdog.export.server import EndpointError, endpoint_problems
from watchdog.sample.errors import TraceError
from watchdog.sample.nvml import NvmlSource
from watchdog.sample.nvml_inventory import Inventory
from watchdog.sample.ranks import RankDiscovery, RankInfo
from watchdog.service import build, source_for

EXIT_DOCTOR_WARNING, EXIT_DOCTOR_ERROR = 3, 4


def cmd_report(args: argparse.Namespace) -> int:
    if not args.bundle:
        error("report: give the bundle's folder, the one that holds summary.json")
        return EXIT_FAILURE
    folder = Path(args.bundle)
    if not folder.is_dir():
        error(f"{folder}: no such folder" if not folder.exists() else f"{folder}: not a folder (give the bundle's "
              "folder, the one that holds summary.json)")
        return EXIT_FAILURE
    if not os.access(folder, os.R_OK | os.X_OK):
        error(f"{folder}: cannot read the folder: permission denied")
        return EXIT_FAILURE
    if not os.path.lexists(folder / "summary.json"):  # telemetry.jsonl may be absent: a dump's bundle has none
        error(f"{folder}: not an incident bundle (no summary.json in it)")
        return EXIT_FAILURE
    try:
        print(shown(str(report_html.write_for_bundle(folder)), one_line=True))
    except (BundleDamaged, TraceError) as exc:  # each names the file, and the line where it is one
        error(f"{folder}: cannot build the report: {exc}")
        return EXIT_FAILURE
    except OSError as exc:  # writing report.html
        error(f"{folder}: cannot write report.html: {exc.strerror or exc}")
        return EXIT_FAILURE
    except (ValueError, TypeError, AttributeError, KeyError, ArithmeticError) as exc:  # a value the page cannot draw
        error(f"{folder}: cannot build the report: the bundle's files hold values of a kind the daemon never writes "
              f"({type(exc).__name__}: {exc})")
        return EXIT_FAILURE
    return EXIT_OK


def _inventory(config: Config) -> Inventory:
    """NVML's facts through a source opened for the purpose; NvmlUnavailable becomes the doctor's
    'unknown' for the GPU checks (gather keeps the reason)."""
    source = NvmlSource(call_timeout_seconds=config.sample.nvml_call_timeout_seconds)
    source.open()
    try:
        return source.inventory()
    finally:
        source.close()


def cmd_doctor(args: argparse.Namespace) -> int:
    config = load_config(None)
    facts = gather(lambda: _inventory(config))
    discovery = RankDiscovery()
    if args.pid:
        ranks, missing = describe_pids(discovery, args.pid)
        if missing:
            error(f"no such process: {', '.join(map(str, missing))}")
            return EXIT_FAILURE
    elif args.all_ranks:
        ranks = discovery.scan()
        if not ranks:
            error("warning: no running ranks found (RANK/LOCAL_RANK with WORLD_SIZE); node checks only")
    else:
        ranks = []
    jobs: list[tuple[str | None, tuple[RankInfo, ...]]] = [(job.key, job.ranks) for job in proven_jobs(ranks, config)]
    worst = 0
    for name, job_ranks in jobs or [(None, ())]:
        findings = examine(facts, job_ranks)
        title = f"doctor: node{' and job ' + name if name else ''}"
        if args.json:
            print(json.dumps({"job": name, "findings": [f.to_json() for f in findings]}))
        else:
            print(shown(render_doctor(findings, title)))
        if any(f.severity == ERROR for f in findings):
            worst = max(worst, EXIT_DOCTOR_ERROR)
        elif args.strict and any(f.severity == WARNING for f in findings):
            worst = max(worst, EXIT_DOCTOR_WARNING)
    return worst


def cmd_check_config(args: argparse.Namespace) -> int:
    """The file, then what `run` builds from it (watchdog/service.py's build, nothing started: no GPU opened,
    no port bound): every secret file and variable read and checked as `run` reads it, the endpoint's
    certificate and key loaded, every receiver built (URLs checked), every configured action's program and
    token found (act/actions.py problems, which `run` logs), and the coordinator's section as `coordinate`
    builds it."""
    config = load_config(args.file)
    problems = []
    try:
        service = build(config, source_for(config), args.file, discovery=RankDiscovery())
    except (ValueError, EndpointError) as exc:  # run stops at the first: each part is tried on its own, to list all
        problems.append(str(exc))
        for receiver in config.alerts.receivers:
            try:
                build_receiver(receiver)
            except ValueError as bad:
                problems.append(f"alerts: {bad}")
        problems += endpoint_problems(config.export, config.dump)
        problems = list(dict.fromkeys(problems))
    else:
        service.close(0)
    problems += action_problems(config.actions)  # what the responder holds as unready
    try:  # the coordinator's section, as `coordinate --config` would build it
        ready(config.coordinator)
    except NotReady as exc:
        problems.append(str(exc))
    for problem in problems:
        error(f"{args.file}: {problem}")
    for short in privileges.shortfalls(stacks=True, terminate=False):  # said, not refused: a same-user run is fine
        print(f"{args.file}: warning: {short.text()}", file=sys.stderr)
    if problems:
        return EXIT_USAGE
    print(f"{args.file}: ok")
    return EXIT_OK
