"""One job's picture: observe its ranks' host activity, capture their stacks, analyse, decide.

This is what `stacks dump` prints and what an incident bundle holds. It is also how saved dumps
are analysed (`stacks analyze`), without the live parts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from watchdog.boundary import private_files
from watchdog.config import StacksConfig
from watchdog.sample.proc_counters import HostActivity
from watchdog.sample.ranks import Job, RankDiscovery
from watchdog.stacks import fr_matching, nccl_ras
from watchdog.stacks.analysis import Analysis, analyze
from watchdog.stacks.capture import OK, Capture, StackCapturer, Target
from watchdog.stacks.flight_recorder import FlightRecorder, collect, trigger
from watchdog.stacks.fr_dumps import RankTrace
from watchdog.stacks.fr_matching import FlightRecorderAnalysis
from watchdog.stacks.ras_report import RasFinding
from watchdog.stacks.timeout_verdict import TimeoutFinding
from watchdog.stacks.verdict import verdict
from watchdog.vocabulary.model import Verdict
from watchdog.vocabulary.stack_model import StackDump, member_id


@dataclass
class StackPicture:
    job: str
    world_size: int | None
    spans_other_nodes: bool
    analysis: Analysis
    verdict: Verdict
    captures: list[Capture] = field(default_factory=list)
    host: dict[str, HostActivity] = field(default_factory=dict)  # per member, over the observation
    observed_seconds: float = 0.0
    flight_recorder: list[FlightRecorder] = field(default_factory=list)
    traces: list[RankTrace] = field(default_factory=list)  # the Flight Recorder dumps read back
    fr: FlightRecorderAnalysis | None = None
    ras: RasFinding | None = None
    timeouts: TimeoutFinding | None = None  # NCCL watchdog timeout logs (`analyze`)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"job": self.job, "world_size": self.world_size,
                                  "spans_other_nodes": self.spans_other_nodes}
        out.update(self.analysis.to_json())
        out["verdict"] = self.verdict.to_json()
        if self.captures:
            out["captures"] = [c.to_json() for c in self.captures]
        if self.host:
            out["host_activity"] = {m: {"cpu_seconds": round(h.cpu_seconds, 3), "read_bytes": h.read_bytes,
                                        "write_bytes": h.write_bytes, "threads": dict(h.threads)}
                                    for m, h in self.host.items()}
            out["observed_seconds"] = round(self.observed_seconds, 3)
        if self.flight_recorder:
            out["flight_recorder"] = [f.to_json() for f in self.flight_recorder]
        if self.fr is not None:
            out["flight_recorder_analysis"] = self.fr.to_json()
        if self.ras is not None:
            out["nccl_ras"] = self.ras.to_json()
        if self.timeouts is not None:
            out["nccl_timeouts"] = self.timeouts.to_json()
        return out


@dataclass(frozen=True)
class Corroboration:
    """Ranks a source beyond the stacks names as the ones the job waits on, and its finding in full."""

    source: str  # "Flight Recorder" | "NCCL RAS"
    culprits: tuple[int, ...]
    finding: str  # the source's sentence, which begins with the source's name

    def who(self) -> str:
        return named_by(self.culprits, self.source)


def named_by(culprits: Sequence[int], source: str) -> str:
    """'rank 3 (Flight Recorder)', 'ranks 3, 5 (NCCL RAS)': built from the fields, never from a sentence. At
    most 12 are listed ('and 32,740 more'): a node of a 4,096-node job can see every other rank as missing."""
    listed = ", ".join(map(str, culprits[:_NAMED]))
    more = f" and {len(culprits) - _NAMED:,} more" if len(culprits) > _NAMED else ""
    return f"{'rank' if len(culprits) == 1 else 'ranks'} {listed}{more} ({source})"


_NAMED = 12


def corroborations(fr: FlightRecorderAnalysis | None, ras_culprits: Sequence[int] = (),
                   ras_summary: str | None = None) -> list[Corroboration]:
    """What the Flight Recorder and NCCL RAS add to a verdict, each where it names a culprit (the RAS
    finding only when conclusive: pass its culprits and summary then)."""
    found = [Corroboration("Flight Recorder", fr.culprits, fr.summary)] if fr is not None and fr.culprits else []
    if ras_summary and ras_culprits:
        found.append(Corroboration("NCCL RAS", tuple(ras_culprits), ras_summary))
    return found


def corroborated(decided: Verdict, found: Sequence[Corroboration]) -> Verdict:
    """The corroborating findings join the verdict: in its sentence always, and in its headline when the
    local stacks could only say "the culprit is likely on another node"."""
    joined = decided.noted([c.finding for c in found])
    if found and decided.kind == "remote":
        return replace(joined, headline="the job waits on " + found[0].who())
    return joined


def with_job_evidence(decided: Verdict, fr: FlightRecorderAnalysis | None, ras: RasFinding | None) -> Verdict:
    if ras is not None and ras.conclusive:
        return corroborated(decided, corroborations(fr, ras.culprits, ras.summary))
    return corroborated(decided, corroborations(fr))


def capture_job(job: Job, capturer: StackCapturer, discovery: RankDiscovery, cfg: StacksConfig,
                node: str = "", read_at: float | None = None) -> StackPicture:
    """Everything the ranks of one job on this node can tell, gathered at once: the stacks (py-spy),
    the host activity over `observe_seconds`, the Flight Recorder dumps (asked through the debug pipe
    and read back) and NCCL RAS's view of the whole job (two queries, in the background meanwhile).
    `read_at`: the monotonic time the job's ranks' activity was read, when that was before this call (a
    second look over ranks found at the first): the host activity then covers the time since."""
    started, asked_at = time.monotonic(), time.time()
    since = started if read_at is None else read_at
    ranks = job.ranks
    ras: list[RasFinding] = []
    where = nccl_ras.where_to_ask([r.env for r in ranks]) if cfg.nccl_ras else None
    asking = threading.Thread(target=lambda: ras.append(nccl_ras.ask_twice(
        *where, cfg.nccl_ras_gap_seconds, cfg.nccl_ras_timeout_seconds, pids=[r.pid for r in ranks],
        proc_root=discovery.proc_root)), daemon=True) if where else None
    if asking is not None:
        asking.start()
    recorders = [trigger(r, discovery.proc_root) for r in ranks] if cfg.flight_recorder else []
    captures = capturer.capture(Target(r.pid, r.rank, r.gpus) for r in ranks)
    remaining = cfg.observe_seconds - (time.monotonic() - started)
    if remaining > 0:
        time.sleep(remaining)
    observed = time.monotonic() - since
    host: dict[str, HostActivity] = {}
    dumps: list[StackDump] = []
    for rank, capture in zip(ranks, captures):
        if capture.result == OK and capture.dump is not None:
            dumps.append(capture.dump)
        after = discovery.describe(rank.pid, rank.gpus, expect_create_time=rank.create_time)
        if after is not None and after.activity is not None and rank.activity is not None:
            member = capture.dump.member if capture.dump is not None else member_id(rank.pid, rank.rank)
            host[member] = after.activity.since(rank.activity)
    analysis = analyze(dumps)
    traces, _ = collect(recorders, asked_at, cfg.flight_recorder_wait_seconds, discovery.proc_root, node)
    fr = fr_matching.analyze(traces) if traces else None
    if asking is not None:
        asking.join(cfg.nccl_ras_gap_seconds + 2 * cfg.nccl_ras_timeout_seconds + 10)
    finding = ras[0] if ras else None
    decided = with_job_evidence(verdict(analysis, host, observed, job.spans_other_nodes), fr, finding)
    failed = [c for c in captures if c.result != OK]
    if failed and not dumps:  # the reason belongs in the sentence every reader gets, not only in the bundle
        decided = decided.noted([f"No stack was captured ({len(failed)} of {len(captures)} ranks): "
                                 f"{failed[0].message.split(' (')[0]}"])
    return StackPicture(job.key, job.world_size, job.spans_other_nodes, analysis, decided, captures, host, observed,
                        [f for f in recorders if f.result != "not_configured"], traces, fr, finding)


def capture_file_name(target: Target) -> str:
    """One name for a rank's raw py-spy JSON, in `stacks dump --out` folders and in bundles."""
    return f"rank-{target.rank}-pid-{target.pid}.json" if target.rank is not None else f"pid-{target.pid}.json"


def write_captures(directory: str | Path, report: StackPicture) -> list[Path]:
    """Raw py-spy JSON per rank plus the analysis, files 0600 (stacks name paths and functions)."""
    folder = Path(directory)
    private_files.make_dir(folder, parents=True)
    written = []
    for capture in report.captures:
        if capture.raw is None:
            continue
        target = capture.target
        written.append(private_files.write_json(folder / capture_file_name(target),
                                                {"pid": target.pid, "rank": target.rank, "gpus": list(target.gpus),
                                                 "training_job": report.job, "threads": capture.raw},
                                                replace=True))
    written.append(private_files.write_json(folder / "analysis.json", report.to_json(), replace=True))
    return written
