"""`run` (the daemon) and `demo` (the daemon over real hung ranks on a simulated node)."""

from __future__ import annotations

import argparse
from pathlib import Path

from watchdog.cli.common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, error
from watchdog.config import load_config
from watchdog.export.server import EndpointError
from watchdog.plumbing import logfmt
from watchdog.sample.nvml import NvmlUnavailable
from watchdog.service import build, source_for


def cmd_run(args: argparse.Namespace) -> int:
    logfmt.setup()
    config = load_config(args.config)
    source = source_for(config)
    try:  # every part built (secrets and certificates read) before the GPUs are opened: a configuration error first
        service = build(config, source, config_path=args.config)
    except (ValueError, EndpointError) as exc:  # a secret, a certificate: the configuration (check-config says it too)
        error(str(exc))
        return EXIT_USAGE
    try:
        source.open()
    except NvmlUnavailable as exc:
        service.close(timeout=1.0)
        error(f"{exc}\nNo NVIDIA GPU here? To see the watchdog work without one, set `source: {{kind: sim, "
              "scenario: spin_hang}` in the config, or run `stall-watchdog replay sim:odd_rank`.")
        return EXIT_FAILURE
    try:
        service.serve(max_ticks=args.max_ticks)
    except EndpointError as exc:  # the address cannot be had
        error(str(exc))
        return EXIT_FAILURE
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from watchdog.demo import DemoError, run

    try:
        return run(args.duration_seconds, args.port, Path(args.folder) if args.folder else None, series=args.series)
    except DemoError as exc:
        error(str(exc))
        return EXIT_FAILURE
