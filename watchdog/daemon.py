"""The daemon's loop: every interval on the monotonic clock, without drift,

    tick() = sample -> detect -> act -> export

Each component runs inside one guarded boundary (Guard) that counts and logs its failures, so nothing stops
the loop: NVML calls are time-bounded in the source, stack captures, bundles and alert deliveries run off the
loop. The loop itself pings systemd's watchdog, so a wedged loop gets the service restarted. A reload (SIGHUP,
through watchdog/service.py) applies a new configuration to the parts that read it (RELOAD); an invalid one is
rejected with its problems and the old one stays. The parts are built and handed in by watchdog/service.py.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Collection
from typing import Any, Protocol, TypeVar

from watchdog.act.dump import DumpService
from watchdog.act.incidents import IncidentHandler
from watchdog.act.kept_telemetry import KeptTelemetry
from watchdog.act.responder import Responder
from watchdog.config import Config, ConfigError, load_config
from watchdog.detect import busy_spin
from watchdog.detect.engine import DetectorEngine
from watchdog.detect.severity import STACK_SIGNATURES
from watchdog.export.metrics import AlertRow, EpisodeView, Published
from watchdog.export.systemd import SystemdNotifier
from watchdog.plumbing import allocator, logfmt
from watchdog.plumbing.counters import Counters
from watchdog.plumbing.schedule import Ticker
from watchdog.sample.host_progress import HostProgress
from watchdog.sample.rank_labels import RankLabels, RankRow
from watchdog.stacks.sampling import RankSampler
from watchdog.vocabulary.model import EpisodeEvent, EventKind, GpuHealth, NodeSnapshot, Severity, Signature, Verdict
from watchdog.vocabulary.words import gpu_list

T = TypeVar("T")


class Source(Protocol):
    driver_version: str | None

    @property
    def gpu_count(self) -> int: ...

    def open(self) -> None: ...

    def sample(self) -> NodeSnapshot: ...

    def close(self) -> None: ...


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


class Board:
    """Where the loop posts what it published: written once a tick, read by /metrics, the dump answer and the
    stack sampler's choice of ranks (one reference swapped, never a half-written state)."""

    def __init__(self) -> None:
        self.published = Published()


class Guard:
    """Each component's boundary: a failure is counted and logged and never stops the loop; whether each
    component worked the last time it ran is kept for stall_watchdog_component_up."""

    def __init__(self, counters: Counters):
        self.counters = counters
        self.up: dict[str, bool] = {}

    def call(self, component: str, call: Callable[..., T], *args: Any) -> T | None:
        try:
            result = call(*args)
        except Exception as exc:  # the boundary: a failing component never stops the loop
            self.failed(component, exc)
            return None
        self.up[component] = True
        return result

    def failed(self, component: str, exc: Exception) -> None:
        self.up[component] = False
        self.counters.inc("component_errors_total", component)
        logfmt.event("component_failed", level=logfmt.ERROR, component=component,
                     error=f"{type(exc).__name__}: {exc}")


# While every open episode is already critical (the page is out, nothing below it waits to be decided), the ticks
# are judged in batches this many times batch_seconds: its end, or a new sign elsewhere, is seen that much later.
PAGED_BATCHES = 1.5
# Open below critical, these are judged every tick: a stall, or a lost GPU, each critical within seconds.
_JUDGED_EACH_TICK = frozenset({*STACK_SIGNATURES, Signature.GPU_LOST})


class Daemon:
    """The loop over the parts watchdog/service.py built: the source and what annotates its samples (host progress,
    the stack sampler), the detector engine, the incident handler and the responder, and the board the export
    side reads."""

    def __init__(self, config: Config, source: Source, *, host: HostProgress, sampler: RankSampler,
                 labels: RankLabels, engine: DetectorEngine, guard: Guard, incidents: IncidentHandler,
                 responder: Responder, dumps: DumpService, board: Board, counters: Counters,
                 verdicts: queue.SimpleQueue[tuple[str, Verdict]], notifier: SystemdNotifier,
                 monotonic: Callable[[], float], wall: Callable[[], float], config_path: str | None = None):
        self.config, self.config_path = config, config_path
        self.source, self.host, self.sampler, self.labels = source, host, sampler, labels
        self.engine, self.guard = engine, guard
        self.incidents, self.responder, self.dumps = incidents, responder, dumps  # looks and alerts; the actions
        self.bundles = incidents.bundles
        self.board, self.counters, self.verdicts = board, counters, verdicts  # verdicts: from the stack workers
        self.notifier, self.monotonic, self.wall = notifier, monotonic, wall
        self.history = KeptTelemetry()  # for the incident bundles
        self._unjudged: list[NodeSnapshot] = []  # ticks sampled and not yet judged (sample.batch_seconds)
        self.stop_requested = threading.Event()
        self.reload_requested = threading.Event()
        self.ticks = 0
        self._uneven: set[int] = set()  # GPUs said to hold uneven work (logged once while it lasts)
        self._answering: frozenset[int] = frozenset()  # the GPUs whose last sample was whole (GpuHealth.OK)

    @property
    def published(self) -> Published:
        return self.board.published

    @published.setter
    def published(self, value: Published) -> None:
        self.board.published = value

    # -- one tick ----------------------------------------------------------------------------------
    def tick(self) -> None:
        started = self.monotonic()
        snapshot = self.guard.call("sample", self._sample)
        if snapshot is not None:
            self._remember(snapshot)
            self._unjudged.append(snapshot)
            if self._judge_due(snapshot):
                self._judge(snapshot)
            self.guard.call("act", self.responder.consider, snapshot)
        self.guard.call("export", self._publish, snapshot, self.monotonic() - started)
        self.ticks += 1
        self.notifier.watchdog()

    def flush(self) -> None:
        """Judge the ticks not judged yet (the end of a bounded run; a daemon asked to stop starts nothing new)."""
        if self._unjudged:
            self._judge(self._unjudged[-1])

    def _judge_due(self, snapshot: NodeSnapshot) -> bool:
        """Whether the ticks held are judged now: batch_seconds of them are held (PAGED_BATCHES times that while
        every open episode is critical), a stall or a lost GPU is suspected or warned of (judged every tick
        until it is critical or ends), the stacks' verdict on one came back, or a GPU was lost, hung or came back
        in the newest tick: no batch holds back a page that is due within seconds."""
        sample = self.config.sample
        answering = frozenset(gpu.index for gpu in snapshot.gpus if gpu.health is GpuHealth.OK)
        changed, self._answering = answering != self._answering, answering
        if changed or not self.verdicts.empty() or self._below_critical(_JUDGED_EACH_TICK):
            return True
        episodes = self.engine.open_episodes()
        paged = bool(episodes) and all(ep.fired_severity is Severity.CRITICAL for ep in episodes)
        return len(self._unjudged) * sample.interval_seconds >= sample.batch_seconds * (PAGED_BATCHES if paged else 1)

    def _judge(self, snapshot: NodeSnapshot) -> None:
        """Detect over the ticks held, act on what they show (`snapshot`: the newest), and look again at the stalls
        not yet settled."""
        ticks, self._unjudged = self._unjudged, []
        events = self.guard.call("detect", self._detect, ticks) or []
        for event in events:
            self.guard.call("act", self._act, event, snapshot)
        self.guard.call("act", self.incidents.forget, self.engine.episode_keys())
        self.guard.call("act", self.incidents.recheck, self._unsettled(), snapshot)

    def _sample(self) -> NodeSnapshot:
        """A tick's sample, with its ranks' host progress: read every tick where a GPU does no work of its own,
        and less often on GPUs at work or already paged for (their rates stand in between: host_progress.py)."""
        spin = self.config.detectors.busy_spin
        paged = {gpu for ep in self.engine.open_episodes() if ep.fired_severity is Severity.CRITICAL
                 for gpu in ep.finding.gpus}
        snapshot = self.host.annotate(self.source.sample(),
                                      lambda gpu: gpu.index in paged or busy_spin.working_now(gpu, spin))
        return self.sampler.annotate(snapshot)

    def _detect(self, ticks: list[NodeSnapshot]) -> list[EpisodeEvent]:
        while not self.verdicts.empty():  # stacks captured since the last tick go back to the verdict
            key, verdict = self.verdicts.get_nowait()
            self.engine.note_stacks(key, verdict)
        clock = self.engine.clock
        steps, jumps = clock.steps, clock.jumps
        events = self.engine.observe(ticks)
        self._say_uneven()
        if clock.steps != steps:
            logfmt.event("clock_stepped_back", level=logfmt.WARNING, seconds=round(clock.last_step_seconds, 1),
                         action="detection continues from where the clock was")
        if clock.jumps != jumps:
            logfmt.event("clock_jumped_forward", level=logfmt.WARNING, seconds=round(clock.last_jump_seconds, 1),
                         action="the jump is a gap, not time observed: no stall is older for it")
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
        return self._below_critical(STACK_SIGNATURES)

    def _below_critical(self, signatures: Collection[Signature]) -> list[str]:
        """The open episodes of these signatures not yet critical."""
        return [ep.identity for ep in self.engine.open_episodes()
                if ep.finding.signature in signatures and ep.fired_severity is not Severity.CRITICAL]

    def _remember(self, snapshot: NodeSnapshot) -> None:
        self.history.append(snapshot, self.config.bundles.telemetry_window_seconds + 120)

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
        up = {**self.guard.up, **self.engine.detector_up, **self.incidents.dispatcher.receiver_up()}
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
        """gpu, pid, rank, job and workload for rank_info (sample/rank_labels.py)."""
        if snapshot is None:
            return self.published.ranks
        return tuple(self.labels.of(snapshot))

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
        trimmed = self.monotonic()
        if on_ready is not None:
            on_ready()
        while not self.stop_requested.is_set():
            if self.reload_requested.is_set():
                self.reload_requested.clear()
                self.reload()
            self.tick()
            if self.monotonic() - trimmed >= allocator.TRIM_SECONDS:  # resident memory back to what is in use
                trimmed = self.monotonic()
                allocator.release_free_memory()
            if max_ticks is not None and self.ticks >= max_ticks:
                self.guard.call("detect", self.flush)  # a bounded run judges every tick it sampled
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
        try:  # first, as it is the one part that can refuse (a py-spy command that is not there): nothing half-done
            self.incidents.capturer.reconfigure(new.stacks)
        except ValueError as exc:
            logfmt.event("reload_rejected", level=logfmt.ERROR, config=self.config_path, problems=str(exc))
            return False
        changed = [name for name in RELOAD if getattr(new, name) != getattr(self.config, name)]
        self.config = new
        self.engine.reconfigure(new)
        self.incidents.config = new
        self.responder.reconfigure()
        self.responder.say_unready()
        self.sampler.cfg = new.stacks
        self.dumps.config = new
        logfmt.event("reloaded", config=self.config_path,
                     applied=",".join(n for n in changed if RELOAD[n] == "reload") or None,
                     restart_needed_for=",".join(n for n in changed if RELOAD[n] == "restart") or None)
        return True
