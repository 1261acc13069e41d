"""Who each process on the GPUs is, for the metrics' labels (rank_info): its rank, the job it says it belongs
to and its workload (pod, container, Slurm job), all claims shown; and, where its job is proven (act/
membership.py: slurmstepd's cgroup confirmed by Slurm, its pod's cgroup, its launcher's tree), the kind of
proof and the user the job runs as. The fleet's rules join a job's nodes on proven ranks only, by the claimed
name and that user, so another user's process that claims a job's name never joins it.

A process is described once (psutil and /proc), then kept by pid and start time: a reused pid is described
afresh. The stack sampler takes its ranks from the same descriptions (`described`), with their GPUs and pods as
of the last tick: a rank with 60,000 arguments is read once, not every sampling round. The pod holding its
GPU is the kubelet's latest answer (a dictionary lookup). A process that cannot be described costs its own
labels, never the node's metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from watchdog.plumbing import logfmt
from watchdog.plumbing.counters import Counters
from watchdog.sample.ranks import RankDiscovery, RankInfo
from watchdog.vocabulary.model import GpuSample, NodeSnapshot, Workload


class RankRow(NamedTuple):
    """One process on one GPU, as rank_info labels it."""

    gpu: int
    pid: int
    rank: int | None
    job: str  # the job it claims
    workload: Workload
    proof: str = ""  # slurm, pod or launcher where its job is proven (act/membership.py); "" where not
    uid: str = ""  # the user the proven job runs as

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
        self.described: tuple[RankInfo, ...] = ()  # the processes on the GPUs at the last tick, with their GPUs
        self._last: tuple[Any, list[RankRow]] | None = None  # the last tick's GPUs and processes, and its rows

    def of(self, snapshot: NodeSnapshot) -> list[RankRow]:
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
        # The usual tick: the same processes on the same GPUs, and no new kubelet answer: the same rows.
        seen = (tuple((g.index, g.uuid, g.pids) for g in snapshot.gpus), self.discovery.pod_answers())
        if not changed and self._last is not None and self._last[0] == seen:
            return list(self._last[1])
        gpus_of: dict[int, list[GpuSample]] = {}
        for g in snapshot.gpus:
            for pid in g.pids:
                gpus_of.setdefault(pid, []).append(g)
        self.described = tuple(  # one reference swapped: the sampler's thread reads it whole
            replace(info, gpus=tuple(g.index for g in on), workload=self.discovery.with_pod(
                info.workload, tuple(g.uuid for g in on if g.uuid)))
            for pid, on in sorted(gpus_of.items()) for info in (known[pid][1],) if info is not None)
        if changed:  # who is proven changes only with who is there (the Slurm check keeps its answers a while)
            self._proven = self._prove(list(self.described))
        out: list[RankRow] = []
        for g in snapshot.gpus:
            for pid in g.pids:
                info = known[pid][1]
                proof, uid = self._proven.get(pid, ("", -1))
                workload = info.workload if info is not None else Workload()
                out.append(RankRow(g.index, pid, info.rank if info is not None else None,
                                   info.job_key if info else "", self.discovery.with_pod(workload, (g.uuid or "",)),
                                   proof, str(uid) if proof else ""))
        self._last = (seen, out)
        return list(out)

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
