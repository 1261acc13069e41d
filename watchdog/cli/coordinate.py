"""`coordinate`: the job-wide service (or, with --job, one investigation printed)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading

from watchdog.boundary import http_client, secrets
from watchdog.boundary.http_server import Auth, parse_address
from watchdog.boundary.webhook import SchedulerIds
from watchdog.cli.common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, error, shown
from watchdog.config import ConfigError, CoordinatorConfig, load_config, parse_config
from watchdog.coordinate.nodes import NodeAllowList, NodeClient, raise_fd_limit
from watchdog.coordinate.scheduler import KubernetesNodes, SlurmNodes
from watchdog.coordinate.service import Coordinator, CoordinatorError
from watchdog.plumbing import logfmt
from watchdog.plumbing.signals import SignalEvents
from watchdog.vocabulary.model import K8S_NAME, SLURM_JOB_ID

# Each flag and the key of the `coordinator:` section it overrides.
_FLAGS = {"prometheus": "prometheus_url", "listen": "listen_address", "out": "out_directory",
          "node_scheme": "node_scheme", "node_token_file": "node_token_file", "node_ca_file": "node_ca_file",
          "scrape_job": "scrape_job", "allow_node": "allow_nodes", "token_file": "token_file",
          "basic_auth_user": "basic_auth_user", "basic_auth_password_file": "basic_auth_password_file",
          "max_per_minute": "max_per_minute", "timeout_seconds": "timeout_seconds",
          "cooldown_seconds": "cooldown_seconds", "slurm_instance": "slurm_instance", "slurm_conf": "slurm_conf"}


def settings(args: argparse.Namespace) -> CoordinatorConfig:
    """The coordinator's settings: the `coordinator:` section of --config (else its defaults), each flag given
    in its place, all checked by the section's own bounds (ConfigError names the key and the flag)."""
    base = load_config(args.config).coordinator if args.config else CoordinatorConfig()
    given = {key: getattr(args, flag) for flag, key in _FLAGS.items() if getattr(args, flag) is not None}
    if args.kubernetes_api is not None:
        given["kubernetes"] = {**base.kubernetes.model_dump(), "api_url": args.kubernetes_api}
        flags_of = {**_FLAGS, "kubernetes_api": "kubernetes.api_url"}
    else:
        flags_of = _FLAGS
    try:
        return parse_config({"coordinator": {**base.model_dump(), **given}}, "the flags").coordinator
    except ConfigError as exc:
        flags = {key: flag for flag, key in flags_of.items() if key.split(".")[0] in given}
        raise ConfigError(exc.source, [_with_flag(line, flags) for line in exc.problems]) from None


def _with_flag(problem: str, flags: dict[str, str]) -> str:
    for key, flag in flags.items():
        if f"coordinator.{key}:" in problem:
            return problem + f" (--{flag.replace('_', '-')})"
    return problem


class NotReady(ValueError):
    """What keeps the coordinator from starting, naming the key and its flag."""


def ready(cfg: CoordinatorConfig) -> tuple[NodeClient, Auth, KubernetesNodes | None]:
    """What `coordinate` builds before it serves, every secret read and every value parsed as it will be used;
    `check-config` runs it too. NotReady names the key (and its flag) at fault."""
    def secret(path: str | None, key: str, flag: str) -> str | None:
        return secrets.read_file(path, f"coordinator.{key} ({flag})") if path else None

    try:
        token = secret(cfg.node_token_file, "node_token_file", "--node-token-file")
        if token:
            secrets.one_line_token(token, "coordinator.node_token_file (--node-token-file)")
        callers = secret(cfg.token_file, "token_file", "--token-file")
        if callers:
            secrets.one_line_token(callers, "coordinator.token_file (--token-file)")
        password = secret(cfg.basic_auth_password_file, "basic_auth_password_file", "--basic-auth-password-file")
        k = cfg.kubernetes
        kubernetes = KubernetesNodes(k.api_url, k.token_file, k.ca_file, k.daemon_namespace, k.daemon_selector,
                                     k.daemon_port, tuple(k.job_labels)) if k.api_url else None
        if kubernetes is not None:  # read here to refuse a start without it; again at each placement (renewed)
            kubernetes.read_token()
    except secrets.SecretError as exc:
        raise NotReady(str(exc)) from None
    for path, key in ((cfg.slurm_conf, "coordinator.slurm_conf (--slurm-conf)"),
                      (cfg.kubernetes.ca_file if cfg.kubernetes.api_url else None, "coordinator.kubernetes.ca_file")):
        if path is not None and not os.path.isfile(path):
            raise NotReady(f"{key}: {path} is not a file")
    if cfg.prometheus_url is not None:
        try:
            http_client.split(cfg.prometheus_url)
        except ValueError as exc:
            raise NotReady(f"coordinator.prometheus_url (--prometheus): {exc}") from None
    try:
        allowed = NodeAllowList(cfg.allow_nodes)
    except ValueError as exc:
        raise NotReady(f"coordinator.allow_nodes (--allow-node): {exc}") from None
    try:
        parse_address(cfg.listen_address)
    except ValueError as exc:
        raise NotReady(f"coordinator.listen_address (--listen): {exc}") from None
    client = NodeClient(cfg.node_scheme, token, cfg.node_ca_file, cfg.timeout_seconds, allowed)
    return client, Auth(cfg.basic_auth_user, password, callers), kubernetes


def cmd_coordinate(args: argparse.Namespace) -> int:
    logfmt.setup()
    raise_fd_limit()
    if args.job is not None and not args.job.strip():
        error("--job: give the training job to investigate (it is empty)")
        return EXIT_USAGE
    if args.json and args.job is None:
        error("--json goes with --job (the service logs its verdicts and serves them on GET /v1/jobs)")
        return EXIT_USAGE
    if args.slurm_job_id is not None and (args.job is None or not SLURM_JOB_ID.match(args.slurm_job_id)):
        error("--slurm-job-id goes with --job and is a Slurm job id (digits): the Slurm job the training job runs as")
        return EXIT_USAGE
    namespace, _, pod = (args.pod or "").partition("/")
    if args.pod is not None and (args.job is None or not (K8S_NAME.match(namespace) and K8S_NAME.match(pod))):
        error("--pod goes with --job and is NAMESPACE/POD: a pod the training job runs in")
        return EXIT_USAGE
    try:
        cfg = settings(args)
        client, auth, kubernetes = ready(cfg)
    except (ConfigError, NotReady) as exc:
        error(str(exc))
        return EXIT_USAGE
    if cfg.prometheus_url is None and cfg.slurm_instance is None and kubernetes is None:
        error("nothing to ask where a job runs: give --prometheus URL, --slurm-instance '{node}:9944' and/or "
              "--kubernetes-api URL (or coordinator.prometheus_url, slurm_instance, kubernetes.api_url in --config)")
        return EXIT_USAGE
    if args.slurm_job_id is not None and cfg.slurm_instance is None:
        error("--slurm-job-id is asked of Slurm only with --slurm-instance '{node}:9944' (or "
              "coordinator.slurm_instance): give it, or leave the id out")
        return EXIT_USAGE
    if args.pod is not None and kubernetes is None:
        error("--pod is asked of Kubernetes only with --kubernetes-api URL (or coordinator.kubernetes.api_url): give "
              "it, or leave the pod out")
        return EXIT_USAGE
    slurm = SlurmNodes(cfg.slurm_instance, cfg.slurm_conf) if cfg.slurm_instance else None
    coordinator = Coordinator(cfg.prometheus_url, cfg.out_directory, client, cfg.cooldown_seconds, auth=auth,
                              max_per_minute=cfg.max_per_minute, scrape_job=cfg.scrape_job, slurm=slurm,
                              kubernetes=kubernetes)
    if args.job is not None:
        result = coordinator.investigate(args.job, SchedulerIds(args.slurm_job_id, namespace or None, pod or None))
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
        host, port = parse_address(cfg.listen_address)
        server = coordinator.serve(host, port)
    except CoordinatorError as exc:
        error(f"--listen {cfg.listen_address}: {exc}")
        return EXIT_USAGE
    except (OSError, ValueError) as exc:
        error(f"--listen {cfg.listen_address}: cannot listen: {getattr(exc, 'strerror', None) or exc}")
        return EXIT_USAGE
    stop = threading.Event()
    with SignalEvents({signal.SIGTERM: stop, signal.SIGINT: stop}, restore=False):  # the command ends with it
        thread = threading.Thread(target=server.serve_forever, name="coordinate-http", daemon=True)
        thread.start()
        logfmt.event("coordinating", listen=f"{host}:{server.server_address[1]}", prometheus=cfg.prometheus_url,
                     slurm=cfg.slurm_instance, kubernetes=cfg.kubernetes.api_url, out=cfg.out_directory)
        stop.wait()
        server.shutdown()
        server.server_close()
        running, dropped = coordinator.stop()
        logfmt.event("stopping", investigations_finishing=running, investigations_dropped=dropped)
    return EXIT_OK
