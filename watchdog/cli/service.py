"""`run` (the daemon) and `demo` (the daemon over real hung ranks on a simulated node)."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

from watchdog import logfmt
from watchdog.cli.common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, error
from watchdog.config import load_config
from watchdog.daemon import build, source_for
from watchdog.export.server import Endpoint, EndpointError
from watchdog.model import counted
from watchdog.sample.nvml import NvmlUnavailable


def cmd_run(args: argparse.Namespace) -> int:
    logfmt.setup()
    config = load_config(args.config)
    source = source_for(config)
    try:
        source.open()
    except NvmlUnavailable as exc:
        error(f"{exc}\nNo NVIDIA GPU here? To see the watchdog work without one, set `source: {{kind: sim, "
              "scenario: spin_hang}` in the config, or run `stall-watchdog replay sim:odd_rank`.")
        return EXIT_FAILURE
    try:
        daemon = build(config, source, config_path=args.config)
    except ValueError as exc:  # a receiver's secret that cannot be read
        error(str(exc))
        return EXIT_USAGE
    try:
        endpoint = Endpoint(config.export, daemon.exposition, daemon.healthy,
                            daemon.dump_request if config.dump.enabled else None, config.dump)
    except EndpointError as exc:
        error(str(exc))
        return EXIT_FAILURE
    signal.signal(signal.SIGTERM, lambda *_: daemon.stop_requested.set())
    signal.signal(signal.SIGINT, lambda *_: daemon.stop_requested.set())
    signal.signal(signal.SIGHUP, lambda *_: daemon.reload_requested.set())
    endpoint.start()

    def ready() -> None:
        status = f"watching {counted(source.gpu_count, 'GPU')} ({config.source.kind}); metrics on {endpoint.url}"
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


def cmd_demo(args: argparse.Namespace) -> int:
    from watchdog.demo import DemoError, run

    try:
        return run(args.duration_seconds, args.port, Path(args.folder) if args.folder else None)
    except DemoError as exc:
        error(str(exc))
        return EXIT_FAILURE
