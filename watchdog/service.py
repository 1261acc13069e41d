"""The composition root: `build(config)` wires every part once, in the order data flows through them, and hands
back the Service that `run`, `demo`, the benches and the tests start, serve and close.

    sources  the GPUs (NVML or a scenario), host progress, the processes on the GPUs, the stack sampler
    detect   the detector engine
    act      alerts, bundles, the incident handler (looks, bundles, alert order), the responder (actions), dumps
    export   the board the loop posts to, /metrics, /healthz and POST /v1/dump

Nothing is attached after it is built: a part that reads what a later one writes reads it from the Board,
which exists before either. `Service.serve()` owns the signals, the threads and one shutdown order.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import threading
import time
from collections.abc import Callable

from watchdog.act import membership
from watchdog.act.actions import Actions
from watchdog.act.alerts import AlertDispatcher, Receiver
from watchdog.act.bundles import BundleStore
from watchdog.act.dump import DumpService
from watchdog.act.incidents import IncidentHandler
from watchdog.act.responder import Responder
from watchdog.boundary import privileges
from watchdog.config import Config
from watchdog.daemon import Board, Daemon, Guard, Source
from watchdog.detect.engine import DetectorEngine
from watchdog.export.metrics import WatchdogCollector, new_counters
from watchdog.export.report import write_for_bundle
from watchdog.export.server import DumpHandler, Endpoint
from watchdog.export.systemd import SystemdNotifier
from watchdog.plumbing import allocator, logfmt
from watchdog.plumbing.signals import SignalEvents
from watchdog.sample import sim
from watchdog.sample.host_progress import HostProgress
from watchdog.sample.kubelet import pod_directory
from watchdog.sample.nvml import NvmlSource
from watchdog.sample.rank_labels import RankLabels
from watchdog.sample.ranks import RankDiscovery
from watchdog.sample.replay import scenario
from watchdog.stacks.capture import StackCapturer
from watchdog.stacks.sampling import RankSampler, SampleTarget
from watchdog.vocabulary.model import Verdict
from watchdog.vocabulary.words import counted


def source_for(config: Config) -> Source:
    """The configured source, not yet opened: the real GPUs, or a scenario played in real time."""
    if config.source.kind == "sim":
        return sim.SimSource(scenario(config.source.scenario), config.sample.interval_seconds,
                             config.source.start_offset_seconds, config.source.pids or None)
    return NvmlSource(call_timeout_seconds=config.sample.nvml_call_timeout_seconds)


def build(config: Config, source: Source | None = None, config_path: str | None = None, *,
          notifier: SystemdNotifier | None = None, receivers: list[Receiver] | None = None,
          discovery: RankDiscovery | None = None, monotonic: Callable[[], float] = time.monotonic,
          wall: Callable[[], float] = time.time) -> Service:
    """Every part from the configuration, in flow order. `source` defaults to the configured one (opened by
    the caller); the keyword arguments are the seams tests and the demo use. Raises ValueError for a receiver's
    secret that cannot be read and EndpointError for the endpoint's (its certificate, password or token):
    `check-config` builds the same parts and reports the same errors."""
    counters = new_counters()
    board = Board()  # written by the loop at the end of each tick; read by the parts below that need it
    guard = Guard(counters)

    # sources
    source = source if source is not None else source_for(config)
    host = HostProgress(monotonic)
    discovery = discovery or RankDiscovery(pods=pod_directory(config.kubernetes))
    capturer = StackCapturer.from_config(config.stacks)  # one py-spy found, one abort stops all its captures
    actions = Actions(config.actions)  # its Slurm check proves a Slurm job's ranks, for sampling and acting

    def targets() -> list[SampleTarget]:  # the proven ranks on the GPUs of the loop's last sample
        return membership.sample_targets(labels.described, actions.slurm_job_runs_as)  # described once, kept

    sampler = RankSampler(capturer, config.stacks, targets, on_problem=lambda pid, problem: logfmt.event(
        "rank_not_sampled", level=logfmt.WARNING, pid=pid or None, problem=problem))

    # detect
    engine = DetectorEngine(config, on_error=guard.failed)

    # act
    verdicts: queue.SimpleQueue[tuple[str, Verdict]] = queue.SimpleQueue()
    try:
        dispatcher = AlertDispatcher(config.alerts, counters, receivers)
    except ValueError as exc:
        raise ValueError(f"alerts: {exc}") from None
    bundles = BundleStore(config.bundles, counters, render_report=write_for_bundle)
    incidents = IncidentHandler(config, counters, dispatcher, bundles, capturer, discovery,
                                inventory=getattr(source, "inventory", None),
                                on_verdict=lambda key, verdict: verdicts.put((key, verdict)), monotonic=monotonic,
                                slurm_check=actions.slurm_job_runs_as)
    responder = Responder(incidents, counters, actions, monotonic)  # its unready actions are said at start
    dumps = DumpService(config, counters, capturer, discovery, bundles, lambda: board.published.snapshot,
                        incidents.node, monotonic, last_look=incidents.last_look,
                        slurm_check=actions.slurm_job_runs_as, pace=lambda: board.published.slow_gpus())

    # export
    labels = RankLabels(discovery, host.start_of, counters,
                        prove=lambda found: membership.proofs(found, actions.slurm_job_runs_as))
    daemon = Daemon(config, source, host=host, sampler=sampler, labels=labels,
                    engine=engine, guard=guard, incidents=incidents, responder=responder, dumps=dumps, board=board,
                    counters=counters, verdicts=verdicts, notifier=notifier or SystemdNotifier(), monotonic=monotonic,
                    wall=wall, config_path=config_path)
    collector = WatchdogCollector(lambda: board.published, counters, config.export.series)
    endpoint = Endpoint(config.export, collector.exposition, daemon.healthy,
                        _dump_handler(dumps) if config.dump.enabled else None, config.dump)
    return Service(daemon, endpoint, collector, discovery)


def _dump_handler(dumps: DumpService) -> DumpHandler:
    def handle(body: bytes) -> tuple[int, dict[str, object], int | None]:
        answer = dumps.handle(body)
        return answer.status, answer.body, answer.retry_after
    return handle


class Service:
    """The daemon, its endpoint and what they hold open, started and stopped in one order."""

    def __init__(self, daemon: Daemon, endpoint: Endpoint, collector: WatchdogCollector, discovery: RankDiscovery):
        self.daemon, self.endpoint, self.discovery = daemon, endpoint, discovery
        self.exposition = collector.exposition  # what GET /metrics serves

    def start(self) -> None:
        """Listen (EndpointError if it cannot), say what is short, and start sampling the ranks' stacks."""
        allocator.large_blocks_apart()  # a long-running process: its large blocks never fragment the heaps
        self.daemon.responder.say_unready()
        for short in privileges.shortfalls(stacks=True, terminate=False):
            logfmt.event("privileges_short", level=logfmt.WARNING, problem=short.text())
        self.endpoint.start()
        self.daemon.sampler.start()

    def run(self, max_ticks: int | None = None) -> None:
        """The loop, until stop() (or max_ticks); tells systemd it is ready once it starts."""
        self.daemon.run(on_ready=self._ready, max_ticks=max_ticks)

    def serve(self, max_ticks: int | None = None) -> None:
        """`run`: start, stop on SIGTERM or SIGINT, reload on SIGHUP, loop, then close everything (also when the
        endpoint cannot listen: EndpointError)."""
        daemon = self.daemon
        wiring = {signal.SIGTERM: daemon.stop_requested, signal.SIGINT: daemon.stop_requested,
                  signal.SIGHUP: daemon.reload_requested}
        on_main = threading.current_thread() is threading.main_thread()
        with SignalEvents(wiring, restore=False) if on_main else contextlib.nullcontext():  # `run` ends with it
            try:
                self.start()
                self.run(max_ticks)
            finally:
                logfmt.event("stopping", ticks=daemon.ticks)
                self.close()

    def stop(self) -> None:
        self.daemon.stop_requested.set()

    def close(self, timeout: float = 10.0) -> None:
        """Everything in one order: the endpoint stops answering, then the sampler, the actions, the incident
        workers and dumps, the alert queue (drained for up to 5 s), the kubelet client, the source."""
        daemon = self.daemon
        self.endpoint.stop()
        daemon.notifier.stopping()
        daemon.sampler.stop(0)  # its records are killed with the capturer's, by incidents.close
        daemon.responder.close()
        daemon.incidents.close(timeout)
        daemon.dumps.close()
        daemon.incidents.dispatcher.close(timeout=min(timeout, 5.0))
        if self.discovery.pods is not None:
            self.discovery.pods.close()
        daemon.source.close()
        daemon.host.close()

    def _ready(self) -> None:
        daemon, config = self.daemon, self.daemon.config
        url = self.endpoint.url if self.endpoint.listening else None
        daemon.notifier.ready(f"watching {counted(daemon.source.gpu_count, 'GPU')} ({config.source.kind}); "
                              f"metrics on {url}")
        logfmt.event("started", gpus=daemon.source.gpu_count, source=config.source.kind, metrics=url,
                     bundles=config.bundles.directory, systemd=daemon.notifier.enabled or None)
