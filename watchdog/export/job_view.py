"""The node's view of each proven training job on it, a handful of series a job rather than a few a GPU: what
the fleet's job-wide rules read (deploy/prometheus/rules.yml), so that at 100,000 GPUs they handle one series
a node, not one a GPU or a rank, join nothing per GPU, and compute no rate: the node does.

- job_state (with the pod): the job runs here (its proven ranks), and its highest busy_spin, waiting or
  zero_util episode state on this node's GPUs (0 none, 1 suspect, 2 warning, 3 critical);
- job_culprit (with the pod): 1 while this node holds a GPU of the job that the job's other ranks wait on;
- job_wait_ratio / job_wait_samples: the share of the stack samples of the job's ranks here that were inside
  a collective over the last WINDOW_SECONDS, and how many samples that is (the rule's chance test); and
  job_first_wait_ratio, their share in their first look. The same from NCCL Inspector logs: job_nccl_ratio
  (time inside collectives over wall time, by NCCL's timing) and job_first_nccl_ratio. The pod is left out of
  these: a job's ranks on one node are one figure, whatever pods they run in.

A job is the proven rank's training job, Slurm job, namespace and uid; a claim alone (no proof) is no job
here, as on rank_info for the rules. The window's counts are summed as counters that only grow (a rank that
restarts or leaves takes nothing back) and read at each render on the snapshot's own clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping

from watchdog.sample.rank_labels import RankRow
from watchdog.vocabulary.model import (
    WAIT_FIRST_SAMPLES,
    WAIT_FIRST_WAITS,
    WAIT_RANK,
    WAIT_SAMPLES,
    WAIT_WAITS,
    GpuSample,
)

JOB_LABELS = ("training_job", "slurm_job_id", "namespace", "pod", "uid")
WAIT_LABELS = ("training_job", "slurm_job_id", "namespace", "uid")  # JOB_LABELS without the pod
WINDOW_SECONDS = 300.0
JobKey = tuple[str, ...]  # JOB_LABELS' values
Rows = dict[str, list[tuple[tuple[str, ...], float]]]
_KINDS = (("stack", "rank_waits", ("job_wait_ratio", "job_wait_samples", "job_first_wait_ratio")),
          ("nccl", "nccl_waits", ("job_nccl_ratio", None, "job_first_nccl_ratio")))
NAMES = ("job_state", "job_culprit", *(name for _, _, names in _KINDS for name in names if name))

_REMEMBERED = 1 << 12  # ranks or jobs remembered (a node runs a few dozen): bounded
_STEP_SECONDS = 5.0  # the window's points at least this far apart


def job_key(row: RankRow) -> JobKey:
    workload = row.workload
    return (row.job, workload.slurm_job_id or "", workload.namespace or "", workload.pod or "", row.uid)


class JobWindows:
    """Each job's summed counts, as counters that only grow: each rank's counts are read as increments since
    the last read of the same rank (its GPU, pid and rank), so a new rank adds from its first count and one
    that goes away takes nothing back; and each job's totals over the last WINDOW_SECONDS."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, int, int, int], tuple[int, int]] = {}  # (kind, gpu, pid, rank) -> counts
        self._totals: dict[tuple[str, JobKey], list[float]] = {}  # (kind, job) -> [samples, waits]
        self._points: dict[tuple[str, JobKey], deque[tuple[float, float, float]]] = {}  # (t, samples, waits)

    def add(self, kind: str, job: JobKey, gpu: int, pid: int, counts: tuple[int, ...]) -> None:
        key = (kind, gpu, pid, counts[WAIT_RANK])
        samples, waits = counts[WAIT_SAMPLES], counts[WAIT_WAITS]
        before = self._last.get(key, (0, 0))
        if samples < before[0] or waits < before[1]:  # counted anew (the daemon lost the rank a while): from 0
            before = (0, 0)
        if len(self._last) > _REMEMBERED:
            self._last.clear()  # ranks come and go; forgetting one adds its counts again once: bounded
        self._last[key] = (samples, waits)
        total = self._totals.setdefault((kind, job), [0.0, 0.0])
        total[0] += samples - before[0]
        total[1] += waits - before[1]

    def window(self, kind: str, job: JobKey, now: float) -> tuple[float, float] | None:
        """(samples, waits) over the last WINDOW_SECONDS up to `now` (as far back as the job was seen); None
        before a second point."""
        total = self._totals.get((kind, job))
        if total is None:
            return None
        points = self._points.setdefault((kind, job), deque())
        while points and points[-1][0] > now:  # the clock stepped back: start again
            points.clear()
        if not points or now - points[-1][0] >= _STEP_SECONDS:
            points.append((now, total[0], total[1]))
        while len(points) > 1 and points[1][0] <= now - WINDOW_SECONDS:
            points.popleft()
        first = points[0]
        if first[0] >= now:
            return None
        return total[0] - first[1], total[1] - first[2]

    def forget_except(self, jobs: Iterable[tuple[str, JobKey]]) -> None:
        """Jobs no longer on the node stop being remembered once there are many (their series end anyway)."""
        if len(self._totals) > _REMEMBERED:
            keep = set(jobs)
            self._totals = {key: value for key, value in self._totals.items() if key in keep}
            self._points = {key: value for key, value in self._points.items() if key in keep}


def job_rows(ranks: Iterable[RankRow], gpus: Iterable[GpuSample], now: float, stall: Mapping[int, int],
             culprits: Iterable[int], windows: JobWindows) -> Rows:
    """The job view's rows (metric -> (label values in JOB_LABELS' or WAIT_LABELS' order, value)) at `now` (the
    snapshot's time): `stall` each GPU's highest stall state, `culprits` the GPUs others wait on."""
    out: Rows = {name: [] for name in NAMES}
    on_gpu: dict[int, list[tuple[RankRow, JobKey]]] = {}
    jobs: dict[JobKey, set[int]] = {}
    for row in ranks:
        if row.proof:
            key = job_key(row)
            jobs.setdefault(key, set()).add(row.gpu)
            on_gpu.setdefault(row.gpu, []).append((row, key))
    culprit = set(culprits)
    for key, its_gpus in jobs.items():
        out["job_state"].append((key, max((stall.get(g, 0) for g in its_gpus), default=0)))
        if its_gpus & culprit:
            out["job_culprit"].append((key, 1))
    first: dict[tuple[str, JobKey], list[int]] = {}  # first-look samples and waits, summed
    for gpu in gpus:
        for kind, slot, _ in _KINDS:
            counts: tuple[int, ...] = getattr(gpu, slot)
            owner = _owner(on_gpu.get(gpu.index, ()), counts)
            if owner is None:
                continue
            row, key = owner
            job = _without_pod(key)
            windows.add(kind, job, gpu.index, row.pid, counts)
            if counts[WAIT_FIRST_SAMPLES]:
                seen = first.setdefault((kind, job), [0, 0])
                seen[0] += counts[WAIT_FIRST_SAMPLES]
                seen[1] += counts[WAIT_FIRST_WAITS]
    waiting = {_without_pod(key) for key in jobs}
    for kind, _, (ratio, samples, first_ratio) in _KINDS:
        for job in waiting:
            counted = windows.window(kind, job, now)
            if counted is not None and counted[0] > 0:
                out[ratio].append((job, counted[1] / counted[0]))
                if samples is not None:
                    out[samples].append((job, counted[0]))
            looked = first.get((kind, job))
            if looked:
                out[first_ratio].append((job, looked[1] / looked[0]))
    windows.forget_except((kind, job) for kind, _, _ in _KINDS for job in waiting)
    return out


def _without_pod(key: JobKey) -> JobKey:
    return tuple(value for name, value in zip(JOB_LABELS, key) if name != "pod")


def _owner(rows: Iterable[tuple[RankRow, JobKey]], counts: tuple[int, ...]) -> tuple[RankRow, JobKey] | None:
    """The proven rank the GPU's counts belong to: its only one, or the one of the counted rank number."""
    if not counts:
        return None
    rows = list(rows)
    if len(rows) == 1:
        return rows[0]
    matching = [(row, key) for row, key in rows if row.rank == counts[WAIT_RANK]]
    return matching[0] if len(matching) == 1 else None
