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
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from watchdog import logfmt
from watchdog.act.bundles import BundleStore
from watchdog.config import Config
from watchdog.counters import Counters
from watchdog.model import NodeSnapshot, iso_time
from watchdog.sample.ranks import RankDiscovery, RankInfo, group_jobs
from watchdog.stacks.capture import StackCapturer
from watchdog.stacks.picture import StackPicture, capture_job
from watchdog.webhook import PayloadError, dump_target


@dataclass(frozen=True)
class Answer:
    status: int
    body: dict[str, object]
    retry_after: int | None = None


class DumpService:
    def __init__(self, config: Config, counters: Counters, capturer: StackCapturer, discovery: RankDiscovery,
                 bundles: BundleStore, snapshot: Callable[[], NodeSnapshot | None], node: str,
                 monotonic: Callable[[], float] = time.monotonic,
                 last_look: Callable[[str], list[tuple[StackPicture, tuple[RankInfo, ...]]]] | None = None):
        """`last_look(slurm_job_id)`: the pictures (and their ranks) of open or lately resolved episodes that
        concerned that Slurm job, for a job that ended before it could be dumped."""
        self.config = config
        self.counters = counters
        self.capturer = capturer
        self.discovery = discovery
        self.bundles = bundles
        self.snapshot = snapshot
        self.node = node
        self.monotonic = monotonic
        self.last_look = last_look
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

    def _ranks(self) -> list[RankInfo]:
        snapshot = self.snapshot()
        ranks = self.discovery.from_snapshot(snapshot) if snapshot is not None else []
        return ranks or self.discovery.scan()

    def _dump(self, jobs: tuple[str, ...], slurm_job: str | None = None) -> Answer:
        started = time.time()
        ranks = self._ranks()
        if slurm_job is not None:
            ranks = [r for r in ranks if r.workload.slurm_job_id == slurm_job]
        every = group_jobs(ranks)
        chosen = [j for j in every if not jobs or j.key in jobs]
        ended: list[tuple[StackPicture, tuple[RankInfo, ...]]] = []
        if not chosen and slurm_job is not None and self.last_look is not None:
            ended = self.last_look(slurm_job)
        if not chosen and not ended:
            self.counters.inc("dumps_total", "no_ranks")
            here = ", ".join(j.key for j in group_jobs(self._ranks())) or "none"
            what = (f"no local rank and no open episode of Slurm job {slurm_job}" if slurm_job else
                    f"no local rank of training job {', '.join(jobs)}" if jobs else "no training ranks")
            return Answer(404, {"error": f"{what} on this node (jobs here: {here})", "node": self.node, "jobs": []})
        if ended:
            pictures = [picture for picture, _ in ended]
            members = [ranks for _, ranks in ended]
        else:
            pictures = [capture_job(job, self.capturer, self.discovery, self.config.stacks, self.node)
                        for job in chosen]
            members = [job.ranks for job in chosen]
            for picture in pictures:
                for capture in picture.captures:
                    self.counters.inc("stack_captures_total", capture.result)
        body: dict[str, object] = {"node": self.node, "captured_at": iso_time(started), "shared": False,
                                   "seconds": round(time.time() - started, 3),
                                   "jobs": [_job_json(p, r) for p, r in zip(pictures, members)]}
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

    def close(self) -> None:
        self.capturer.abort()
        self.pool.shutdown(wait=False, cancel_futures=True)


def _job_json(picture: StackPicture, ranks: tuple[RankInfo, ...]) -> dict[str, object]:
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
                     "threads": capture.raw if capture is not None else None})
    out: dict[str, object] = {"training_job": picture.job, "world_size": picture.world_size,
                              "verdict": picture.verdict.to_json(), "summary": analysis.summary,
                              "outliers": list(analysis.outliers), "ranks": rows}
    if picture.fr is not None:
        out["flight_recorder"] = picture.fr.to_json()
        out["flight_recorder_traces"] = [t.to_json() for t in picture.traces]
    if picture.ras is not None:
        out["nccl_ras"] = picture.ras.to_json()
    return out
