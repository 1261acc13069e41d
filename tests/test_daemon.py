"""The daemon's loop: the tick, its cadence, and every fault that must not stop it."""

from __future__ import annotations

import html
import itertools
import json
import logging
import math
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from tests.fakes.daemon import FlakySource, Receiver, daemon_config, scrape, stepping_clock
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml
from watchdog.config.sampling import SampleConfig
from watchdog.daemon import PAGED_BATCHES, Daemon
from watchdog.plumbing import logfmt
from watchdog.sample import sim
from watchdog.sample.nvml import NvmlSource
from watchdog.service import build
from watchdog.vocabulary.model import Severity, Signature


def spin_source(offset: float = 285) -> sim.SimSource:
    return sim.SimSource(sim.SCENARIOS["spin_hang"], interval_seconds=1.0, start_offset_seconds=offset,
                         clock=stepping_clock())


def metric(daemon: Daemon, line_start: str, series: str = "standard") -> float | None:
    for line in scrape(daemon, series).splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return None


def ticks_while(daemon: Daemon, count: int, **stuck: Callable[[], bool]) -> dict[str, int]:
    """Run `count` ticks on the daemon's schedule; for each named condition (something hung: a call, a child, a
    request), how many ticks ended while it held. A loop that waited on the hung thing would end no tick while
    it held, whatever the machine's speed."""
    held = dict.fromkeys(stuck, 0)
    original = daemon.tick

    def counted() -> None:
        original()
        for name, holds in stuck.items():
            held[name] += bool(holds())

    daemon.tick = counted  # type: ignore[method-assign]
    daemon.run(max_ticks=count)
    return held


def test_a_failing_component_is_counted_and_the_loop_goes_on(tmp_path: Path) -> None:
    source = FlakySource(spin_source())
    service = build(daemon_config(tmp_path), source)
    daemon = service.daemon
    daemon.tick()
    source.failing = True
    daemon.tick()
    daemon.tick()
    assert metric(daemon, 'stall_watchdog_component_up{component="sample"}') == 0
    assert metric(daemon, 'stall_watchdog_component_errors_total{component="sample"}') == 2
    source.failing = False
    daemon.tick()
    # up again: a component that runs has no series (sparse) unless export.series is full
    assert metric(daemon, 'stall_watchdog_component_up{component="sample"}') is None
    assert metric(daemon, 'stall_watchdog_component_up{component="sample"}', "full") == 1
    assert daemon.ticks == 4


def ticked_with_a_webhook(tmp_path: Path, source: sim.SimSource, ticks: int, slow_bundles: bool = False
                          ) -> tuple[Daemon, Receiver]:
    """The daemon over `source` for `ticks` ticks, alerting a local webhook; returns both, shut down. With
    `slow_bundles`, no bundle is written before the last tick (a disk slower than the loop)."""
    receiver = Receiver()
    written = threading.Event()
    try:
        config = daemon_config(tmp_path, alerts={"receivers": [{"type": "webhook", "name": "hook",
                                                                "url": receiver.url}]})
        service = build(config, source)
        daemon = service.daemon
        if slow_bundles:
            store, write = daemon.bundles, daemon.bundles.write
            store.write = lambda incident: (written.wait(30), write(incident))[1]  # type: ignore[method-assign]
        for _ in range(ticks):
            daemon.tick()
        written.set()
        service.close(timeout=5)
    finally:
        receiver.close()
    return daemon, receiver


def test_spin_hang_fires_writes_a_bundle_and_alerts(tmp_path: Path) -> None:
    daemon, receiver = ticked_with_a_webhook(tmp_path, spin_source(), 60)
    assert metric(daemon, 'stall_watchdog_episodes_total{severity="critical",signature="busy_spin"}') == 1
    assert metric(daemon, 'stall_watchdog_episode_state{gpu="3",signature="busy_spin"}') == 3
    (bundle,) = (tmp_path / "incidents").iterdir()
    assert oct(bundle.stat().st_mode & 0o777) == "0o700"
    assert {p.name for p in bundle.iterdir()} >= {"summary.json", "telemetry.jsonl"}
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in bundle.iterdir())
    (path, body), = receiver.requests
    assert body["alert"]["severity"] == "critical" and body["alert"]["bundle"] == str(bundle)
    assert body["text"].startswith("[CRITICAL]")


def test_gpu_lost_and_a_hung_nvml_call_keep_the_cadence(tmp_path: Path) -> None:
    gpus = [FakeGpu(util_percent=90, power_mw=500_000), FakeGpu(util_percent=90, power_mw=500_000)]
    source = NvmlSource(nvml=FakeNvml(gpus), call_timeout_seconds=0.05, clock=stepping_clock())
    source.open()
    service = build(daemon_config(tmp_path, sample={"interval_seconds": 0.2, "nvml_call_timeout_seconds": 0.05},
                                  detectors={"gpu_lost": {"for_seconds": 0, "hung_for_seconds": 0.5}}), source)
    daemon = service.daemon
    gpus[1].lost = True
    gpus[0].hang_in = "nvmlDeviceGetPowerUsage"
    safety = threading.Timer(120, gpus[0].release.set)  # a loop that waited on the call ends once this frees it
    safety.start()
    try:
        held = ticks_while(daemon, 10, call=lambda: not gpus[0].release.is_set())
        text = scrape(daemon)
    finally:
        safety.cancel()
        gpus[0].release.set()
        source.close()
    assert held == {"call": 10}, held  # every tick ended with the NVML call still hung
    assert any(line.startswith('stall_watchdog_gpu_health{gpu="1",health="lost"') and line.endswith(" 1.0")
               for line in text.splitlines())
    assert any(line.startswith('stall_watchdog_gpu_health{gpu="0",health="hung"') and line.endswith(" 1.0")
               for line in text.splitlines())
    # one episode per GPU: GPU 1 lost, GPU 0 hung
    assert metric(daemon, 'stall_watchdog_episodes_total{severity="critical",signature="gpu_lost"}') == 2


def test_dead_receivers_and_a_hung_py_spy_never_delay_a_tick(tmp_path: Path) -> None:
    failing, hanging = Receiver("fail"), Receiver("hold")
    hung, pids = tmp_path / "py-spy", tmp_path / "py-spy.pids"
    hung.write_text(f"#!/bin/sh\necho $$ >> {pids}\nexec sleep 600\n")
    hung.chmod(0o755)

    def capturing() -> bool:  # a py-spy of the capture still running
        return pids.exists() and any(psutil.pid_exists(int(p)) and psutil.Process(int(p)).status() != "zombie"
                                     for p in pids.read_text().split())

    worker = os.getpid()  # a real process on simulated GPU 0, so a capture is attempted
    try:
        config = daemon_config(
            tmp_path, source={"start_offset_seconds": 296, "pids": {0: [worker]}},
            bundles={"capture_stacks": True}, stacks={"py_spy_command": [str(hung)], "timeout_seconds": 3.0},
            alerts={"receivers": [{"type": "webhook", "name": "failing", "url": failing.url},
                                  {"type": "webhook", "name": "hanging", "url": hanging.url, "timeout_seconds": 3}]})
        service = build(config, sim.SimSource(sim.SCENARIOS["spin_hang"], 1.0, 296, {0: [worker]},
                                              clock=stepping_clock()))
        daemon = service.daemon
        held = ticks_while(daemon, 100, capture=capturing, request=lambda: hanging.holding > 0)
        service.close(timeout=8)
    finally:
        failing.close()
        hanging.close()
    # Ticks (5 a second) kept ending while a py-spy hung (3 s, its timeout) and a receiver held a request (3 s a try).
    assert held["capture"] >= 4 and held["request"] >= 4, held
    assert metric(daemon, 'stall_watchdog_stack_captures_total{result="timeout"}') == 1
    assert metric(daemon, 'stall_watchdog_alerts_total{receiver="failing",result="failed"}') == 1
    assert len(failing.requests) == 2  # max_attempts, with backoff
    assert metric(daemon, 'stall_watchdog_alerts_total{receiver="hanging",result="failed"}') == 1


def test_a_read_only_bundle_folder_costs_the_bundle_not_the_loop(tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the bundle folder should be")
    config = daemon_config(tmp_path, bundles={"directory": str(blocked / "incidents")})
    service = build(config, spin_source())
    daemon = service.daemon
    for _ in range(60):
        daemon.tick()
    service.close(timeout=5)
    assert metric(daemon, 'stall_watchdog_bundles_total{result="failed"}') == 1
    assert metric(daemon, 'stall_watchdog_component_up{component="act"}', "full") == 1
    assert daemon.ticks == 60


def test_a_full_disk_costs_the_bundle(tmp_path: Path) -> None:
    """/dev/full as the telemetry file's folder is not possible; a folder on a full tmpfs is: a tmpfs of
    one page leaves no room for the telemetry window."""
    mount = tmp_path / "full"
    mount.mkdir()
    mounted = os.system(f"mount -t tmpfs -o size=4k tmpfs {mount} 2>/dev/null")  # noqa: S605
    assert mounted == 0, "mounting a 4 KiB tmpfs (a disk that fills at once) needs root, as in CI"
    try:
        service = build(daemon_config(tmp_path, bundles={"directory": str(mount / "incidents")}), spin_source())
        daemon = service.daemon
        for _ in range(60):
            daemon.tick()
        service.close(timeout=5)
        assert metric(daemon, 'stall_watchdog_bundles_total{result="failed"}') == 1
        assert not any(p.name.startswith(".partial") for p in (mount / "incidents").iterdir())
    finally:
        os.system(f"umount {mount}")  # noqa: S605


def test_bundles_rotate_under_the_count_limit(tmp_path: Path) -> None:
    config = daemon_config(tmp_path, bundles={"max_count": 2})
    service = build(config, spin_source())
    daemon = service.daemon
    from watchdog.act.bundles import Incident
    from watchdog.vocabulary.model import EpisodeEvent, EventKind, Severity, Signature

    for n in range(4):
        event = EpisodeEvent(EventKind.FIRED, Signature.BUSY_SPIN, Severity.CRITICAL, (n,), (), 1e9 + n, 1e9 + n, "s")
        daemon.bundles.write(Incident(event, []))
    names = [p.name for p in daemon.bundles.bundles()]
    assert len(names) == 2 and names[-1].endswith("gpu3")


def wait_for_looks(daemon: Daemon, timeout: float = 20.0) -> None:
    """Until every look at the stacks the incidents started has finished."""
    deadline = time.monotonic() + timeout
    while any(s.look is None or not s.look.done() for s in daemon.incidents.open.values()) or not \
            daemon.incidents.open:
        assert time.monotonic() < deadline, "the stacks were not looked at"
        time.sleep(0.05)


@pytest.mark.parametrize("stopping", [False, True], ids=["running", "stopping"])
def test_stack_verdict_refines_the_alert_severity(tmp_path: Path, stopping: bool) -> None:
    """odd_rank on real gloo ranks: the GPUs wait on GPU 4 (a warning by telemetry alone). The rank on
    GPU 4 is idle in its data loader while the others sit in all_reduce, so the stacks make it a hang:
    the alert goes out critical at once, not after 15 minutes. `stopping`: the bundle is written only after
    the daemon began to stop (its writers held until then): it still holds the stacks the looks captured."""
    from tests.conftest import gloo_job

    receiver = Receiver()
    try:
        with gloo_job("dataloader", tmp_path, odd_rank=2) as ranks:
            pids = {4: [ranks[2].pid], 0: [ranks[0].pid], 1: [ranks[1].pid], 2: [ranks[3].pid]}
            config = daemon_config(tmp_path, source={"scenario": "odd_rank", "start_offset_seconds": 295,
                                                     "pids": pids},
                                   bundles={"capture_stacks": True}, stacks={"observe_seconds": 0.3},
                                   alerts={"receivers": [{"type": "webhook", "name": "hook", "url": receiver.url}]})
            service = build(config, sim.SimSource(sim.SCENARIOS["odd_rank"], 1.0, 295, pids, clock=stepping_clock()))
            daemon = service.daemon
            ticks = 0
            while not daemon.incidents.open and ticks < 40:  # until the episode is suspected
                daemon.tick()
                ticks += 1
            wait_for_looks(daemon)  # live, the look takes about a second of the 30 s before the episode fires
            release = threading.Event()
            if stopping:  # both incident writers busy until the stop has begun
                for _ in range(2):
                    daemon.incidents.pool.submit(release.wait, 30)
            for _ in range(45 - ticks):
                daemon.tick()
            if not stopping:  # the alert is sent once its bundle is written: the tick after it shows it
                deadline = time.monotonic() + 30
                while not receiver.requests and time.monotonic() < deadline:
                    time.sleep(0.05)
                daemon.tick()
            stopper = threading.Thread(target=service.close, kwargs={"timeout": 15})
            stopper.start()
            assert daemon.incidents.stopping.wait(10)
            release.set()
            stopper.join()
    finally:
        receiver.close()
    (_, body), = receiver.requests
    alert = body["alert"]
    assert alert["signature"] == "waiting" and alert["culprit_gpus"] == [4]
    assert alert["severity"] == "critical", alert["summary"]
    assert "Stacks: 3 of 4 ranks wait in all_reduce" in alert["summary"]
    assert "rank 2" in alert["summary"] and "FakeLoader.__next__" in alert["summary"]
    assert alert["training_job"].startswith("run:test-") and alert["labels"]["training_job"] == alert["training_job"]
    assert alert["culprit"].startswith("GPU 4 (rank 2, pid ")
    bundle = Path(alert["bundle"])
    assert (bundle / "stacks.json").exists() and (bundle / "environment.json").exists()
    assert len(list((bundle / "stacks").iterdir())) == 4
    doctor = {d["check"]: d for d in json.loads((bundle / "doctor.json").read_text())}
    assert {"driver", "p2p", "kernel", "timeouts", "flight_recorder"} <= doctor.keys()  # node and job checks
    # The first look showed a hang: a second look, stacks.confirm_seconds later, confirmed it.
    assert metric(daemon, 'stall_watchdog_stack_captures_total{result="ok"}') == 8
    assert "The same at a second look" in alert["summary"]
    # One severity everywhere: the episode's state, the alert, the bundle and its page.
    assert metric(daemon, 'stall_watchdog_episode_state{gpu="4",signature="waiting"}') == 3
    summary = json.loads((bundle / "summary.json").read_text())
    assert summary["severity"] == "critical" and alert["summary"].startswith(summary["headline"])
    assert summary["headline"].startswith("HANG (critical): rank 2 (pid")
    assert "the other 3 ranks wait for it in all_reduce" in summary["headline"]
    assert 'class="verdict critical"' in (bundle / "report.html").read_text()
    # One sentence everywhere: the alert says what the bundle's verdict says, rendered once from the incident's
    # fields (the doctor's top finding among them); the page shows it; /metrics names the same culprit.
    told = summary["telling"]
    assert alert["summary"] == summary["verdict"] and told["summary"] in alert["summary"]
    if told["doctor"]:  # the node's doctor found something worth saying
        assert f"Doctor: {told['doctor']}" in alert["summary"]
        assert html.escape(told["doctor"]) in (bundle / "report.html").read_text()
    if not stopping:  # (a daemon that stopped holds no open episode)
        info = [line for line in scrape(daemon).splitlines() if line.startswith("stall_watchdog_episode_alert_info{")]
        assert len(info) == 1 and f'culprit="{alert["culprit"]}"' in info[0], (info, alert["culprit"])


def test_a_hang_that_relapses_is_one_page_and_one_bundle(tmp_path: Path) -> None:
    """Spinning from 300 s, training again at 400 s, spinning again at 480 s: one alert, one bundle that
    records the relapse (even when the relapse comes before the bundle is written), and the episode still
    critical in /metrics (held for job.relapse_seconds)."""
    import dataclasses

    scenario = dataclasses.replace(sim.SCENARIOS["spin_hang"], duration_seconds=900, timeline=(
        *sim.SCENARIOS["spin_hang"].timeline, (400, None, "train"), (480, None, "spin")))
    source = sim.SimSource(scenario, interval_seconds=1.0, start_offset_seconds=285, clock=stepping_clock())
    daemon, receiver = ticked_with_a_webhook(tmp_path, source, 300, slow_bundles=True)  # to 585 s
    assert metric(daemon, 'stall_watchdog_episodes_total{severity="critical",signature="busy_spin"}') == 1
    assert metric(daemon, 'stall_watchdog_episode_state{gpu="3",signature="busy_spin"}') == 3
    (bundle,) = (tmp_path / "incidents").iterdir()
    summary = json.loads((bundle / "summary.json").read_text())
    assert "relapsed" in summary and summary["event"]["event"] == "relapsed"
    (path, body), = receiver.requests
    assert body["alert"]["severity"] == "critical"


def test_a_suspicion_that_ends_without_an_alert_leaves_nothing_behind(tmp_path: Path) -> None:
    """The checkpoint scenario's 30 s pause of every rank is suspected (its stacks would be looked at) and
    ends before zero_util's for_seconds: what the incident side held for it is dropped, as nothing will
    ever resolve it (a daemon up for months suspects thousands of such pauses)."""
    service = build(daemon_config(tmp_path, source={"scenario": "checkpoint", "start_offset_seconds": 690}),
                   sim.SimSource(sim.SCENARIOS["checkpoint"], 1.0, 690, clock=stepping_clock()))
    daemon = service.daemon
    held = set()
    for _ in range(80):
        daemon.tick()
        held |= set(daemon.incidents.open)
    service.close(timeout=10)
    assert any(key.startswith("zero_util@") for key in held), held
    assert daemon.incidents.open == {}
    assert metric(daemon, "stall_watchdog_episodes_total") is None  # it never alerted


class _Played:
    """A source that plays a list of snapshots, one per tick."""

    def __init__(self, snapshots: list) -> None:  # type: ignore[type-arg]
        self.snapshots = iter(snapshots)
        self.gpus = len(snapshots[0].gpus)

    def gpu_count(self) -> int:
        return self.gpus

    def open(self) -> None:
        pass

    def sample(self):  # type: ignore[no-untyped-def]
        return next(self.snapshots)

    def close(self) -> None:
        pass


def test_uneven_work_is_said_once_and_shown_never_paged(tmp_path: Path) -> None:
    from tests.detect.test_rank_waits import stream
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logfmt.log.addHandler(handler)
    level = logfmt.log.level
    logfmt.log.setLevel(logging.INFO)
    try:
        service = build(daemon_config(tmp_path), _Played(stream({0: 0.12}, seconds=400)))
        daemon = service.daemon
        for _ in range(400):
            daemon.tick()
        service.close(2)
    finally:
        logfmt.log.removeHandler(handler)
        logfmt.log.setLevel(level)
    logged = "\n".join(lines)
    assert logged.count("event=uneven_work") == 1 and "rank=0" in logged and "why=from_start" in logged
    assert metric(daemon, 'stall_watchdog_uneven_work_ratio{gpu="0",why="from_start"}') == pytest.approx(0.18, abs=0.06)
    assert metric(daemon, 'stall_watchdog_rank_wait_ratio{gpu="0"}', "full") == pytest.approx(0.12, abs=0.05)
    assert not daemon.engine.open_episodes()


def test_the_failure_series_the_rules_watch_are_born_at_the_first_failure(tmp_path: Path) -> None:
    """StallWatchdogAlertsFailing and StallWatchdogBundlesFailing read a series born in their window as a failure
    (rules_test.yml): a node that never failed exports no failure series, so the rules read the few that did,
    not a zero series of every node of the fleet."""
    config = daemon_config(tmp_path, alerts={"receivers": [{"type": "webhook", "name": "pager",
                                                            "url": "http://127.0.0.1:9/hook"}]})
    service = build(config, sim.SimSource(sim.SCENARIOS["spin_hang"], 1.0, 0, {}, clock=stepping_clock()))
    try:
        service.daemon.tick()
        assert metric(service.daemon, 'stall_watchdog_alerts_total{receiver="pager",result="failed"}') is None
        assert metric(service.daemon, 'stall_watchdog_bundles_total{result="failed"}') is None
        assert metric(service.daemon, 'stall_watchdog_actions_total{') is None
    finally:
        service.close(timeout=5)


def _judged(tmp: Path, batch_seconds: float, ticks: int, scenario: sim.Scenario = sim.SCENARIOS["spin_hang"],
            start: float = 240) -> tuple[list[tuple[int, object]], list[int]]:
    """A scenario from `start` (spin_hang from 240 s), 1 s a tick: each event with the tick it came out at, and
    the ticks each call to the detectors judged."""
    config = daemon_config(tmp, sample={"interval_seconds": 1.0, "batch_seconds": batch_seconds},
                           source={"start_offset_seconds": start})
    service = build(config, sim.SimSource(scenario, 1.0, start, clock=stepping_clock()))
    daemon, observe = service.daemon, service.daemon.engine.observe
    events: list[tuple[int, object]] = []
    calls: list[int] = []

    def counted(held: list) -> list:
        calls.append(len(held))
        found = observe(held)
        events.extend((daemon.ticks, event) for event in found)
        return found

    daemon.engine.observe = counted  # type: ignore[method-assign]
    try:
        for _ in range(ticks):
            daemon.tick()
        daemon.flush()
    finally:
        service.close(timeout=5)
    return events, calls


def test_quiet_ticks_are_judged_in_batches_with_the_same_verdicts(tmp_path: Path) -> None:
    """sample.batch_seconds: while no stall is suspected the detectors judge 10 s of ticks at once; once one is,
    every tick until it is critical. The events are those of judging every tick, at the same stream times, and
    the critical one comes out at the same tick."""
    batch = SampleConfig().batch_seconds
    every, every_calls = _judged(tmp_path / "every", 0, 200)
    batched, batched_calls = _judged(tmp_path / "batched", batch, 200)
    assert [event for _, event in batched] == [event for _, event in every]
    kinds = [(event.event.value, event.severity.value) for _, event in every]  # type: ignore[attr-defined]
    suspected, critical = [kind for kind, _ in kinds].index("suspected"), kinds.index(("fired", "critical"))
    assert suspected < critical and batched[critical][0] == every[critical][0]  # the page is not delayed
    assert batched[suspected][0] - every[suspected][0] in range(int(batch))  # the first sign: up to 10 s later
    assert sum(every_calls) == sum(batched_calls) == 200  # every tick judged once, the last ones by flush()
    assert len(every_calls) == 200 and len(batched_calls) < 200 / 4
    # Once the page is out and nothing below critical is open, batches of PAGED_BATCHES x 10 s (the flush: the rest)
    paged_at = batched[critical][0]
    judged = list(itertools.accumulate(batched_calls))
    before = [n for n, upto in zip(batched_calls, judged) if upto <= paged_at]
    after = batched_calls[len(before) + 1:-1]  # after the batch that held the critical tick
    assert max(before) == batch and after and set(after) == {math.ceil(batch * PAGED_BATCHES)}, (before, after)


def test_a_lost_gpu_is_judged_in_the_tick_it_is_lost_not_at_the_end_of_a_batch(tmp_path: Path) -> None:
    """A GPU that falls off the bus is critical at once: the tick where the GPUs that answer change is judged as it
    comes, so its page comes out at the tick it does when every tick is judged (up to a batch later before)."""
    lost = sim.Scenario("lost", "GPU 5 falls off the bus at 300 s, the others train on", "h100", 8, 600,
                        ((0, None, "train"), (300, (5,), "lost")))
    every, _ = _judged(tmp_path / "every", 0, 40, lost, 285)
    batched, calls = _judged(tmp_path / "batched", 10, 40, lost, 285)
    assert [event for _, event in batched] == [event for _, event in every]

    def paged(events: list[tuple[int, object]]) -> int:
        return next(n for n, event in events if event.signature is Signature.GPU_LOST  # type: ignore[attr-defined]
                    and event.severity is Severity.CRITICAL)  # type: ignore[attr-defined]

    assert paged(batched) == paged(every) and len(calls) < 40 / 2


def test_the_ranks_of_a_paged_hang_are_read_on_the_host_every_5_s_not_every_tick(tmp_path: Path) -> None:
    """Host progress: every rank is read every tick while no GPU works (a pause or a stall to tell apart); once
    the hang is critical its ranks are read every host_progress.AT_WORK_SECONDS, their rates standing in."""
    ranks = [subprocess.Popen(["sleep", "600"]) for _ in range(8)]
    pids = {gpu: [rank.pid] for gpu, rank in enumerate(ranks)}
    config = daemon_config(tmp_path, sample={"interval_seconds": 1.0},
                           source={"scenario": "spin_hang", "start_offset_seconds": 240, "pids": pids})
    service = build(config, sim.SimSource(sim.SCENARIOS["spin_hang"], 1.0, 240, pids, clock=stepping_clock()))
    daemon, read = service.daemon, service.daemon.host._read
    daemon.host._monotonic = stepping_clock(0.0)  # its own clock, a second a tick like the source's
    per_tick: list[int] = []
    daemon.host._read = lambda pid, now: per_tick.__setitem__(-1, per_tick[-1] + 1) or read(pid, now)  # type: ignore
    try:
        critical = None
        for tick in range(200):
            per_tick.append(0)
            daemon.tick()
            if critical is None and any(ep.fired_severity is Severity.CRITICAL for ep in daemon.engine.open_episodes()):
                critical = tick
            elif critical is not None and tick - critical == 60:
                break
        assert critical is not None
        spinning = per_tick[critical - 20:critical]  # nothing at work in a spin: every rank read every tick
        paged = per_tick[critical + 16:]  # from the first judgement after the page (batches of 15 s)
        assert spinning == [8] * 20 and sum(paged) <= 8 * len(paged) / 4, (spinning, paged)
    finally:
        service.close(timeout=5)
        for rank in ranks:
            rank.kill()
            rank.wait()


def test_large_blocks_keep_pages_of_their_own_where_glibc_runs() -> None:
    """glibc raises its mmap threshold to the largest block freed (an incident's page): the daemon fixes it."""
    import platform

    from watchdog.plumbing import allocator

    assert allocator.large_blocks_apart() == (platform.libc_ver()[0] == "glibc")


def test_the_loop_hands_free_memory_back_once_a_minute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """glibc keeps what the daemon frees in its heaps: the loop asks it to give the free pages back every
    allocator.TRIM_SECONDS of its own clock, not every tick (a trim walks the heaps)."""
    from watchdog.plumbing import allocator

    asked: list[int] = []
    monkeypatch.setattr(allocator, "release_free_memory", lambda: asked.append(1) or True)
    now = [1000.0]
    service = build(daemon_config(tmp_path, sample={"interval_seconds": 1.0}), spin_source(),
                    monotonic=lambda: now[0])
    daemon, tick = service.daemon, service.daemon.tick

    def a_second() -> None:  # each tick takes a second of the loop's clock, and the loop waits for none
        tick()
        now[0] += 1.0

    daemon.tick = a_second  # type: ignore[method-assign]
    daemon.stop_requested.wait = lambda timeout=None: False  # type: ignore[method-assign]
    daemon.run(max_ticks=185)
    assert len(asked) == 3  # at 60, 120 and 180 s


def test_the_allocator_is_asked_on_glibc() -> None:
    """On glibc (these machines, the shipped image) the trim is found and runs; elsewhere it is a no-op."""
    import platform

    from watchdog.plumbing import allocator

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc: malloc_trim is not there to find")
    assert allocator.release_free_memory() is True
