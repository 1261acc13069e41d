"""`stall-watchdog demo`: the real daemon on a simulated 8-GPU node whose ranks are real Python
processes. Healthy training, then rank 4 gets stuck in its data loader while the other seven wait in
all_reduce. The same loop, detectors, py-spy captures, /metrics and incident bundle as in production;
only the GPU readings are simulated (there is no GPU here)."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from watchdog.config import parse_config
from watchdog.daemon import Daemon
from watchdog.export.server import EndpointError
from watchdog.plumbing import logfmt
from watchdog.plumbing.signals import SignalEvents, die_with_parent
from watchdog.service import build

RANKS = 8
ODD_RANK = 4  # the scenario's odd GPU
HANG_AFTER = 20.0
OFFSET = 300 - HANG_AFTER  # sim.SCENARIOS["odd_rank"] hangs at t=300 s


class DemoError(Exception):
    """The demo cannot run here; the message says what to do."""


def _free_port(preferred: int) -> int:
    for port in (preferred, 0):
        with socket.socket() as s:
            # as the endpoint binds (http.server reuses the address): a port a stopped demo left in TIME_WAIT is free
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise DemoError("no free port on 127.0.0.1")


def _ptrace_note() -> str | None:
    """py-spy reads the ranks' memory; say so up front when the kernel will not let it."""
    if os.geteuid() == 0:
        return None
    try:
        scope = Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip()
    except OSError:
        return None
    if scope != "0":
        return (f"kernel.yama.ptrace_scope is {scope}: py-spy may not read the ranks' stacks. The demo goes on; "
                "for stacks run it with sudo, or `sudo sysctl kernel.yama.ptrace_scope=0`.")
    return None


def start_ranks(folder: Path) -> list[subprocess.Popen[bytes]]:
    if importlib.util.find_spec("torch") is None:  # not imported here: importing torch is slow and noisy
        raise DemoError("the demo runs a real torch.distributed job on the CPU: install torch "
                        "(`pip install 'stall-watchdog[demo]'`, or `make run` which does)")
    port = _free_port(0)
    log = (folder / "ranks.log").open("wb")
    ranks = []
    for rank in range(RANKS):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(RANKS), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(RANKS), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TORCHELASTIC_RUN_ID": "demo", "ODD_RANK": str(ODD_RANK), "HANG_AFTER_SECONDS": str(HANG_AFTER),
               "OMP_NUM_THREADS": "1"}
        # A session of their own: Ctrl+C reaches the demo, which stops them, instead of eight tracebacks.
        # And killed by the kernel if the demo dies without stopping them (kill -9): PR_SET_PDEATHSIG.
        ranks.append(subprocess.Popen([sys.executable, "-m", "watchdog.demo_rank", str(folder)], env=env,
                                      stdout=log, stderr=log, start_new_session=True, preexec_fn=die_with_parent))
    deadline = time.monotonic() + 120
    while len(list(folder.glob("rank-*"))) < RANKS:
        if any(r.poll() is not None for r in ranks) or time.monotonic() > deadline:
            stop_ranks(ranks)
            raise DemoError(f"the ranks did not start; see {folder / 'ranks.log'}")
        time.sleep(0.1)
    return ranks


def stop_ranks(ranks: list[subprocess.Popen[bytes]]) -> None:
    for r in ranks:
        if r.poll() is None:
            r.kill()
    for r in ranks:
        r.wait()


def _progress(daemon: Daemon, started: float) -> str:
    snapshot = daemon.published.snapshot
    if snapshot is None:
        return "waiting for the first sample"
    gpus = " ".join(f"{g.index}:{(g.utilization_ratio or 0):.0%}/{(g.power_watts or 0):.0f}W" for g in snapshot.gpus)
    episodes = [f"{e.signature.value} ({e.severity.value if e.severity else 'suspect'})"
                for e in daemon.published.episodes]
    return f"[{time.monotonic() - started:4.0f} s] GPU util/power {gpus}  episodes: {', '.join(episodes) or 'none'}"


def _describe(bundle: Path) -> list[str]:
    summary = json.loads((bundle / "summary.json").read_text())
    lines = ["", "=== incident ===", summary.get("headline") or summary["verdict"],
             f"why: {summary['verdict'].removeprefix(summary.get('headline', '')).lstrip('; ')}"]
    stacks_file = bundle / "stacks.json"
    if stacks_file.exists():
        (report, *_) = json.loads(stacks_file.read_text())
        for group in report["groups"]:
            if set(group["members"]) & set(report["outliers"]):
                lines.append(f"culprit: {', '.join(group['members'])} in {group['where']}; its stack:")
                lines += [f"    {f['function']} ({f['file']}:{f['line']})" for f in group["frames"][:12]]
        for capture in report.get("captures", []):
            if capture["result"] != "ok":
                lines.append(f"stack capture of pid {capture['pid']} failed: {capture['message']}")
    lines += [f"bundle:  {bundle}", f"report:  {bundle / 'report.html'}"]
    return lines


def run(duration: float | None, port: int, folder: Path | None, out: object = sys.stdout,
        series: str = "standard") -> int:
    listening = [True]

    def say(text: str) -> None:
        """Narrate; a reader that went away (`| head`, a closed terminal) ends the demo, never its clean-up."""
        if not listening[0]:
            return
        try:
            print(text, file=out, flush=True)  # type: ignore[call-overload]
        except (BrokenPipeError, OSError):
            listening[0] = False
            stop.set()

    stop = threading.Event()
    logfmt.setup(level=logfmt.ERROR)  # the demo narrates; the daemon's own log lines would drown it
    workdir = Path(folder) if folder else Path(tempfile.mkdtemp(prefix="stall-watchdog-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    note = _ptrace_note()
    if note:
        say(f"note: {note}")
    say(f"starting {RANKS} real torch.distributed ranks (gloo, CPU) on a simulated {RANKS}-GPU node ...")
    ranks = start_ranks(workdir)
    pids = {rank: [process.pid] for rank, process in enumerate(ranks)}
    config = parse_config({
        "source": {"kind": "sim", "scenario": "odd_rank", "start_offset_seconds": OFFSET, "pids": pids},
        "export": {"listen_address": f"127.0.0.1:{_free_port(port)}", "series": series},
        "bundles": {"directory": str(workdir / "incidents")},
        "stacks": {"observe_seconds": 1.0},
        "dump": {"open_on_loopback": True},  # the demo's own ranks, on loopback
    })
    service = build(config)
    try:
        service.start()
    except EndpointError as exc:
        service.close(timeout=5)
        stop_ranks(ranks)
        raise DemoError(str(exc)) from None
    daemon, endpoint = service.daemon, service.endpoint
    loop = threading.Thread(target=service.run, name="daemon", daemon=True)
    with SignalEvents({signal.SIGINT: stop, signal.SIGTERM: stop, signal.SIGHUP: stop}):  # HUP: terminal closed
        started = time.monotonic()
        loop.start()
        say(f"metrics: {endpoint.url}   (rank 4 gets stuck about {HANG_AFTER:.0f} s from now; the watchdog should "
            "name it within a minute)")
        reported: set[Path] = set()
        try:
            while not stop.is_set() and (duration is None or time.monotonic() - started < duration):
                stop.wait(5)
                say(_progress(daemon, started))
                for bundle in daemon.bundles.bundles():
                    if bundle not in reported and (bundle / "report.html").exists():
                        reported.add(bundle)
                        for line in _describe(bundle):
                            say(line)
                        say(f"metrics: {endpoint.url}  (still serving; Ctrl+C to stop"
                            + (f", or it stops after {duration:.0f} s)" if duration else ")"))
        finally:
            say("stopping: the daemon, the endpoint and the ranks ...")
            service.stop()
            loop.join(timeout=10)
            service.close(timeout=5)
            stop_ranks(ranks)
            for rank_file in workdir.glob("rank-*"):
                rank_file.unlink()
    if not reported:
        say("no incident was written in time; the ranks' log is in " + str(workdir / "ranks.log"))
    # A folder the demo made itself outlives it (the bundle and report are what a user opens next): say so.
    say(f"the demo's files stay in {workdir} (incident bundles, their reports, the ranks' log)"
        + ("" if folder else f"; remove them with `rm -r {shlex.quote(str(workdir))}`"))
    return 0 if reported else 1
