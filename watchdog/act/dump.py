"""`POST /v1/dump`: capture a training job's local ranks now, because an alert (or the coordinator) asks.

`{"slurm_job_id": "..."}` (a Slurm epilog) names the job by its Slurm id. When its ranks are already gone
(Slurm kills them before the epilog runs) and one of the daemon's episodes concerned them (open, or
resolved lately: the kill itself resolves it), the bundle holds that episode's last look at their stacks,
marked `"ended": true`; with no such episode there is nothing to keep (404).

The answer is JSON: the bundle written, this node's verdict per job, every rank with its pid, GPUs,
activity and raw py-spy threads, the Flight Recorder dumps read back and NCCL RAS's view. Requests for
one job while its dump runs share that dump; a job dumped less than `dump.cooldown_seconds` ago gets that
answer again (`"shared": true`); at most `dump.max_per_minute` dumps start per minute (then 429). A dump
that finds nothing to capture (404) gives its place in that budget back and is not kept for reuse, so
requests that name no local job cannot use up the budget of the real dump or the Slurm epilog; answers
kept for reuse are dropped once their cooldown has passed.

A job's ranks are those its proof gathers (act/membership.py: its launcher, slurmstepd's cgroup, its pod),
never those its name is claimed by: a process that claims a job's variables without its proof, or another
proven job that copies its name, is a claimant, counted and shown in `claimants`, never captured as the job's.
Without NVML's list (scan mode) every process is looked at, so one dump describes and captures at most
MAX_RANKS of them, the longest running first: the work a request costs does not grow with the processes any
user can start.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from watchdog.act import membership
from watchdog.act.bundles import BundleStore
from watchdog.boundary.webhook import PayloadError, dump_target
from watchdog.config import Config
from watchdog.plumbing import logfmt
from watchdog.plumbing.counters import Counters
from watchdog.sample.ranks import Job, RankDiscovery, RankInfo
from watchdog.stacks.capture import StackCapturer
from watchdog.stacks.confirm import look_twice
from watchdog.stacks.picture import StackPicture
from watchdog.vocabulary.model import NodeSnapshot
from watchdog.vocabulary.words import iso_time

MAX_RANKS = 128  # processes one dump describes and captures
MAX_CLAIMANTS_SHOWN = 8


@dataclass(frozen=True)
class Answer:
    status: int
    body: dict[str, object]
    retry_after: int | None = None


class DumpService:
    def __init__(self, config: Config, counters: Counters, capturer: StackCapturer, discovery: RankDiscovery,
                 bundles: BundleStore, snapshot: Callable[[], NodeSnapshot | None], node: str,
                 monotonic: Callable[[], float] = time.monotonic,
                 last_look: Callable[[str], list[tuple[StackPicture, tuple[RankInfo, ...]]]] | None = None,
                 slurm_check: membership.SlurmCheck = membership.no_slurm,
                 pace: Callable[[], Mapping[int, Mapping[str, float]]] = dict):
        """`last_look(slurm_job_id)`: the pictures (and their ranks) of open or lately resolved episodes that
        concerned that Slurm job, for a job that ended before it could be dumped. `slurm_check`: Slurm's word
        on a job and its user (act/actions.py), which proves a Slurm job's ranks. `pace()`: per GPU, its rank's
        wait share and a straggler's slowdown (Published.slow_gpus), said of each rank in the answer."""
        self.config = config
        self.counters = counters
        self.capturer = capturer
        self.discovery = discovery
        self.bundles = bundles
        self.snapshot = snapshot
        self.node = node
        self.monotonic = monotonic
        self.last_look = last_look
        self.slurm_check = slurm_check
        self.pace = pace
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dump")
        self._lock = threading.Lock()
        self._running: dict[tuple[str, ...], Future[Answer]] = {}
        self._recent: dict[tuple[str, ...], tuple[float, Answer]] = {}
        self._started: deque[float] = deque()
        self._started_at: dict[tuple[str, ...], float] = {}

    def handle(self, body: bytes) -> Answer:
        try:
            jobs, slurm_job = dump_target(body)
        except PayloadError as exc:
            self.counters.inc("dumps_total", "bad_request")
            return Answer(400, {"error": str(exc)})
        key = (f"slurm:{slurm_job}",) if slurm_job else tuple(sorted(jobs)) or ("*",)
        now = self.monotonic()
        with self._lock:
            cooldown = self.config.dump.cooldown_seconds
            self._recent = {k: v for k, v in self._recent.items() if now - v[0] < cooldown}
            future = self._running.get(key)
            shared = future is not None
            if future is None:
                recent = self._recent.get(key)
                if recent is not None and now - recent[0] < self.config.dump.cooldown_seconds:
                    self.counters.inc("dumps_total", "shared")
                    return Answer(recent[1].status, {**recent[1].body, "shared": True})
                while self._started and now - self._started[0] >= 60:
                    self._started.popleft()
                if len(self._started) >= self.config.dump.max_per_minute:
                    self.counters.inc("dumps_total", "rate_limited")
                    wait = int(60 - (now - self._started[0])) + 1
                    return Answer(429, {"error": f"over {self.config.dump.max_per_minute} dumps a minute "
                                        f"(dump.max_per_minute); retry in {wait} s"}, retry_after=wait)
                self._started.append(now)
                self._started_at[key] = now
                future = self.pool.submit(self._dump, jobs, slurm_job)
                self._running[key] = future
        if not shared:
            # Outside the lock: a dump already done (a quick 404) runs the callback here and now, and the
            # callback takes the lock.
            future.add_done_callback(functools.partial(self._finished, key))
        try:
            answer = future.result(timeout=self._budget())
        except FutureTimeout:
            return Answer(504, {"error": f"the dump did not finish within {self._budget():.0f} s; its bundle is "
                                "written when it does"})
        except Exception as exc:  # a failed dump is an answer, never a dead endpoint
            return Answer(500, {"error": f"{type(exc).__name__}: {exc}"})
        if shared:
            self.counters.inc("dumps_total", "shared")
            return Answer(answer.status, {**answer.body, "shared": True})
        return answer

    def _budget(self) -> float:
        s = self.config.stacks
        return (s.timeout_seconds + s.observe_seconds + s.flight_recorder_wait_seconds
                + (s.nccl_ras_gap_seconds + 2 * s.nccl_ras_timeout_seconds if s.nccl_ras else 0) + 15)

    def _finished(self, key: tuple[str, ...], future: Future[Answer]) -> None:
        with self._lock:
            self._running.pop(key, None)
            started = self._started_at.pop(key, None)
            if future.cancelled() or future.exception() is not None:
                return
            answer = future.result()
            if answer.status == 200:
                self._recent[key] = (self.monotonic(), answer)
            elif started is not None and started in self._started:
                self._started.remove(started)  # nothing was captured: the budget is not spent

    def _ranks(self, jobs: tuple[str, ...]) -> tuple[list[RankInfo], int]:
        """The processes to consider (NVML's on the GPUs, else a scan for those claiming `jobs`), and how many
        more claimed them than one dump describes."""
        snapshot = self.snapshot()
        ranks = self.discovery.from_snapshot(snapshot)[:MAX_RANKS] if snapshot is not None else []
        if ranks:
            return ranks, 0
        before = self.discovery.counters["scan_over_limit"]
        ranks = self.discovery.scan(jobs, limit=MAX_RANKS)
        return ranks, self.discovery.counters["scan_over_limit"] - before

    def _jobs(self, ranks: list[RankInfo], jobs: tuple[str, ...]) -> tuple[list[Job], list[Job], dict[int, str]]:
        """(the jobs to capture: those asked for, proven, or with none asked for every one; every job here; why
        each other process that claims a job asked for is not one of its ranks). At most MAX_RANKS are captured."""
        proven, claimed, left = membership.sorted_out(ranks, self.slurm_check)
        every = proven + claimed
        chosen: list[Job] = []
        for job in proven if jobs else every:
            if (not jobs or job.key in jobs) and sum(len(j.ranks) for j in chosen) + len(job.ranks) <= MAX_RANKS:
                chosen.append(job)
        taken = {r.pid for job in chosen for r in job.ranks}
        why = {r.pid: f"a rank of {job.key}, not captured (over {MAX_RANKS} ranks a dump)" if jobs and job.key in
               jobs else f"a rank of another job, {job.key}" for job in every for r in job.ranks}
        why.update({alone.rank.pid: f"not proven a rank of the job: {alone.why}" for alone in left})
        claims = {r.pid: why[r.pid] for r in ranks if r.pid not in taken and (not jobs or r.job_key in jobs)}
        return chosen, every, claims

    def _dump(self, jobs: tuple[str, ...], slurm_job: str | None = None) -> Answer:
        started = time.time()
        ranks, unseen = self._ranks(jobs)
        if slurm_job is not None:
            ranks = [r for r in ranks if r.workload.slurm_job_id == slurm_job]
        chosen, every, claims = self._jobs(ranks, jobs)
        ended: list[tuple[StackPicture, tuple[RankInfo, ...]]] = []
        if not chosen and slurm_job is not None and self.last_look is not None:
            ended = self.last_look(slurm_job)
        if not chosen and not ended:
            self.counters.inc("dumps_total", "no_ranks")
            here = ", ".join(j.key for j in every[:16]) + (f" and {len(every) - 16} more" if len(every) > 16 else "")
            what = (f"no local rank and no open episode of Slurm job {slurm_job}" if slurm_job else
                    f"no local rank of training job {', '.join(jobs)}" if jobs else "no training ranks")
            n = len(claims) + unseen
            said = (f"; {n} {'process claims' if n == 1 else 'processes claim'} it without proof (claimants)"
                    if jobs and n else "")
            return Answer(404, {"error": f"{what} on this node (jobs here: {here or 'none'}){said}", "node": self.node,
                                "jobs": [],
                                "claimants": _claimants(ranks, claims, unseen)})
        if ended:
            pictures = [picture for picture, _ in ended]
            members = [ranks for _, ranks in ended]
        else:
            pictures = [look_twice(job, self.capturer, self.discovery, self.config.stacks, self.node,
                                   seen=self._count) for job in chosen]
            members = [job.ranks for job in chosen]
        pace = self.pace()
        body: dict[str, object] = {"node": self.node, "captured_at": iso_time(started), "shared": False,
                                   "seconds": round(time.time() - started, 3),
                                   "jobs": [_job_json(p, r, pace) for p, r in zip(pictures, members)],
                                   "claimants": _claimants(ranks, claims, unseen)}
        if slurm_job is not None:
            body["slurm_job_id"] = slurm_job
            body["ended"] = bool(ended)
            if ended:
                body["note"] = ("the job's ranks are gone: these are the stacks of its open episode's last look, "
                                "taken while it ran")
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started))
        gpus = sorted({g for group in members for r in group for g in r.gpus})
        path = self.bundles.write_dump(f"{stamp}-dump-gpu{'-'.join(map(str, gpus[:8])) or 'node'}", body, pictures)
        body["bundle"] = path.name if path is not None else None
        body["bundle_path"] = str(path) if path is not None else None
        self.counters.inc("dumps_total", "written")
        logfmt.event("dump", jobs=",".join(p.job for p in pictures), bundle=body["bundle"],
                     verdict=pictures[0].verdict.headline, seconds=body["seconds"])
        return Answer(200, body)

    def _count(self, picture: StackPicture) -> None:
        for capture in picture.captures:
            self.counters.inc("stack_captures_total", capture.result)

    def close(self) -> None:
        self.capturer.abort()
        self.pool.shutdown(wait=False, cancel_futures=True)


def _claimants(ranks: list[RankInfo], claims: dict[int, str], unseen: int) -> dict[str, object]:
    """The processes that claim a job asked for without being its ranks: how many, and a few with why."""
    shown = [r for r in ranks if r.pid in claims][:MAX_CLAIMANTS_SHOWN]
    return {"count": len(claims) + unseen, "not_described": unseen,
            "shown": [{"pid": r.pid, "uid": r.uid, "claims": r.job_key, "rank": r.rank, "why": claims[r.pid]}
                      for r in shown]}


def _job_json(picture: StackPicture, ranks: tuple[RankInfo, ...], pace: Mapping[int, Mapping[str, float]]
              ) -> dict[str, object]:
    analysis = picture.analysis
    group_of = analysis.group_by_member()
    captured = {c.target.pid: c for c in picture.captures}
    rows = []
    for rank in ranks:
        capture = captured.get(rank.pid)
        member = capture.dump.member if capture is not None and capture.dump is not None else None
        activity = analysis.member_activity.get(member) if member else None
        rows.append({"rank": rank.rank, "pid": rank.pid, "gpus": list(rank.gpus), "member": member,
                     "workload": rank.workload.to_json(),
                     "activity": activity.name if activity else None,
                     "where": group_of[member].where if member in group_of else None,
                     "capture": capture.result if capture is not None else "not_captured",
                     "threads": capture.raw if capture is not None else None,
                     **next((dict(pace[g]) for g in rank.gpus if g in pace), {})})
    out: dict[str, object] = {"training_job": picture.job, "world_size": picture.world_size,
                              "verdict": picture.verdict.to_json(), "summary": analysis.summary,
                              "outliers": list(analysis.outliers), "ranks": rows}
    if picture.fr is not None:
        out["flight_recorder"] = picture.fr.to_json()
        # summarised on the node: a 2,000-entry ring a rank would make an answer of megabytes at fleet size
        out["flight_recorder_traces"] = [t.summarised().to_json() for t in picture.traces]
    if picture.ras is not None:
        out["nccl_ras"] = picture.ras.to_json()
    return out
