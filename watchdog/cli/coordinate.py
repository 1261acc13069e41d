"""`coordinate`: the job-wide service (or, with --job, one investigation printed)."""

from __future__ import annotations

import argparse
import json
import signal
import threading
from pathlib import Path

from watchdog import logfmt
from watchdog.cli.common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, error
from watchdog.coordinate.nodes import NodeClient
from watchdog.coordinate.service import Coordinator
from watchdog.export.server import parse_address


def cmd_coordinate(args: argparse.Namespace) -> int:
    token = None
    if args.node_token_file:
        try:
            token = Path(args.node_token_file).read_text().strip()
        except OSError as exc:
            error(f"--node-token-file: cannot read: {exc.strerror or exc}")
            return EXIT_USAGE
    if not 0 < args.timeout_seconds <= 3600 or not 0 <= args.cooldown_seconds <= 86400:
        error("--timeout-seconds must be in (0, 3600] and --cooldown-seconds in [0, 86400]")
        return EXIT_USAGE
    client = NodeClient(args.node_scheme, token, args.node_ca_file, args.timeout_seconds)
    coordinator = Coordinator(args.prometheus, args.out, client, args.cooldown_seconds)
    if args.job:
        result = coordinator.investigate(args.job)
        if result.problem is not None:
            error(f"coordinate: {result.problem}")
        if args.json:
            print(json.dumps({**result.to_json(), "bundle": coordinator.latest[args.job].get("bundle")}))
        else:
            severity = result.verdict.severity.value if result.verdict.severity else "none"
            print(f"{result.job}: {result.verdict.kind} ({severity})\n  {result.verdict.headline}\n"
                  f"  {result.verdict.sentence}")
            for odd in result.odd:
                print(f"  odd: {odd['member']} on {odd['node']} (pid {odd['pid']}, GPU {odd['gpus']}): "
                      f"{odd['activity']} in {odd['where']}")
        return EXIT_OK if result.problem is None else EXIT_FAILURE
    try:
        host, port = parse_address(args.listen)
        server = coordinator.serve(host, port)
    except (OSError, ValueError) as exc:
        error(f"--listen {args.listen}: cannot listen: {getattr(exc, 'strerror', None) or exc}")
        return EXIT_USAGE
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, name="coordinate-http", daemon=True)
    thread.start()
    logfmt.event("coordinating", listen=f"{host}:{server.server_address[1]}", prometheus=args.prometheus,
                 out=args.out)
    stop.wait()
    server.shutdown()
    server.server_close()
    return EXIT_OK
