"""Stack samples of every proven rank, all the time and cheaply: how much of its time each rank spends waiting
for its peers (detect/rank_waits.py names the one they wait for).

Every `stacks.sample_seconds`, one `py-spy record --nonblocking` per rank chosen for the round (stacks/capture.py)
takes `stacks.sample_rate_hz` samples a second of it without pausing it. A round records at most
`stacks.max_parallel` ranks, each job its share (a job with more ranks takes turns among them), so a node with
hundreds of small ranks does not stretch every job's rounds; a rank whose record py-spy cannot finish (300 threads
500 frames deep) sits out 1, 2, 4, up to 8 rounds after each such record, and is said once.

Each sample of the rank's main thread (the
thread whose id is the process's: not a name the rank chooses) is classified (stacks/classify.py): inside a
collective or a sync (waiting), in planned extra work (checkpoint I/O, evaluation), or anything else. The
counts add up per process (its pid and start time); the samples of its first `stacks.sample_learn_seconds`
are also kept apart, as how it was before. annotate() puts them on the GPU samples (GpuSample.rank_waits), so
that they are recorded and replayed like any other reading.

The ranks are those the caller proves (act/membership.py: the launcher's tree, slurmstepd's cgroup, the
kubelet), with the job each belongs to: a rank is only compared with its own job's. What a record prints is
the rank's to choose (its function and file names): it is read through a bounded pipe, at most
MAX_RECORD_BYTES, and a line that does not parse counts for nothing.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from watchdog.boundary.rank_files import RankFileError
from watchdog.config import StacksConfig
from watchdog.stacks.capture import FAILED, OK, TIMEOUT, StackCapturer
from watchdog.stacks.classify import CHECKPOINT_IO, COLLECTIVE, EVALUATION, classify
from watchdog.stacks.nccl_inspector import InspectorTail
from watchdog.vocabulary.model import RANK_WAITS, NodeSnapshot
from watchdog.vocabulary.stack_model import Frame, ThreadStack

_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^():]*)(?::(?P<line>\d+))?\)$")  # "f (file[:line])"
_PLANNED = {CHECKPOINT_IO, EVALUATION}
_MOST_RESTED = 8  # rounds a rank whose records py-spy cannot finish sits out, at most (doubling from 1)
WAITING, PLANNED, WORKING = "waiting", "planned", "working"


@dataclass(frozen=True)
class SampleTarget:
    """A proven rank: its process (pid and start time), GPUs, rank and job."""

    pid: int
    start: float
    gpus: tuple[int, ...]
    rank: int
    job: str  # what proves its job (act/membership.py ProvenJob.key): the Slurm job, the pod's UID, the launcher
    inspector: str | None = None  # the folder of its NCCL Inspector log, where it enables one
    host: str | None = None  # the host name it sees (names that log: nccl_inspector.host_of)


class _Counts:
    __slots__ = ("target", "samples", "waits", "planned", "first_samples", "first_waits", "learn_until", "at")

    def __init__(self, target: SampleTarget, learn_until: float):
        self.target, self.learn_until = target, learn_until
        self.samples = self.waits = self.planned = self.first_samples = self.first_waits = 0
        self.at = 0.0  # when its counts last moved

    def add(self, kinds: dict[str, int], now: float) -> None:
        total = sum(kinds.values())
        self.samples += total
        self.waits += kinds.get(WAITING, 0)
        self.planned += kinds.get(PLANNED, 0)
        if now <= self.learn_until:
            self.first_samples += total
            self.first_waits += kinds.get(WAITING, 0)
        self.at = now

    def reading(self, job: int) -> tuple[int, ...]:
        """Its counts as GpuSample.rank_waits holds them (model.RANK_WAITS, in that order); `job` the number
        this daemon gave its proven job."""
        values = {"job": job, "rank": self.target.rank,
                  "samples": self.samples, "waits": self.waits, "planned": self.planned,
                  "first_samples": self.first_samples, "first_waits": self.first_waits}
        return tuple(values[name] for name in RANK_WAITS)


# "thread (<id>)", then ": <name>" where the thread has one, then ";<frame>" each, then " <count>"
_LINE = re.compile(r"thread \((?P<tid>[0-9]{1,10})\)(?P<stack>[:;].*) (?P<count>[0-9]{1,12})", re.ASCII)


def main_thread_samples(data: bytes, pid: int, most: int) -> dict[str, int] | None:
    """The samples of a raw record (`thread (<id>): <name>;<frame>;...;<frame> <count>` lines, outermost frame
    first, the name only where the thread has one) of the thread whose id is `pid`, by what they show: waiting,
    planned or working. None (nothing of the record believed) where a line does not parse, or its main thread holds
    more than `most` samples (the record's length at its rate): both are what a thread name with a new line in it
    leaves, and such a name can make another thread's stacks read as the main thread's. What a rank's own names
    can still do is misreport its own counts (as calling a function named all_reduce could), never another's."""
    out: dict[str, int] = {}
    total = 0
    for line in data.decode("utf-8", "replace").splitlines():
        m = _LINE.fullmatch(line)
        if m is None:
            if line.strip():
                return None  # a thread's name broke a line: any line after it may be the name's
            continue
        if int(m["tid"]) != pid:
            continue
        count = int(m["count"])
        total += count
        if total > most:
            return None
        frames = tuple(Frame(f["function"], f["file"], int(f["line"]) if f["line"] else None)
                       for part in reversed(m["stack"].split(";")) if (f := _FRAME.match(part)))
        kind = what_it_shows(ThreadStack(pid, None, None, frames, pid))
        out[kind] = out.get(kind, 0) + count
    return out


def what_it_shows(thread: ThreadStack) -> str:
    activity = classify(thread).name
    return WAITING if activity == COLLECTIVE else PLANNED if activity in _PLANNED else WORKING


class RankSampler:
    """Records each target of `targets()` for stacks.sample_seconds, over and over, on a thread of its own;
    `annotate` hands the counts to the detectors. `on_problem(pid, message)` hears of a rank that could not be
    sampled (once per process)."""

    def __init__(self, capturer: StackCapturer, cfg: StacksConfig, targets: Callable[[], Sequence[SampleTarget]],
                 on_problem: Callable[[int, str], None] = lambda pid, message: None,
                 monotonic: Callable[[], float] = time.monotonic, proc_root: str = "/proc"):
        self.capturer, self.cfg, self.targets = capturer, cfg, targets
        self.on_problem, self.monotonic, self.proc_root = on_problem, monotonic, proc_root
        self.counts: dict[tuple[int, float], _Counts] = {}
        self.timed: dict[tuple[int, float], _Counts] = {}  # milliseconds from NCCL Inspector logs, where kept
        self._tails: dict[tuple[int, float], InspectorTail] = {}
        self._told: set[tuple[int, float]] = set()
        self._told_logs: set[tuple[int, float]] = set()
        self._jobs: dict[str, int] = {}  # each proven job's number in the readings: given in turn, never reused
        self._resting: dict[tuple[int, float], tuple[int, int]] = {}  # rounds left to sit out, and the last rest
        self._turns: dict[str, int] = {}  # where each job's turn among its ranks starts ("": among jobs)
        self._numbered = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="rank-sampler", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.cfg.sample_rate_hz <= 0:
                self._stop.wait(self.cfg.sample_seconds)
                continue
            started = self.monotonic()
            try:
                self.sample_once()
            except Exception as exc:  # the sampler's boundary: one bad window never ends the sampling
                self.on_problem(0, f"{type(exc).__name__}: {exc}")
            # The next record starts as this one ends (the samples cover the rank's time with no gap); one that
            # ended early (py-spy failed) waits out the rest of its length, so a failing rank is not retried in a loop.
            self._stop.wait(max(0.0, self.cfg.sample_seconds - (self.monotonic() - started)))

    def sample_once(self) -> None:
        """One record of each rank chosen for this round (_this_round), all at once; their counts added."""
        cfg = self.cfg
        targets = list(self.targets())
        live = {(t.pid, t.start) for t in targets}
        with self._lock:
            for kept in (self.counts, self.timed, self._tails):
                for gone in kept.keys() - live:
                    del kept[gone]
        self._told &= live
        self._told_logs &= live  # a process is told of once while it is a target, and forgotten when it is not
        jobs = {t.job for t in targets}
        with self._lock:
            for ended in self._jobs.keys() - jobs:
                del self._jobs[ended]
            for job in sorted(jobs - self._jobs.keys()):
                self._numbered += 1
                self._jobs[job] = self._numbered
        for gone in self._resting.keys() - live:
            del self._resting[gone]
        if not targets or cfg.sample_rate_hz <= 0:
            return
        chosen = self._this_round(targets)
        with ThreadPoolExecutor(max_workers=max(1, len(chosen)), thread_name_prefix="py-spy-record") as pool:
            results = list(pool.map(lambda t: self.capturer.record(t.pid, cfg.sample_rate_hz, cfg.sample_seconds),
                                    chosen))
        now = self.monotonic()
        for target, (result, message, data) in zip(chosen, results):
            key = (target.pid, target.start)
            if result != OK:
                if result in (TIMEOUT, FAILED) and not self._stop.is_set():  # py-spy cannot keep up with it
                    rest = min(_MOST_RESTED, 2 * self._resting.get(key, (0, 0))[1] or 1)
                    self._resting[key] = (rest, rest)
                    message += f"; it is sampled again after {rest} round{'s' if rest > 1 else ''}, then less often"
                if key not in self._told and not self._stop.is_set():
                    self._told.add(key)
                    self.on_problem(target.pid, message)
                continue
            self._resting.pop(key, None)
            try:  # one rank's record is its own: what it holds never ends another's
                kinds = main_thread_samples(data, target.pid, _most(cfg))
            except Exception as exc:
                kinds, message = None, f"its record was not read ({type(exc).__name__}: {exc})"
            else:
                message = "its record holds more main-thread samples than it took: a thread's name forges lines"
            if kinds is None:
                if key not in self._told and not self._stop.is_set():
                    self._told.add(key)
                    self.on_problem(target.pid, message)
                continue
            self._add(self.counts, target, kinds, now)
        for target in targets:
            if target.inspector:
                self._time(target, now)

    def _this_round(self, targets: list[SampleTarget]) -> list[SampleTarget]:
        """The ranks recorded this round: at most stacks.max_parallel, so a round lasts one record however many
        ranks the node runs; each job gets its share (a job with more ranks than its share takes turns among
        them), and a rank resting after a record py-spy could not finish sits out its rounds."""
        ready = []
        for target in targets:
            key = (target.pid, target.start)
            left, rest = self._resting.get(key, (0, 0))
            if left > 0:
                self._resting[key] = (left - 1, rest)
            else:
                ready.append(target)
        by_job: dict[str, list[SampleTarget]] = {}
        for target in ready:
            by_job.setdefault(target.job, []).append(target)
        jobs = sorted(by_job)
        slots = self.cfg.max_parallel
        if len(jobs) > slots:  # more jobs than slots: the jobs take turns, one rank each
            first = self._turns.get("", 0) % len(jobs)
            self._turns[""] = first + slots
            jobs = (jobs[first:] + jobs[:first])[:slots]
        share, chosen = max(1, slots // len(jobs)) if jobs else 0, []
        for job in jobs:
            ranks = by_job[job]
            if len(ranks) > share:
                first = self._turns.get(job, 0) % len(ranks)
                self._turns[job] = first + share
                ranks = (ranks[first:] + ranks[:first])[:share]
            chosen += ranks
        for ended in self._turns.keys() - set(by_job) - {""}:
            del self._turns[ended]
        return chosen

    def _add(self, kept: dict[tuple[int, float], _Counts], target: SampleTarget, kinds: dict[str, int],
             now: float) -> None:
        key = (target.pid, target.start)
        with self._lock:
            counts = kept.get(key)
            if counts is None or counts.target != target:
                counts = kept[key] = _Counts(target, now + self.cfg.sample_learn_seconds)
            counts.add(kinds, now)

    def _time(self, target: SampleTarget, now: float) -> None:
        """What the rank's NCCL Inspector log gained since the last record, as milliseconds waiting (inside
        collectives) and working. A stretch with no collective counts for nothing (a rank between jobs' phases,
        a log written only now and then)."""
        key, folder = (target.pid, target.start), target.inspector or ""
        tail = self._tails.get(key)
        if tail is None or tail.folder != folder:
            tail = self._tails[key] = InspectorTail(target.pid, folder, self.proc_root, target.host)
        try:
            timed = tail.read(now)
        except RankFileError as exc:
            if key not in self._told_logs:
                self._told_logs.add(key)
                self.on_problem(target.pid, f"its NCCL Inspector log was not read: {exc}")
            return
        if timed is not None and timed.collectives and timed.span_ms > 0:
            self._add(self.timed, target, {WAITING: timed.busy_ms, WORKING: timed.span_ms - timed.busy_ms}, now)

    def annotate(self, snapshot: NodeSnapshot) -> NodeSnapshot:
        """The snapshot with each GPU's rank_waits (and nccl_waits, from its Inspector log): the counts of its
        sampled rank (_per_gpu: of several, the rank of the job with the most ranks here)."""
        with self._lock:
            waits, timed = _per_gpu(self.counts, self._jobs), _per_gpu(self.timed, self._jobs)
        if not waits and not timed:
            return snapshot
        gpus = tuple(g._replace(rank_waits=waits.get(g.index, g.rank_waits),
                                nccl_waits=timed.get(g.index, g.nccl_waits)) for g in snapshot.gpus)
        return NodeSnapshot(snapshot.time_seconds, gpus)


def _most(cfg: StacksConfig) -> int:
    """The most samples of one thread a record can hold: its length at its rate, with room for py-spy's rounding."""
    return int(cfg.sample_rate_hz * max(1, round(cfg.sample_seconds)) * 1.1) + 2


def _per_gpu(kept: dict[tuple[int, float], _Counts], jobs: dict[str, int]) -> dict[int, tuple[int, ...]]:
    """Each GPU's reading: its one sampled rank's, or where several share it (MPS, time-slicing), the rank of the
    job with the most ranks on the node (another job's process on its GPU leaves the training job's judgement
    alone); a tie gives none."""
    size: dict[str, int] = {}
    for counts in kept.values():
        size[counts.target.job] = size.get(counts.target.job, 0) + 1
    per_gpu: dict[int, list[_Counts]] = {}
    for counts in kept.values():
        if counts.samples and counts.target.job in jobs:
            for gpu in counts.target.gpus:
                per_gpu.setdefault(gpu, []).append(counts)
    out = {}
    for gpu, found in per_gpu.items():
        found.sort(key=lambda c: -size[c.target.job])
        if len(found) == 1 or size[found[0].target.job] > size[found[1].target.job]:
            out[gpu] = found[0].reading(jobs[found[0].target.job])
    return out
