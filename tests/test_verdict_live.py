"""One verdict, live: the real daemon over real processes on a simulated node that goes idle with memory
held. Whether the ranks make host progress decides the severity, and /metrics, the alert, the bundle and
its report all say the same one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.conftest import TARGETS, gloo_job, wait_for
from tests.fakes.daemon import Receiver, daemon_config, scrape, stepping_clock
from watchdog.daemon import Daemon
from watchdog.sample import sim
from watchdog.service import build

HANG_AT = 300.0  # sim.SCENARIOS["zero_util_hang"]: every GPU idle with memory held from here
START = 1.9e9


@contextmanager
def ranks(tmp: Path, target: list[str], count: int = 8) -> Iterator[dict[int, list[int]]]:
    """`count` real processes, one per simulated GPU, each at its stall before the daemon starts."""
    processes, readies = [], []
    try:
        for gpu in range(count):
            ready = tmp / f"ready-{gpu}"
            readies.append(ready)
            processes.append(subprocess.Popen([sys.executable, *target, str(ready)], text=True,
                                              env={**os.environ, "RANK": str(gpu), "WORLD_SIZE": str(count),
                                                   "LOCAL_RANK": str(gpu), "TORCHELASTIC_RUN_ID": "live-verdict"}))
        wait_for(readies, 30, processes)
        time.sleep(0.3)
        yield {gpu: [p.pid] for gpu, p in enumerate(processes)}
    finally:
        for p in processes:
            p.kill()
        for p in processes:
            p.wait()


def episode_state(daemon: Daemon, signature: str) -> float | None:
    for line in scrape(daemon).splitlines():
        if line.startswith(f'stall_watchdog_episode_state{{gpu="0",signature="{signature}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return None


def run(tmp: Path, pids: dict[int, list[int]], seconds: int, receiver: Receiver) -> tuple[Daemon, list[float]]:
    """The daemon over zero_util_hang from 10 s before the hang, one simulated second per tick, ticking at
    10 Hz of real time (host progress is measured on the real clock). Returns the daemon and the
    simulated second of each tick whose episode_state for zero_util was critical."""
    offset = HANG_AT - 10
    config = daemon_config(tmp, source={"scenario": "zero_util_hang", "start_offset_seconds": offset, "pids": pids},
                           bundles={"capture_stacks": True}, stacks={"observe_seconds": 0.3},
                           alerts={"receivers": [{"type": "webhook", "name": "hook", "url": receiver.url}]})
    clock = stepping_clock(START + offset)
    service = build(config, sim.SimSource(sim.SCENARIOS["zero_util_hang"], 1.0, offset, pids, clock=clock))
    daemon = service.daemon
    critical_at = []
    for tick in range(seconds):
        daemon.tick()
        if episode_state(daemon, "zero_util") == 3:
            critical_at.append(offset + tick)
        time.sleep(0.1)
    service.close(timeout=15)
    return daemon, critical_at


def test_all_ranks_blocked_is_critical_within_a_minute_everywhere(tmp_path: Path) -> None:
    receiver = Receiver()
    try:
        with ranks(tmp_path, [str(TARGETS / "stuck.py"), "queue"]) as pids:
            daemon, critical_at = run(tmp_path, pids, 90, receiver)
    finally:
        receiver.close()
    assert critical_at and critical_at[0] - HANG_AT <= 60, critical_at[:3]
    alerts = [body["alert"] for _, body in receiver.requests if body["alert"]["signature"] == "zero_util"]
    assert alerts and alerts[-1]["severity"] == "critical", [a["summary"] for a in alerts]
    assert alerts[-1]["summary"].startswith("HANG (critical): ")
    summary = json.loads((Path(alerts[-1]["bundle"]) / "summary.json").read_text())
    assert summary["severity"] == "critical" and summary["headline"].startswith("HANG (critical)")
    page = (Path(alerts[-1]["bundle"]) / "report.html").read_text()
    assert 'class="verdict critical"' in page and "HANG (critical)" in page


def test_ranks_writing_a_checkpoint_for_three_minutes_never_page(tmp_path: Path) -> None:
    """Ranks busy on the host through a pause are a checkpoint: suspect (their stacks looked at), not
    alerted before job.busy_pause_quiet_seconds (5 min), never critical while they move."""
    receiver = Receiver()
    try:
        with ranks(tmp_path, [str(TARGETS / "checkpoint_writer.py"), str(tmp_path)]) as pids:
            daemon, critical_at = run(tmp_path, pids, 200, receiver)
            assert episode_state(daemon, "zero_util") == 1  # suspect for the whole pause
    finally:
        receiver.close()
    assert critical_at == []
    assert [body["alert"]["summary"] for _, body in receiver.requests] == []
    host = scrape(daemon, "full")
    assert 'stall_watchdog_gpu_host_io_bytes_per_second{gpu="0"' in host


def test_ranks_spinning_on_the_cpu_in_one_collective_are_critical_within_30_s(tmp_path: Path) -> None:
    """Every local rank in the same all_reduce, each burning a core (CUDA's spin-wait, a host-side wait
    loop), the job's fifth rank on "another node" never arriving, over four GPUs spinning: two looks at the
    stacks with no I/O moving make it critical, as sleeping ranks are; CPU time is not progress."""
    spinning = sim.Scenario("spin4", "", "h100", 4, 900, ((0, None, "startup"), (40, None, "train"),
                                                         (300, None, "spin")), gpm=True)
    lead = 12
    config = daemon_config(tmp_path, bundles={"capture_stacks": True})
    with gloo_job("spin", tmp_path, ranks=4, elsewhere=1) as processes:
        pids = {gpu: [p.pid] for gpu, p in enumerate(processes)}
        service = build(config, sim.SimSource(spinning, 1.0, 300 - lead, pids))
        daemon = service.daemon
        started, critical = time.monotonic(), None
        try:
            for tick in range(lead + 45):
                time.sleep(max(0.0, started + tick - time.monotonic()))
                daemon.tick()
                fired = [ep for ep in daemon.engine.open_episodes()
                         if ep.fired_severity is not None and ep.fired_severity.value == "critical"]
                if fired:
                    critical = (tick - lead, fired[0])
                    break
        finally:
            service.close(timeout=15)
    assert critical is not None, "not critical within 45 s of the onset"
    seconds, episode = critical
    assert seconds <= 30, (seconds, episode.reason)
    assert episode.stacks is not None and episode.stacks.confirmed, episode.reason
    assert "all_reduce" in episode.stacks.headline and "another node" in episode.stacks.headline
