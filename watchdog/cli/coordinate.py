"""`coordinate`: the job-wide service (or, with --job, one investigation printed)."""

from __future__ import annotations

import argparse
import json
import signal
import threading

from watchdog import http_client, logfmt, secrets
from watchdog.cli.common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, error, shown
from watchdog.coordinate.nodes import DAEMON_SCRAPE_JOB, NodeAllowList, NodeClient, raise_fd_limit
from watchdog.coordinate.service import Coordinator, CoordinatorError
from watchdog.http_server import Auth, parse_address


def cmd_coordinate(args: argparse.Namespace) -> int:
    logfmt.setup()
    raise_fd_limit()
    try:
        token = secrets.read(args.node_token_file, None, "--node-token")
        if token:
            secrets.one_line_token(token, "--node-token-file")
        callers = secrets.read(args.token_file, None, "--token")
        if callers:
            secrets.one_line_token(callers, "--token-file")
        password = secrets.read(args.basic_auth_password_file, None, "--basic-auth-password")
    except secrets.SecretError as exc:
        error(str(exc))
        return EXIT_USAGE
    if bool(args.basic_auth_user) != bool(password):
        error("--basic-auth-user and --basic-auth-password-file go together")
        return EXIT_USAGE
    if not 0 < args.timeout_seconds <= 3600 or not 0 <= args.cooldown_seconds <= 86400 \
            or not 0 < args.max_per_minute <= 10000:
        error("--timeout-seconds must be in (0, 3600], --cooldown-seconds in [0, 86400] and --max-per-minute "
              "in [1, 10000]")
        return EXIT_USAGE
    try:
        http_client.split(args.prometheus)
    except ValueError as exc:
        error(f"--prometheus: {exc}")
        return EXIT_USAGE
    scrape_job = DAEMON_SCRAPE_JOB if args.scrape_job is None else args.scrape_job
    if not 0 < len(scrape_job) <= 200 or not scrape_job.isprintable():
        error("--scrape-job: a Prometheus job name of 1 to 200 printable characters")
        return EXIT_USAGE
    try:
        allowed = NodeAllowList(args.allow_node or ())
    except ValueError as exc:
        error(f"--allow-node: {exc}")
        return EXIT_USAGE
    client = NodeClient(args.node_scheme, token, args.node_ca_file, args.timeout_seconds, allowed)
    coordinator = Coordinator(args.prometheus, args.out, client, args.cooldown_seconds,
                              auth=Auth(args.basic_auth_user, password, callers), max_per_minute=args.max_per_minute,
                              scrape_job=scrape_job)
    if args.job:
        result = coordinator.investigate(args.job)
        if result.problem is not None:
            error(f"coordinate: {result.problem}")
        if args.json:
            print(json.dumps({**result.to_json(), "bundle": coordinator.latest[args.job].get("bundle")}))
        else:
            # Each line ours, each field escaped: the nodes name the functions, files and hosts in them.
            severity = result.verdict.severity.value if result.verdict.severity else "none"
            lines = [f"{result.job}: {result.verdict.kind} ({severity})", f"  {result.verdict.headline}",
                     f"  {result.verdict.sentence}"]
            lines += [f"  odd: {odd['member']} on {odd['node']} (pid {odd['pid']}, GPU {odd['gpus']}): "
                      f"{odd['activity']} in {odd['where']}" for odd in result.odd]
            print("\n".join(shown(line, one_line=True) for line in lines))
        return EXIT_OK if result.problem is None else EXIT_FAILURE
    try:
        host, port = parse_address(args.listen)
        server = coordinator.serve(host, port)
    except CoordinatorError as exc:
        error(f"--listen {args.listen}: {exc}")
        return EXIT_USAGE
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
