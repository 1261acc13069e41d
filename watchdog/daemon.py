"""The daemon, and the composition root: `build(config)` wires every part once (source, detectors,
incidents, the responder that acts, alert dispatcher, stack capturer, bundles, metrics); `run`, `demo` and
the tests all call it.

    tick() = sample -> detect -> act -> export

Sampling runs on the monotonic clock without drift. Each component runs inside one guarded boundary
that counts and logs its failures, so nothing stops the loop: NVML calls are time-bounded in the
source, stack captures, bundles and alert deliveries run off the loop. The loop itself pings systemd's
watchdog, so a wedged loop gets the service restarted. SIGHUP reloads the configuration (an invalid one
is rejected with its problems and the old one stays); SIGTERM/SIGINT stop cleanly.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from prometheus_client.registry import CollectorRegistry

from watchdog import logfmt, privileges
from watchdog.act import membership
from watchdog.act.actions import Actions
from watchdog.act.actions import problems as action_problems
from watchdog.act.alerts import AlertDispatcher, Receiver
from watchdog.act.bundles import BundleStore
from watchdog.act.dump import DumpService
from watchdog.act.incidents import IncidentHandler
from watchdog.act.responder import Responder
from watchdog.config import Config, ConfigError, load_config
from watchdog.counters import Counters
from watchdog.detect import busy_spin
from watchdog.detect.engine import DetectorEngine
from watchdog.detect.severity import STACK_SIGNATURES
from watchdog.export.metrics import AlertRow, EpisodeView, Published, RankRow, WatchdogCollector, new_counters
from watchdog.export.report import write_for_bundle
from watchdog.export.systemd import SystemdNotifier
from watchdog.model import EpisodeEvent, EventKind, NodeSnapshot, Severity, Signature, Verdict, Workload, gpu_list
from watchdog.sample import sim
from watchdog.sample.host_progress import HostProgress
from watchdog.sample.kubelet import pod_directory
from watchdog.sample.nvml import NvmlSource
from watchdog.sample.ranks import RankDiscovery
from watchdog.sample.replay import scenario
from watchdog.schedule import Ticker
from watchdog.stacks import nccl_inspector
from watchdog.stacks.capture import StackCapturer
from watchdog.stacks.sampling import RankSampler, SampleTarget

T = TypeVar("T")


class Source(Protocol):
    driver_version: str | None

    @property
    def gpu_count(self) -> int: ...

    def open(self) -> None: ...

    def sample(self) -> NodeSnapshot: ...

    def close(self) -> None: ...


def source_for(config: Config) -> Source:
    """The configured source, not yet opened: the real GPUs, or a scenario played in real time."""
    if config.source.kind == "sim":
        return sim.SimSource(scenario(config.source.scenario), config.sample.interval_seconds,
                             config.source.start_offset_seconds, config.source.pids or None)
    return NvmlSource(call_timeout_seconds=config.sample.nvml_call_timeout_seconds)


def build(config: Config, source: Source | None = None, config_path: str | None = None, *,
          notifier: SystemdNotifier | None = None, receivers: list[Receiver] | None = None,
          discovery: RankDiscovery | None = None, monotonic: Callable[[], float] = time.monotonic,
          wall: Callable[[], float] = time.time) -> Daemon:
    """Wire the daemon from its configuration. `source` defaults to the configured one (opened by the
    caller); the keyword arguments are the seams tests and the demo use."""
    source = source if source is not None else source_for(config)
    counters = new_counters()
    discovery = discovery or RankDiscovery(pods=pod_directory(config.kubernetes))
    verdicts: queue.SimpleQueue[tuple[str, Verdict]] = queue.SimpleQueue()
    dispatcher = AlertDispatcher(config.alerts, counters, receivers)
    bundles = BundleStore(config.bundles, counters, render_report=write_for_bundle)
    actions = Actions(config.actions)
    incidents = IncidentHandler(config, counters, dispatcher, bundles, StackCapturer.from_config(config.stacks),
                                discovery, inventory=getattr(source, "inventory", None),
                                on_verdict=lambda key, verdict: verdicts.put((key, verdict)), monotonic=monotonic,
                                slurm_check=actions.slurm_job_runs_as)
    responder = Responder(incidents, counters, actions, monotonic)
    daemon = Daemon(config, source, incidents, responder, counters, discovery, config_path,
                    notifier or SystemdNotifier(), monotonic, wall, HostProgress(monotonic), verdicts)
    daemon.sampler = RankSampler(incidents.capturer, config.stacks, daemon.sample_targets,
                                 on_problem=lambda pid, problem: logfmt.event(
                                     "rank_not_sampled", level=logfmt.WARNING, pid=pid or None, problem=problem))
    responder.unready = action_problems(config.actions)  # the action would fail when due: said now, at start
    for problem in responder.unready:
        logfmt.event("action_unready", level=logfmt.WARNING, problem=problem)
    for short in privileges.shortfalls(stacks=True, terminate=False):
        logfmt.event("privileges_short", level=logfmt.WARNING, problem=short.text())
    daemon.dumps = DumpService(config, counters, incidents.capturer,  # one py-spy found, one abort stops all
                               discovery, bundles, lambda: daemon.published.snapshot, incidents.node, monotonic,
                               last_look=incidents.last_look, slurm_check=actions.slurm_job_runs_as,
                               pace=lambda: daemon.published.slow_gpus())
    return daemon


# Which configuration section each component reads, and whether a SIGHUP applies it ("reload") or only a
# restart does ("restart": the source, the listening endpoint with its credentials, the receivers, the
# bundle store and the kubelet client are built once). `reloaded` logs both lists.
RELOAD = {
    "sample": "reload",  # the loop's interval (the source's own interval: restart, under `source`)
    "job": "reload", "detectors": "reload",  # the engine
    "stacks": "reload",  # incidents, dumps and the shared py-spy capturer
    "dump": "reload",  # rate limits and cooldown; dump.enabled, token_file, max_body_bytes are the endpoint's
    "actions": "reload",  # the policy, its guards and the actions (what was done is remembered across reloads)
    "source": "restart", "export": "restart", "alerts": "restart", "bundles": "restart",
    "kubernetes": "restart",
    "coordinator": "restart",  # not the daemon's: `stall-watchdog coordinate --config` reads it when it starts
}


def _slowdown(facts: dict[str, float | str]) -> float | None:
    value = facts.get("slowdown")
    return float(value) if value is not None else None


class Daemon:
    def __init__(self, config: Config, source: Source, incidents: IncidentHandler, responder: Responder,
                 counters: Counters, discovery: RankDiscovery, config_path: str | None, notifier: SystemdNotifier,
                 monotonic: Callable[[], float], wall: Callable[[], float], host: HostProgress,
                 verdicts: queue.SimpleQueue[tuple[str, Verdict]]):
        self.config = config
        self.config_path = config_path
        self.source = source
        self.notifier = notifier
        self.monotonic, self.wall = monotonic, wall
        self.counters = counters
        self.engine = DetectorEngine(config, on_error=self._failed)
        self.incidents, self.responder = incidents, responder  # the looks, bundles and alerts; the actions
        self.bundles = incidents.bundles
        collector = WatchdogCollector(lambda: self.published, self.counters)
        self.registry = CollectorRegistry()
        self.registry.register(collector)
        self.exposition = collector.exposition  # what GET /metrics serves
        self.published = Published()
        self.history: deque[NodeSnapshot] = deque()
        self.component_up: dict[str, bool] = {}
        self.stop_requested = threading.Event()
        self.reload_requested = threading.Event()
        self.ticks = 0
        self.discovery = discovery
        self.host = host  # host progress of each GPU's processes, a reading like the GPU's own
        self.verdicts = verdicts  # the stacks' verdicts, handed back by the incident workers
        # pid -> (its start time as host progress read it, rank, job, workload)
        self._rank_cache: dict[int, tuple[int | None, int | None, str, Workload]] = {}
        self.dumps: DumpService | None = None  # POST /v1/dump, set by build()
        self.sampler: RankSampler | None = None  # the ranks' stack samples for stragglers, set by build()
        self._uneven: set[int] = set()  # GPUs said to hold uneven work (logged once while it lasts)

    def dump_request(self, body: bytes) -> tuple[int, dict[str, object], int | None]:
        """The endpoint's POST /v1/dump: the dump service's answer as (status, JSON, Retry-After)."""
        if self.dumps is None:
            return 404, {"error": "dumps are not wired in this daemon"}, None
        answer = self.dumps.handle(body)
        return answer.status, answer.body, answer.retry_after

    # -- one tick ----------------------------------------------------------------------------------
    def tick(self) -> None:
        started = self.monotonic()
        snapshot = self._guarded("sample", self._sample)
        events: list[EpisodeEvent] = []
        if snapshot is not None:
            self._remember(snapshot)
            events = self._guarded("detect", self._detect, snapshot) or []
            for event in events:
                self._guarded("act", self._act, event, snapshot)
            self._guarded("act", self.incidents.forget, self.engine.episode_keys())
            self._guarded("act", self.incidents.recheck, self._unsettled(), snapshot)
            self._guarded("act", self.responder.consider, snapshot)
        self._guarded("export", self._publish, snapshot, self.monotonic() - started)
        self.ticks += 1
        self.notifier.watchdog()

    def _sample(self) -> NodeSnapshot:
        spin = self.config.detectors.busy_spin
        snapshot = self.host.annotate(self.source.sample(), lambda gpu: busy_spin.working_now(gpu, spin))
        return self.sampler.annotate(snapshot) if self.sampler is not None else snapshot

    def sample_targets(self) -> list[SampleTarget]:
        """The ranks on the GPUs now that are proven members of a job (never a claim), for the stack sampler."""
        snapshot = self.published.snapshot
        if snapshot is None:
            return []
        proven, _, _ = membership.sorted_out(self.discovery.from_snapshot(snapshot),
                                             self.responder.actions.slurm_job_runs_as)
        return [SampleTarget(r.pid, r.create_time, r.gpus, r.rank, job.key, folder,
                             nccl_inspector.host_of(r.pid, r.env.get("HOSTNAME")) if folder else None)
                for job in proven for r in job.ranks if r.rank is not None
                for folder in (nccl_inspector.log_folder(r.env),)]

    def _detect(self, snapshot: NodeSnapshot) -> list[EpisodeEvent]:
        while not self.verdicts.empty():  # stacks captured since the last tick go back to the verdict
            key, verdict = self.verdicts.get_nowait()
            self.engine.note_stacks(key, verdict)
        steps = self.engine.clock_steps
        events = self.engine.observe(snapshot)
        self._say_uneven()
        if self.engine.clock_steps != steps:
            logfmt.event("clock_stepped_back", level=logfmt.WARNING, seconds=round(self.engine.last_step_seconds, 1),
                         action="detection continues on a shifted timeline")
        return events

    def _say_uneven(self) -> None:
        """Log uneven work once when it appears on a GPU (it is a standing difference, never an episode)."""
        uneven = self.engine.uneven
        for gpu in uneven.keys() - self._uneven:
            u = uneven[gpu]
            logfmt.event("uneven_work", gpu=gpu, rank=u.rank, gap=round(u.gap, 3), why=u.why,
                         summary=u.sentence())
        self._uneven = set(uneven)

    def _unsettled(self) -> list[str]:
        """Open stall episodes not yet critical: their stacks are worth another look now and then."""
        return [ep.identity for ep in self.engine.open_episodes()
                if ep.finding.signature in STACK_SIGNATURES and ep.fired_severity is not Severity.CRITICAL]

    def _guarded(self, component: str, call: Callable[..., T], *args: Any) -> T | None:
        try:
            result = call(*args)
        except Exception as exc:  # the boundary: a failing component never stops the loop
            self._failed(component, exc)
            return None
        self.component_up[component] = True
        return result

    def _failed(self, component: str, exc: Exception) -> None:
        self.component_up[component] = False
        self.counters.inc("component_errors_total", component)
        logfmt.event("component_failed", level=logfmt.ERROR, component=component,
                     error=f"{type(exc).__name__}: {exc}")

    def _remember(self, snapshot: NodeSnapshot) -> None:
        history = self.history
        history.append(snapshot)
        keep = self.config.bundles.telemetry_window_seconds + 120
        while history and snapshot.time_seconds - history[0].time_seconds > keep:
            history.popleft()

    def _act(self, event: EpisodeEvent, snapshot: NodeSnapshot) -> None:
        if event.event is EventKind.SUSPECTED:
            logfmt.event("episode_suspected", level=logfmt.DEBUG, signature=event.signature.value,
                         gpus=gpu_list(event.gpus))
            self.incidents.handle(event, snapshot, self.history)
            return
        if event.event not in (EventKind.RESOLVED, EventKind.RELAPSED):
            self.counters.inc("episodes_total", event.signature.value, event.severity.value)
        level = logfmt.INFO if event.event is EventKind.RESOLVED else logfmt.WARNING
        logfmt.event(f"episode_{event.event.value}", level=level,
                     signature=event.signature.value, severity=event.severity.value, gpus=gpu_list(event.gpus),
                     culprits=gpu_list(event.culprit_gpus) if event.culprit_gpus else None,
                     verdict=event.headline, summary=event.summary)
        self.incidents.handle(event, snapshot, self.history)

    def _publish(self, snapshot: NodeSnapshot | None, tick_seconds: float) -> None:
        episodes = tuple(
            EpisodeView(ep.finding.signature, ep.fired_severity, ep.finding.gpus, ep.finding.culprit_gpus,
                        ep.onset, _slowdown(ep.finding.facts) if ep.finding.signature is Signature.STRAGGLER else None)
            for ep in self.engine.open_episodes())
        ranks = self._ranks(snapshot)
        last = snapshot.time_seconds if snapshot is not None else self.published.last_sample_wall
        up = {**self.component_up, **self.engine.detector_up, **self.incidents.dispatcher.receiver_up()}
        disk = self.published.bundle_disk_bytes
        if self.ticks % 30 == 0 or disk is None:
            disk = self.bundles.disk_bytes()
        alerts = tuple(AlertRow(*row) for row in self.incidents.alerting())
        action = (self.config.actions.mode, self.responder.state)
        ledger = tuple((key, at) for key, at, _ in self.responder.ledger.summary())
        self.published = Published(snapshot or self.published.snapshot, episodes, ranks, alerts, up, last, tick_seconds,
                                   disk, action, ledger, tuple(sorted(self.engine.waits.shares.items())),
                                   tuple((u.gpu, u.why, u.gap) for u in self.engine.uneven.values()))

    def _ranks(self, snapshot: NodeSnapshot | None) -> tuple[RankRow, ...]:
        """gpu, pid, rank, job and workload for rank_info. A process is described once (psutil and /proc),
        then cached by pid and start time: a reused pid is described afresh (host progress reads the start
        time). The pod holding its GPU is the kubelet's latest answer (a dictionary lookup)."""
        if snapshot is None:
            return self.published.ranks
        cache, start_of = self._rank_cache, self.host.start_of
        pids = {pid for g in snapshot.gpus for pid in g.pids}
        for pid in pids:
            start, known = start_of(pid), cache.get(pid)
            if known is None or known[0] != start:
                cache[pid] = (start, *self._describe_rank(pid))
        for gone in cache.keys() - pids:
            del cache[gone]
        rows = []
        for g in snapshot.gpus:
            for pid in g.pids:
                _, rank, job, workload = cache[pid]
                rows.append(RankRow(g.index, pid, rank, job, self.discovery.with_pod(workload, (g.uuid or "",))))
        return tuple(rows)

    def _describe_rank(self, pid: int) -> tuple[int | None, str, Workload]:
        """(rank, job, workload) of a process on a GPU; unknown where it is gone or cannot be read. A
        process that cannot be described costs its own labels, never the node's metrics."""
        try:
            info = self.discovery.describe(pid)
        except Exception as exc:  # the boundary of one rank's description
            self.counters.inc("component_errors_total", "ranks")
            logfmt.event("rank_unreadable", level=logfmt.WARNING, pid=pid, error=f"{type(exc).__name__}: {exc}")
            return None, "", Workload()
        return (info.rank, info.job_key, info.workload) if info is not None else (None, "", Workload())

    # -- health --------------------------------------------------------------------------------------
    def healthy(self) -> tuple[bool, str]:
        last = self.published.last_sample_wall
        if last is None:
            return False, "no sample yet"
        age = self.wall() - last
        if age > self.config.export.stale_after_seconds:
            return False, f"last sample {age:.0f} s ago"
        return True, f"ok: last sample {age:.1f} s ago, {self.ticks} ticks"

    # -- the loop ------------------------------------------------------------------------------------
    def run(self, on_ready: Callable[[], None] | None = None, max_ticks: int | None = None) -> None:
        """Tick every interval on the monotonic clock until stop_requested (or max_ticks)."""
        ticker = Ticker(self.monotonic)
        if self.sampler is not None:
            self.sampler.start()
        if on_ready is not None:
            on_ready()
        while not self.stop_requested.is_set():
            if self.reload_requested.is_set():
                self.reload_requested.clear()
                self.reload()
            self.tick()
            if max_ticks is not None and self.ticks >= max_ticks:
                return
            delay, late = ticker.advance(self.config.sample.interval_seconds)
            if late:
                self.counters.inc("tick_overruns_total")
            if delay > 0:
                self.stop_requested.wait(delay)

    def reload(self) -> bool:
        if self.config_path is None:
            logfmt.event("reload_skipped", reason="started without --config")
            return False
        try:
            new = load_config(self.config_path)
        except ConfigError as exc:
            logfmt.event("reload_rejected", level=logfmt.ERROR, config=self.config_path,
                         problems="; ".join(exc.problems))
            return False
        except Exception as exc:  # whatever the file holds, a reload problem is a rejected reload
            logfmt.event("reload_rejected", level=logfmt.ERROR, config=self.config_path,
                         problems=f"{type(exc).__name__}")
            return False
        changed = [name for name in RELOAD if getattr(new, name) != getattr(self.config, name)]
        self.config = new
        self.engine.reconfigure(new)
        self.incidents.config = new
        self.responder.unready = action_problems(new.actions)
        for problem in self.responder.unready:
            logfmt.event("action_unready", level=logfmt.WARNING, problem=problem)
        self.incidents.capturer.reconfigure(new.stacks)
        if self.sampler is not None:
            self.sampler.cfg = new.stacks
        if self.dumps is not None:
            self.dumps.config = new
        logfmt.event("reloaded", config=self.config_path,
                     applied=",".join(n for n in changed if RELOAD[n] == "reload") or None,
                     restart_needed_for=",".join(n for n in changed if RELOAD[n] == "restart") or None)
        return True

    def shutdown(self, timeout: float = 10.0) -> None:
        self.notifier.stopping()
        if self.sampler is not None:
            self.sampler.stop(0)  # its records are killed with the capturer's, by incidents.close
        self.responder.close()
        self.incidents.close(timeout)
        if self.dumps is not None:
            self.dumps.close()
        self.incidents.dispatcher.close(timeout=min(timeout, 5.0))
        if self.discovery.pods is not None:
            self.discovery.pods.close()
        self.source.close()
        self.host.close()
