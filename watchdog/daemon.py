"""The daemon: the one place where the parts meet.

    tick() = sample -> detect -> act -> export

Sampling runs on the monotonic clock without drift. Each component runs inside one guarded boundary
that counts and logs its failures, so nothing stops the loop: NVML calls are time-bounded in the
source, stack captures, bundles and alert deliveries run off the loop. The loop itself pings systemd's
watchdog, so a wedged loop gets the service restarted. SIGHUP reloads the configuration (an invalid one
is rejected with its problems and the old one stays); SIGTERM/SIGINT stop cleanly.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from prometheus_client.registry import CollectorRegistry

from watchdog import logfmt
from watchdog.act.alerts import AlertDispatcher
from watchdog.act.bundles import BundleStore
from watchdog.act.incidents import IncidentHandler
from watchdog.config import Config, ConfigError, load_config
from watchdog.detect.engine import DetectorEngine
from watchdog.export.metrics import Counters, EpisodeView, Published, WatchdogCollector
from watchdog.export.systemd import SystemdNotifier
from watchdog.model import EpisodeEvent, EventKind, NodeSnapshot, gpu_list
from watchdog.sample.ranks import RankDiscovery

T = TypeVar("T")


class Source(Protocol):
    driver_version: str | None

    @property
    def gpu_count(self) -> int: ...

    def open(self) -> None: ...

    def sample(self) -> NodeSnapshot: ...

    def close(self) -> None: ...


class Daemon:
    def __init__(self, config: Config, source: Source, config_path: str | None = None,
                 notifier: SystemdNotifier | None = None, incidents: IncidentHandler | None = None,
                 monotonic: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.config = config
        self.config_path = config_path
        self.source = source
        self.notifier = notifier or SystemdNotifier()
        self.monotonic, self.wall = monotonic, wall
        self.counters = Counters()
        self.engine = DetectorEngine(config)
        self.bundles = BundleStore(config.bundles, self.counters)
        self.incidents = incidents or IncidentHandler(config, self.counters, AlertDispatcher(config.alerts,
                                                                                               self.counters),
                                                      self.bundles)
        self.registry = CollectorRegistry()
        self.registry.register(WatchdogCollector(lambda: self.published, self.counters))
        self.published = Published()
        self.history: deque[NodeSnapshot] = deque()
        self.component_up: dict[str, bool] = {}
        self.stop_requested = threading.Event()
        self.reload_requested = threading.Event()
        self.ticks = 0
        self.discovery = RankDiscovery()
        self._rank_cache: dict[int, tuple[int | None, str]] = {}  # pid -> (rank, job)

    # -- one tick ----------------------------------------------------------------------------------
    def tick(self) -> None:
        started = self.monotonic()
        snapshot = self._guarded("sample", self.source.sample)
        events: list[EpisodeEvent] = []
        if snapshot is not None:
            self._remember(snapshot)
            events = self._guarded("detect", self.engine.observe, snapshot) or []
            for event in events:
                self._guarded("act", self._act, event, snapshot)
        self._guarded("export", self._publish, snapshot, self.monotonic() - started)
        self.ticks += 1
        self.notifier.watchdog()

    def _guarded(self, component: str, call: Callable[..., T], *args: Any) -> T | None:
        try:
            result = call(*args)
        except Exception as exc:  # the boundary: a failing component never stops the loop
            self.component_up[component] = False
            self.counters.inc("component_errors_total", component)
            logfmt.event("component_failed", level=40, component=component, error=f"{type(exc).__name__}: {exc}")
            return None
        self.component_up[component] = True
        return result

    def _remember(self, snapshot: NodeSnapshot) -> None:
        history = self.history
        history.append(snapshot)
        keep = self.config.bundles.telemetry_window_seconds + 120
        while history and snapshot.time_seconds - history[0].time_seconds > keep:
            history.popleft()

    def _act(self, event: EpisodeEvent, snapshot: NodeSnapshot) -> None:
        if event.event is not EventKind.RESOLVED:
            self.counters.inc("episodes_total", event.signature.value, event.severity.value)
        logfmt.event(f"episode_{event.event.value}", level=30 if event.event is not EventKind.RESOLVED else 20,
                     signature=event.signature.value, severity=event.severity.value, gpus=gpu_list(event.gpus),
                     culprits=gpu_list(event.culprit_gpus) if event.culprit_gpus else None, summary=event.summary)
        self.incidents.handle(event, snapshot, self.history)

    def _publish(self, snapshot: NodeSnapshot | None, tick_seconds: float) -> None:
        episodes = tuple(
            EpisodeView(ep.finding.signature, ep.fired_severity, ep.finding.gpus, ep.finding.culprit_gpus,
                        ep.onset)
            for ep in self.engine.tracker.episodes.values())
        ranks = self._ranks(snapshot)
        last = snapshot.time_seconds if snapshot is not None else self.published.last_sample_wall
        self.published = Published(snapshot or self.published.snapshot, episodes, ranks,
                                   dict(self.component_up), last, tick_seconds, self.bundles.disk_bytes()
                                   if self.ticks % 30 == 0 or self.published.bundle_disk_bytes is None
                                   else self.published.bundle_disk_bytes)

    def _ranks(self, snapshot: NodeSnapshot | None) -> tuple[tuple[int, int, int | None, str], ...]:
        """gpu, pid, rank, job for rank_info. A pid is described once (psutil and /proc), then cached."""
        if snapshot is None:
            return self.published.ranks
        pids = {pid for g in snapshot.gpus for pid in g.pids}
        for pid in pids - self._rank_cache.keys():
            info = self.discovery.describe(pid)
            self._rank_cache[pid] = (info.rank, info.job_key) if info is not None else (None, "")
        for gone in self._rank_cache.keys() - pids:
            del self._rank_cache[gone]
        return tuple((g.index, pid, *self._rank_cache[pid]) for g in snapshot.gpus for pid in g.pids)

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
        next_tick = self.monotonic()
        if on_ready is not None:
            on_ready()
        while not self.stop_requested.is_set():
            if self.reload_requested.is_set():
                self.reload_requested.clear()
                self.reload()
            self.tick()
            if max_ticks is not None and self.ticks >= max_ticks:
                return
            interval = self.config.sample.interval_seconds
            next_tick += interval
            delay = next_tick - self.monotonic()
            if delay < 0:
                self.counters.inc("tick_overruns_total")
                if delay < -interval:  # more than a tick behind: skip ahead rather than bunch up
                    next_tick = self.monotonic()
                continue
            self.stop_requested.wait(delay)

    def reload(self) -> bool:
        if self.config_path is None:
            logfmt.event("reload_skipped", reason="started without --config")
            return False
        try:
            new = load_config(self.config_path)
        except ConfigError as exc:
            logfmt.event("reload_rejected", level=40, config=self.config_path, problems="; ".join(exc.problems))
            return False
        unchanged_until_restart = [name for name in ("source", "export", "alerts", "bundles")
                                   if getattr(new, name) != getattr(self.config, name)]
        self.config = new
        self.engine.reconfigure(new)
        self.incidents.config = new
        logfmt.event("reloaded", config=self.config_path,
                     restart_needed_for=",".join(unchanged_until_restart) or None)
        return True

    def shutdown(self, timeout: float = 10.0) -> None:
        self.notifier.stopping()
        self.incidents.close(timeout)
        self.incidents.dispatcher.close(timeout=min(timeout, 5.0))
        self.source.close()
