"""The command line: one small function per verb (or verb family) adds its parser, help and examples."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import TypeAlias

from watchdog import VERSION_LINE
from watchdog.export.series import SERIES_MODES
from watchdog.sample import sim
from watchdog.sample.replay import TRACE_SUFFIXES

_SCENARIO_HELP = "\n".join(f"  sim:{name:<16} {s.description}" for name, s in sim.SCENARIOS.items())
Verbs: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _command(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """A verb's function, imported when the verb runs: `replay` starts without loading the daemon."""
    def run(args: argparse.Namespace) -> int:
        function: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(f"watchdog.cli.{module}"), name)
        return function(args)
    return run


def _verb(verbs: Verbs, name: str, help: str, description: str, epilog: str | None = None
          ) -> argparse.ArgumentParser:
    """A verb's parser: its help line, description and examples, laid out as written."""
    return verbs.add_parser(name, help=help, description=description, epilog=epilog,
                            formatter_class=argparse.RawDescriptionHelpFormatter)


def _add_replay(verbs: Verbs) -> None:
    replay = _verb(verbs, "replay", help="run the detectors over a recorded trace at full speed",
        description="Run the stall detectors over a trace and print every episode transition "
                    "(fired, escalated, resolved).\n\nTRACE is one of:\n"
                    "  an nvidia-smi CSV log  nvidia-smi --query-gpu=timestamp,index,utilization.gpu,"
                    "power.draw,... --format=csv -l 1\n"
                    "  a JSON Lines recording written by `stall-watchdog record`\n"
                    f"  a built-in scenario:\n{_SCENARIO_HELP}",
        epilog="Examples:\n  stall-watchdog replay sim:odd_rank\n"
               "  stall-watchdog replay gpus.csv --json | jq .summary\n"
               "  stall-watchdog replay gpus.csv --csv-fields timestamp,index,utilization.gpu,power.draw\n"
               "  stall-watchdog replay logs/node*.csv        # one timeline per file, every core busy\n",
    )
    replay.add_argument("trace", metavar="TRACE", nargs="+",
                        help="CSV log, JSON Lines recording, sim:SCENARIO, or a folder of logs ("
                             + ", ".join(TRACE_SUFFIXES) + "); several are replayed side by side")
    replay.add_argument("--jobs", type=int, metavar="N",
                        help="processes to use (default: one per core): several traces are replayed side by "
                             "side; one trace is read by a second process while the first detects (1: one "
                             "process)")
    replay.add_argument("--config", metavar="FILE", help="YAML configuration (defaults when omitted)")
    replay.add_argument("--json", action="store_true",
                        help="one JSON object per episode event instead of a readable timeline")
    replay.add_argument("--lenient", action="store_true",
                        help="skip malformed lines (counted and reported) instead of stopping at the first")
    replay.add_argument("--csv-fields", metavar="LIST",
                        help="the --query-gpu list of a CSV log written with noheader")
    replay.add_argument("--report", metavar="OUT.html",
                        help="also draw the trace's timeline with its episodes as a self-contained HTML page")
    replay.set_defaults(func=_command("replay", "cmd_replay"))


def _add_record(verbs: Verbs) -> None:
    record = _verb(verbs, "record", help="record the live GPUs (NVML) to a JSON Lines trace",
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
    record.set_defaults(func=_command("trace", "cmd_record"))


def _add_stacks(verbs: Verbs) -> None:
    stacks = _verb(
        verbs, "stacks", help="capture or analyse the training ranks' Python stacks and name the odd one out",
        description="Where is every rank, and which one is different? `dump` captures live stacks with py-spy; "
                    "`analyze` reads saved ones.")
    stack_verbs = stacks.add_subparsers(dest="stacks_verb", metavar="VERB")
    stack_verbs.required = True
    dump = _verb(stack_verbs, "dump", help="capture the ranks' stacks now (py-spy, nonblocking) and name the outliers",
        description="Capture every selected rank's Python stack with py-spy in parallel, watch their CPU and "
                    "I/O for a second, group identical stacks, name the ranks the others wait on, and say "
                    "whether it is a hang or a wait. Needs the same user as the ranks, or root / CAP_SYS_PTRACE.",
        epilog="Examples:\n  stall-watchdog stacks dump --all\n  stall-watchdog stacks dump --all --job run:llm-42\n"
               "  stall-watchdog stacks dump --gpu 3 --gpu 4 --json\n"
               "  stall-watchdog stacks dump --pid 4711 --pid 4712 --out /tmp/stacks\n")
    chosen = dump.add_mutually_exclusive_group(required=True)
    chosen.add_argument("--pid", type=int, action="append", metavar="PID", help="a process to capture (repeat)")
    chosen.add_argument("--gpu", type=int, action="append", metavar="N",
                        help="the processes NVML lists on GPU N (repeat)")
    chosen.add_argument("--all", action="store_true",
                        help="every GPU process; without NVML, every process with RANK and WORLD_SIZE set")
    dump.add_argument("--job", action="append", metavar="JOB",
                      help="only the ranks of this training job (as `training_job` names it: run:ID, slurm:ID, "
                           "rdzv:HOST:PORT; repeat); the others on the machine are not touched")
    dump.add_argument("--json", action="store_true", help="one JSON object per job")
    dump.add_argument("--out", metavar="DIR", help="also write each rank's py-spy JSON and the analysis here")
    dump.add_argument("--config", metavar="FILE", help="YAML configuration (the stacks section)")
    dump.set_defaults(func=_command("stacks", "cmd_stacks_dump"))
    analyse = _verb(stack_verbs, "analyze", help="group saved stack dumps and name the outliers",
        description="Read saved dumps (py-spy --json output, py-spy text as pasted into issues, or a folder "
                    "written by `stacks dump --out`) and print the grouped picture with the outliers. The same "
                    "reading as `stall-watchdog analyze`, which takes every other kind of evidence too.",
        epilog="Examples:\n  stall-watchdog stacks analyze node48.txt\n"
               "  stall-watchdog stacks analyze /tmp/stacks --json\n")
    analyse.add_argument("files", nargs="+", metavar="FILE")
    analyse.add_argument("--json", action="store_true",
                         help="JSON Lines: one JSON object per job (groups, outliers, summary, verdict) per line")
    analyse.set_defaults(func=_command("analyze", "cmd_stacks_analyze"))


def _add_run(verbs: Verbs) -> None:
    run = _verb(verbs, "run", help="the daemon: sample, detect, capture, alert and serve /metrics until stopped",
        description="Sample every GPU each interval, run the detectors, and when an episode fires capture the "
                    "job's stacks, write an incident bundle and alert. Serves /metrics and /healthz. SIGHUP "
                    "reloads the configuration; SIGTERM stops. Under systemd (Type=notify) it reports readiness "
                    "and pings the watchdog from the loop.",
        epilog="Examples:\n  stall-watchdog run --config /etc/stall-watchdog/config.yaml\n"
               "  stall-watchdog run --config sim.yaml   # with source: {kind: sim, scenario: spin_hang}\n")
    run.add_argument("--config", metavar="FILE", help="YAML configuration (defaults when omitted)")
    run.add_argument("--max-ticks", type=int, metavar="N", help=argparse.SUPPRESS)
    run.set_defaults(func=_command("service", "cmd_run"))


def _add_demo(verbs: Verbs) -> None:
    demo = _verb(verbs, "demo", help="see it work: the real daemon on a simulated 8-GPU node with real hung ranks",
        description="Start 8 real torch.distributed ranks (gloo, CPU) on a simulated 8-GPU node and run the real "
                    "daemon over them: healthy training, then rank 4 gets stuck in its data loader while the other "
                    "seven wait in all_reduce. Within about a minute it prints the verdict with the culprit rank and "
                    "its stack, the incident bundle, its report and the metrics URL, and keeps serving /metrics "
                    "until Ctrl+C. No GPU and no root needed.",
        epilog="Examples:\n  stall-watchdog demo\n  stall-watchdog demo --duration-seconds 90 --folder ./demo\n")
    demo.add_argument("--duration-seconds", type=float, metavar="S", help="stop by itself after this long")
    demo.add_argument("--port", type=int, default=9944, help="metrics port (another free one if taken)")
    demo.add_argument("--folder", metavar="DIR", help="where the bundles go (default: a new temporary folder)")
    demo.add_argument("--series", choices=SERIES_MODES, default=SERIES_MODES[0],
                      help="which series /metrics serves, as export.series in the configuration (default: standard)")
    demo.set_defaults(func=_command("service", "cmd_demo"))


def _add_report(verbs: Verbs) -> None:
    rep = _verb(verbs, "report", help="(re)build an incident bundle's report.html",
        description="Write BUNDLE/report.html: the per-GPU timeline around the onset with the episode shaded, "
                    "the verdict, the ranks, the grouped stacks with the outliers highlighted, and the doctor's "
                    "findings. Self-contained: open it from disk, no network needed. The bundle's files are read "
                    "as untrusted: regular files only, never through a link, each JSON file at most 16 MiB; a "
                    "telemetry of any length is drawn from an even stride of at most 9,600 of its snapshots. A "
                    "damaged file is an error naming it (exit 1).",
        epilog="Example:\n"
               "  stall-watchdog report /var/lib/stall-watchdog/incidents/20260101T000500Z-waiting-gpu0-1-2\n")
    rep.add_argument("bundle", metavar="BUNDLE", help="the bundle's folder: summary.json, and telemetry.jsonl, "
                     "stacks.json and doctor.json where it holds them (a dump's bundle has no telemetry)")
    rep.set_defaults(func=_command("node", "cmd_report"))


def _add_doctor(verbs: Verbs) -> None:
    doctor = _verb(
        verbs, "doctor", help="diagnose the node and the job's NCCL setup (P2P, ACS, IOMMU, IB, interfaces, kernel)",
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
    doctor.set_defaults(func=_command("node", "cmd_doctor"))


def _add_check_config(verbs: Verbs) -> None:
    check = _verb(verbs, "check-config", help="validate a configuration file",
        description="Validate a YAML configuration and report every problem with its key path.",
        epilog="Example:\n  stall-watchdog check-config /etc/stall-watchdog/config.yaml",
    )
    check.add_argument("file", metavar="FILE")
    check.set_defaults(func=_command("node", "cmd_check_config"))


def _add_analyze(verbs: Verbs) -> None:
    analyse = _verb(verbs, "analyze", help="read any saved hang evidence and name the odd ranks",
        description="Read hang evidence, recognised by content, and print one picture (the contract of "
                    "`stacks analyze`: groups, outliers, summary, verdict):\n"
                    "  py-spy dumps (text or --json), `stacks dump --out` folders\n"
                    "  incident and dump bundles (their stacks, Flight Recorder dumps, RAS finding)\n"
                    "  PyTorch Flight Recorder dumps (files or a folder of them)\n"
                    "  ncclras reports, JSON or text, whole or an excerpt, one or several (two taken seconds\n"
                    "    apart tell stuck from slow), and the RAS monitor's PEER_DEAD events\n"
                    "  PyTorch NCCL watchdog timeout logs (one or many ranks, hard-wrapped pastes too)\n"
                    "  torchfrtrace / fr_trace output (the Flight Recorder analyzer's text)\n"
                    "  job bundles written by `stall-watchdog coordinate`\n"
                    "A text may hold several kinds (a log, then a RAS report). NO_STALL only on positive evidence "
                    "of progress; UNKNOWN says what was read and what it cannot tell.",
        epilog="Examples:\n  stall-watchdog analyze /var/lib/stall-watchdog/incidents/20261122T101500Z-dump-gpu0-1\n"
               "  stall-watchdog analyze /tmp/nccl_trace_rank_* --json\n"
               "  stall-watchdog analyze ras-1.json ras-2.json\n"
               "  xclip -o | stall-watchdog analyze -      # a paste, on standard input\n")
    analyse.add_argument("paths", nargs="+", metavar="PATH")
    analyse.add_argument("--json", action="store_true",
                         help="JSON Lines: one JSON object per picture (per job) on its own line")
    analyse.set_defaults(func=_command("analyze", "cmd_analyze"))


def _add_coordinate(verbs: Verbs) -> None:
    coord = _verb(verbs, "coordinate", help="the job-wide view: Alertmanager job alerts in, one job verdict out",
        description="Serve POST /v1/alerts for Alertmanager's job-level alerts (StallWatchdogJobCollectiveHang, "
                    "StallWatchdogJobCulpritNode, routed with group_by: [training_job]) and for the daemons' own "
                    "pages (an alerts receiver of type coordinator). For each job: find its nodes (Slurm's, with "
                    "--slurm-instance, where the page names its Slurm job; Kubernetes', with --kubernetes-api, "
                    "where it names a pod of it; else the daemons Prometheus says export its ranks), POST "
                    "/v1/dump to all of them at once, merge the "
                    "answers into one job verdict (the odd rank with its node, pid, GPU and activity) and write "
                    "a job bundle with report.html. --job investigates one job once and prints the verdict.",
        epilog="Examples:\n  stall-watchdog coordinate --prometheus http://prometheus:9090 --listen 0.0.0.0:9945 "
               "--token-file /etc/stall-watchdog/coordinator-token --node-token-file /etc/stall-watchdog/dump-token "
               "--out /var/lib/stall-watchdog/jobs\n"
               "  stall-watchdog coordinate --prometheus http://127.0.0.1:9090 --job run:llm-42 --json\n"
               "  stall-watchdog coordinate --slurm-instance '{node}:9944' --job run:llm-42 --slurm-job-id 4242\n"
               "  stall-watchdog coordinate --config coordinator.yaml --kubernetes-api https://kubernetes.default.svc "
               "--job run:llm-42 --pod training/llm-worker-0\n")
    coord.add_argument("--config", metavar="FILE",
                       help="read the `coordinator:` section of this configuration file (the flags below override "
                            "its keys; `stall-watchdog check-config FILE` checks it)")
    coord.add_argument("--prometheus", metavar="URL",
                       help="Prometheus base URL (its HTTP API); here or as coordinator.prometheus_url, unless "
                            "--slurm-instance is given")
    coord.add_argument("--listen", metavar="HOST:PORT", help="where to serve (default 127.0.0.1:9945)")
    coord.add_argument("--out", metavar="DIR", help="job bundles go here (default /var/lib/stall-watchdog/jobs)")
    coord.add_argument("--node-scheme", choices=("http", "https"),
                       help="how to reach the daemons' endpoints (their export.listen_address; default http)")
    coord.add_argument("--node-token-file", metavar="FILE", help="bearer token for POST /v1/dump (dump.token_file)")
    coord.add_argument("--node-ca-file", metavar="FILE", help="CA bundle to trust for --node-scheme https")
    coord.add_argument("--scrape-job", metavar="NAME",
                       help="the daemons' Prometheus scrape job (its `job` label; default stall-watchdog, as "
                            "deploy/ names it): only its instances are asked, and given the node token")
    coord.add_argument("--allow-node", action="append", metavar="HOST|HOST:PORT|NETWORK",
                       help="ask only these nodes (repeat): a host, a host:port or an IP network such as "
                            "10.0.0.0/8 (default: every instance of --scrape-job)")
    coord.add_argument("--token-file", metavar="FILE",
                       help="bearer token callers (Alertmanager's http_config.authorization) must present; "
                            "this or --basic-auth-user is required with --node-token-file, and off loopback")
    coord.add_argument("--basic-auth-user", metavar="USER", help="basic auth for callers (with the next option)")
    coord.add_argument("--basic-auth-password-file", metavar="FILE", help="the basic auth password")
    coord.add_argument("--max-per-minute", type=int, metavar="N",
                       help="investigations started a minute at most (default 30, at most 10000); more are "
                            "answered 429")
    coord.add_argument("--timeout-seconds", type=float, metavar="S",
                       help="how long one node may take to answer, the whole exchange (default 60, at most 3600)")
    coord.add_argument("--cooldown-seconds", type=float, metavar="S",
                       help="a job investigated this recently is not investigated again (default 120, at most "
                            "86400)")
    coord.add_argument("--job", metavar="TRAINING_JOB", help="investigate this job once, print, and exit")
    coord.add_argument("--slurm-instance", metavar="TEMPLATE",
                       help="ask Slurm where a job runs when its page names its Slurm job, and reach each node's "
                            "daemon at this host:port, {node} being Slurm's node name (e.g. '{node}:9944')")
    coord.add_argument("--slurm-conf", metavar="FILE", help="the slurm.conf squeue and scontrol read (SLURM_CONF)")
    coord.add_argument("--kubernetes-api", metavar="URL",
                       help="ask this Kubernetes API server for a job's nodes when its page names a pod of it (in a "
                            "pod: https://kubernetes.default.svc; the rest in coordinator.kubernetes of --config)")
    coord.add_argument("--pod", metavar="NAMESPACE/POD", help="with --job: a pod the job runs in (then Kubernetes "
                       "is asked for its nodes, with --kubernetes-api)")
    coord.add_argument("--slurm-job-id", metavar="ID", help="with --job: the Slurm job it runs as (then Slurm is "
                       "asked for its nodes, with --slurm-instance)")
    coord.add_argument("--json", action="store_true", help="with --job: the job verdict as JSON")
    coord.set_defaults(func=_command("coordinate", "cmd_coordinate"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stall-watchdog",
        description="Catch stalled multi-GPU training jobs: busy-spin hangs (100% util at idle power), "
                    "zero-util hangs, ranks waiting on one odd GPU, chronic under-use; and before a wedge, the "
                    "straggler rank and the GPU that reports hardware faults.",
        epilog="Exit codes: 0 ok, 1 runtime failure, 2 usage or configuration error.",
    )
    parser.add_argument("--version", action="version", version=VERSION_LINE)
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    verbs.required = True
    _add_replay(verbs)
    _add_record(verbs)
    _add_stacks(verbs)
    _add_analyze(verbs)
    _add_run(verbs)
    _add_demo(verbs)
    _add_report(verbs)
    _add_doctor(verbs)
    _add_check_config(verbs)
    _add_coordinate(verbs)
    return parser
