"""Where a Slurm job runs, in Slurm's own words: the coordinator's way to a job's nodes that neither waits for
Prometheus (a scrape, then its rules, then Alertmanager's group_wait) nor needs it up.

squeue is asked in a fixed format whose fields no user chose (the job's id, its state and its node list: a
job's name or comment could hold "NodeList=..."), and `scontrol show hostnames` expands the node list. Each
node becomes the instance its daemon serves on by `instance` (`{node}:9944`). Both run through children.run:
a deadline, bounded output, no secret of the coordinator's in their environment.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from watchdog.boundary import children

from .nodes import MAX_NODES, Placement, valid_instance

MAX_OUTPUT_BYTES = 2 * 2**20  # `scontrol show hostnames` of a 16,384-node job, a name of up to 127 bytes a line
RUNNING = ("RUNNING", "SUSPENDED", "COMPLETING")  # states whose nodes still hold the job's ranks
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")  # a Slurm NodeName


class SchedulerError(Exception):
    """The scheduler could not be asked, or does not place the job on any node now (the message says which)."""


@dataclass(frozen=True)
class SlurmNodes:
    """How the coordinator asks Slurm: the instance of each node's daemon (`{node}` is Slurm's NodeName), the
    slurm.conf to use (None: Slurm's own default or configless lookup), the commands and their deadline."""

    instance: str = "{node}:9944"
    conf: str | None = None
    squeue: str = "squeue"
    scontrol: str = "scontrol"
    timeout_seconds: float = 10.0

    def placement(self, slurm_job_id: str) -> Placement:
        """The daemons of the nodes Slurm runs job `slurm_job_id` on (sorted); which rank runs where is left to
        the nodes' answers (each node's daemon proves its own ranks from slurmstepd's cgroup)."""
        if not slurm_job_id.isdigit():
            raise SchedulerError(f"{slurm_job_id!r} is not a Slurm job id")
        shown = self._run(self.squeue, "--noheader", "--states=all", "--jobs", slurm_job_id, "--format", "%A|%T|%N")
        rows = [[part.strip() for part in line.split("|")] for line in shown.splitlines() if line.strip()]
        mine = [row for row in rows if len(row) == 3 and row[0] == slurm_job_id]
        if not mine:
            raise SchedulerError(f"Slurm has no job {slurm_job_id}")
        _, state, node_list = mine[0]
        if state not in RUNNING:
            raise SchedulerError(f"Slurm says job {slurm_job_id} is {state or 'in no state'}, on no node now")
        if not node_list or node_list == "(null)":
            raise SchedulerError(f"Slurm gives job {slurm_job_id} no nodes")
        nodes = self._run(self.scontrol, "show", "hostnames", node_list).split()
        instances = sorted({self.instance.format(node=node) for node in nodes if _NODE.match(node)})
        kept = [i for i in instances if valid_instance(i)][:MAX_NODES]
        if not kept:
            raise SchedulerError(f"no node of Slurm job {slurm_job_id} makes a host:port with {self.instance!r} "
                                 f"(its nodes: {node_list[:200]})")
        left = len(instances) - len(kept)
        return Placement(kept, source="slurm",
                         note=f"{left} of its nodes make no host:port instance; not asked" if left else None)

    def _run(self, *argv: str) -> str:
        try:
            return children.run(argv, timeout=self.timeout_seconds,
                                env={"SLURM_CONF": self.conf} if self.conf else None, max_output=MAX_OUTPUT_BYTES)
        except children.CommandError as exc:
            raise SchedulerError(str(exc)) from None
