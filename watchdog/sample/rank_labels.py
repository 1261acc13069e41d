"""Who each process on the GPUs is, for the metrics' labels (rank_info): its rank, the job it says it belongs
to and its workload (pod, container, Slurm job). A label is a claim shown, never a proof acted on.

A process is described once (psutil and /proc), then kept by pid and start time: a reused pid is described
afresh. The pod holding its GPU is the kubelet's latest answer (a dictionary lookup). A process that cannot be
described costs its own labels, never the node's metrics.
"""

from __future__ import annotations

from collections.abc import Callable

from watchdog import logfmt
from watchdog.counters import Counters
from watchdog.model import NodeSnapshot, Workload
from watchdog.sample.ranks import RankDiscovery

# (gpu, pid, rank, job, workload) of each process on each GPU
Label = tuple[int, int, "int | None", str, Workload]


class RankLabels:
    def __init__(self, discovery: RankDiscovery, start_of: Callable[[int], int | None], counters: Counters):
        self.discovery, self.start_of, self.counters = discovery, start_of, counters
        self._known: dict[int, tuple[int | None, int | None, str, Workload]] = {}  # pid -> (start, rank, job, it)

    def of(self, snapshot: NodeSnapshot) -> list[Label]:
        known = self._known
        pids = {pid for g in snapshot.gpus for pid in g.pids}
        for pid in pids:
            start, held = self.start_of(pid), known.get(pid)
            if held is None or held[0] != start:
                known[pid] = (start, *self._describe(pid))
        for gone in known.keys() - pids:
            del known[gone]
        return [(g.index, pid, rank, job, self.discovery.with_pod(workload, (g.uuid or "",)))
                for g in snapshot.gpus for pid in g.pids for _, rank, job, workload in (known[pid],)]

    def _describe(self, pid: int) -> tuple[int | None, str, Workload]:
        """(rank, job, workload) of a process on a GPU; unknown where it is gone or cannot be read."""
        try:
            info = self.discovery.describe(pid)
        except Exception as exc:  # the boundary of one rank's description
            self.counters.inc("component_errors_total", "ranks")
            logfmt.event("rank_unreadable", level=logfmt.WARNING, pid=pid, error=f"{type(exc).__name__}: {exc}")
            return None, "", Workload()
        return (info.rank, info.job_key, info.workload) if info is not None else (None, "", Workload())
