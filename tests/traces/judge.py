"""How a labelled trace is judged: replayed through the detectors as the daemon would decide it, then
compared with what a person would call it (recall, latency to the first alert and to critical, episodes
per hang, false criticals, warnings, and the actions the policy would take). bench/accuracy.py prints it
for the whole corpus; tests/detect/test_corpus.py and test_robustness.py hold the line on a few traces."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from tests.traces import perturb
from tests.traces.corpus import Trace, snapshots
from watchdog.act import policy
from watchdog.config import ActionsConfig, Config
from watchdog.detect.engine import DetectorEngine
from watchdog.vocabulary.model import EpisodeEvent, EventKind, NodeSnapshot, Severity, Signature

START = 1.9e9
EXPECTED_SIGNATURE = {"spin": Signature.BUSY_SPIN, "odd": Signature.WAITING, "zero": Signature.ZERO_UTIL}


@dataclass
class Outcome:
    name: str
    cls: str
    healthy_hours: float
    found: bool = False
    alert_latency: float | None = None
    critical_latency: float | None = None
    held: bool = False  # the hang came when the job's rhythm expected a pause: it may wait out the job's pauses
    episodes: int = 0  # distinct episodes alerted from the hang's start on
    critical_episodes: int = 0
    false_criticals: int = 0
    warnings: int = 0
    repeat_warnings: int = 0
    wrong: str = ""  # what it said instead, for a miss
    acts: int = 0  # actions the policy would take in act mode, defaults
    false_acts: int = 0  # with on_telemetry_only, before the hang or in a healthy run


ACT = ActionsConfig(mode="act", pause_file=None)
ACT_ON_TELEMETRY = ActionsConfig(mode="act", pause_file=None, on_telemetry_only=True)


def would_act(events: list[EpisodeEvent], cfg: ActionsConfig, before: float | None) -> int:
    """Actions the policy would take over these events: one decision per critical episode once it has lasted
    after_seconds (its end, or the trace's last event, bounds it), with the evidence a replay has (no stacks:
    not confirmed). Only those whose decision time falls before `before` (a hang's start) when given."""
    ledger, done = policy.Ledger(), 0
    last = max((e.at_seconds for e in events), default=0.0)
    critical: dict[str, EpisodeEvent] = {}
    ended: dict[str, float] = {}
    for e in events:
        if e.severity is Severity.CRITICAL and e.event in (EventKind.FIRED, EventKind.ESCALATED):
            critical.setdefault(e.key, e)
        if e.event is EventKind.RESOLVED:
            ended[e.key] = e.at_seconds
    for key, e in critical.items():
        due = max(e.at_seconds, e.onset_seconds + cfg.after_seconds)
        if due > ended.get(key, last) or (before is not None and due >= before):
            continue
        hang = policy.Hang("replayed", Severity.CRITICAL, e.onset_seconds, due, e.at_seconds, confirmed=False)
        if policy.decide(cfg, hang, ledger).name == "act":
            ledger.record(due, "replayed")
            done += 1
    return done


def alerts(events: list[EpisodeEvent]) -> list[EpisodeEvent]:
    return [e for e in events if e.event in (EventKind.FIRED, EventKind.ESCALATED)]


def judge(trace: Trace, events: list[EpisodeEvent], start: float = START) -> Outcome:
    hang = start + trace.hang_at if trace.hang_at is not None else None
    out = Outcome(trace.name, trace.cls, trace.healthy_seconds / 3600)
    before = [e for e in alerts(events) if hang is None or e.at_seconds < hang]
    out.false_criticals = sum(e.severity is Severity.CRITICAL for e in before)
    warned = [e for e in before if e.event is EventKind.FIRED and e.severity is Severity.WARNING]
    out.warnings, out.repeat_warnings = len(warned), max(0, len(warned) - 1)
    out.acts = would_act(events, ACT, None)
    out.false_acts = would_act(events, ACT_ON_TELEMETRY, hang)
    if hang is None or trace.expect is None:
        return out
    wanted = EXPECTED_SIGNATURE[trace.expect]
    after = [e for e in alerts(events) if e.at_seconds >= hang]
    out.episodes = len({e.key for e in after})
    out.critical_episodes = len({e.key for e in after if e.severity is Severity.CRITICAL})
    hits = [e for e in after if e.signature is wanted and (trace.expect != "odd" or e.culprit_gpus == trace.culprits)]
    if hits:
        out.found = True
        out.alert_latency = hits[0].at_seconds - hang
        critical = [e for e in after if e.severity is Severity.CRITICAL]
        out.critical_latency = critical[0].at_seconds - hang if critical else None
    else:
        out.wrong = "; ".join(f"{e.signature.value}/{e.severity.value} culprits={list(e.culprit_gpus)}"
                              for e in after[:2]) or "nothing"
    return out


def replay(stream: Iterable[NodeSnapshot], engine: DetectorEngine | None = None) -> list[EpisodeEvent]:
    engine = engine or DetectorEngine(Config())
    events: list[EpisodeEvent] = []
    for snapshot in stream:
        events.extend(e for e in engine.observe(snapshot) if e.event is not EventKind.SUSPECTED)
    return events


@dataclass(frozen=True)
class Job:
    trace: Trace
    live: bool = False
    perturbation: tuple[str, ...] = ()
    strength: int = 0


def run_job(job: Job) -> Outcome:
    stream: Iterator[NodeSnapshot] = snapshots(job.trace, START, live=job.live)
    if job.perturbation:
        stream = perturb.apply(stream, job.perturbation, f"{job.trace.seed}:{job.strength}", job.strength)
    engine = DetectorEngine(Config())
    out = judge(job.trace, replay(stream, engine))
    if job.trace.expect in ("odd", "zero"):  # pauses; no pause is recorded after the hang: memory as it was then
        out.held = engine.pause_expected(START + job.trace.hang_at)
    return out
