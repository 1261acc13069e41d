"""Who each process on the GPUs is, for the metrics' labels (rank_info): its rank, the job it says it belongs
to and its workload (pod, container, Slurm job), all claims shown; and, where its job is proven (act/
membership.py: slurmstepd's cgroup confirmed by Slurm, its pod's cgroup, its launcher's tree), the kind of
proof and the user the job runs as. The fleet's rules join a job's nodes on proven ranks only, by the claimed
name and that user, so another user's process that claims a job's name never joins it.

A process is described once (psutil and /proc), then kept by pid and start time: a reused pid is described
afresh. The pod holding its GPU is the kubelet's latest answer (a dictionary lookup). A process that cannot be
described costs its own labels, never the node's metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from watchdog import logfmt
from watchdog.counters import Counters
from watchdog.model import NodeSnapshot, Workload
from watchdog.sample.ranks import RankDiscovery, RankInfo

# (gpu, pid, rank, job, workload, proof, uid) of each process on each GPU; proof and uid "" when not proven
Label = tuple[int, int, "int | None", str, Workload, str, str]
# the proven among some described processes: pid -> (the kind of proof: slurm, pod or launcher; its job's uid)
Prover = Callable[[Sequence[RankInfo]], Mapping[int, tuple[str, int]]]


def _nothing_proven(ranks: Sequence[RankInfo]) -> Mapping[int, tuple[str, int]]:
    return {}


class RankLabels:
    def __init__(self, discovery: RankDiscovery, start_of: Callable[[int], int | None], counters: Counters,
                 prove: Prover = _nothing_proven):
        self.discovery, self.start_of, self.counters, self.prove = discovery, start_of, counters, prove
        self._known: dict[int, tuple[int | None, RankInfo | None]] = {}  # pid -> (its start, its description)
        self._proven: Mapping[int, tuple[str, int]] = {}

    def of(self, snapshot: NodeSnapshot) -> list[Label]:
        known = self._known
        pids = {pid for g in snapshot.gpus for pid in g.pids}
        changed = False
        for pid in pids:
            start, held = self.start_of(pid), known.get(pid)
            if held is None or held[0] != start:
                known[pid] = (start, self._describe(pid))
                changed = True
        for gone in known.keys() - pids:
            del known[gone]
            changed = True
        if changed:  # who is proven changes only with who is there (the Slurm check keeps its answers a while)
            self._proven = self._prove([info for _, info in known.values() if info is not None])
        out: list[Label] = []
        for g in snapshot.gpus:
            for pid in g.pids:
                info = known[pid][1]
                proof, uid = self._proven.get(pid, ("", -1))
                workload = info.workload if info is not None else Workload()
                out.append((g.index, pid, info.rank if info is not None else None, info.job_key if info else "",
                            self.discovery.with_pod(workload, (g.uuid or "",)), proof, str(uid) if proof else ""))
        return out

    def _prove(self, infos: list[RankInfo]) -> Mapping[int, tuple[str, int]]:
        try:
            return self.prove(infos)
        except Exception as exc:  # the boundary of the proof: labels without it, never no labels
            self.counters.inc("component_errors_total", "ranks")
            logfmt.event("ranks_unproven", level=logfmt.WARNING, error=f"{type(exc).__name__}: {exc}")
            return {}

    def _describe(self, pid: int) -> RankInfo | None:
        """A process on a GPU; None where it is gone or cannot be read."""
        try:
            return self.discovery.describe(pid)
        except Exception as exc:  # the boundary of one rank's description
            self.counters.inc("component_errors_total", "ranks")
            logfmt.event("rank_unreadable", level=logfmt.WARNING, pid=pid, error=f"{type(exc).__name__}: {exc}")
            return None
