"""Which processes on a hung episode's GPUs are provably ranks of one job, and which job: the only processes
an action may touch.

A rank's environment (RANK, TORCHELASTIC_RUN_ID, SLURM_JOB_ID, HOSTNAME) is its own to write, so it decides
nothing here. A job is proven by what the process cannot choose, in this order:

slurm     its cgroup lies in slurmstepd's own hierarchy (cgroup v1 `/slurm[_<node>]/uid_<uid>/job_<id>/
          step_<s>`, with the process's own uid; v2 `/system.slice/slurmstepd.scope/job_<id>/step_<s>`),
          and Slurm confirms job <id> is running as the process's user
pod       its cgroup is a pod's (`kubepods...pod<uid>`) and the kubelet allocated its GPU to a pod: the pod's
          deletion is then made conditional on that UID (DeleteOptions.preconditions), so the API server
          deletes the pod the process runs in or nothing
launcher  its parent (not init) runs as the same user: the ranks one launcher started (torchrun's agent,
          mp.spawn's parent, a batch script) are one job

Every candidate must also carry a launcher's variables (RANK or LOCAL_RANK or SLURM_PROCID, with WORLD_SIZE),
have started before the hang began, and not be this daemon or its parent. A process that fails any of
this is left alone, and the reason is kept for the bundle and the alert.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from watchdog.sample import workload as workloads
from watchdog.sample.ranks import RESTART_VARIABLES, UNLAUNCHED, Job, RankInfo, group_jobs, job_of, number
from watchdog.stacks import nccl_inspector
from watchdog.stacks.sampling import SampleTarget
from watchdog.vocabulary.model import Workload

_LAUNCHED = ("RANK", "LOCAL_RANK", "SLURM_PROCID")

# (Slurm job id, uid) -> None when Slurm confirms the job runs as that user on this node, else why not
SlurmCheck = Callable[[str, int], "str | None"]


def no_slurm(job: str, uid: int) -> str:
    """The Slurm check where none is wired: no Slurm job's ranks are proven."""
    return "no Slurm check is wired here"


@dataclass(frozen=True)
class ProvenJob:
    """Ranks of one job on this node, with what proves it."""

    key: str  # "slurm:4242", "pod:<pod uid>", "launcher:812@1.9e9": unique on this node now
    durable: str  # what survives a restart of the job (the ledger's key): Slurm job, pod, user and program
    proof: str  # a clause: "Slurm job 4242 (slurmstepd's cgroup, confirmed by Slurm)"
    ranks: tuple[RankInfo, ...]
    workload: Workload  # only what is proven (a pod, a Slurm job), never a claim
    pod_uid: str | None = None
    also: tuple[str, ...] = ()  # more ledger keys: a Slurm job's user and program survive a new sbatch

    @property
    def ledger_keys(self) -> tuple[str, ...]:
        """Every key the ledger knows this job by: an action recorded under any of them holds the others."""
        return (self.durable, *(k for k in self.also if k != self.durable))

    def restarted(self) -> tuple[int, float] | None:
        """(how many times its launcher says it restarted the ranks, when the ranks here started: wall seconds)
        where the launcher restarted them (TORCHELASTIC_RESTART_COUNT, SLURM_RESTART_COUNT), else None. A
        rank's environment is its own claim: it may only hold an action back (a job that restarted and hangs
        soon after is left to a person), never cause one."""
        counts = [n for r in self.ranks for name in RESTART_VARIABLES for n in (number(r.env.get(name)),)
                  if n is not None and n > 0]
        return (max(counts), min(r.create_time for r in self.ranks)) if counts else None

    def claimed(self) -> str | None:
        """The job key the ranks' environment gives (RankInfo.job_key), where they all give the same: the name
        a person knows the job by, and the key its pictures, dumps and labels use."""
        claimed = {r.job_key for r in self.ranks}
        return next(iter(claimed)) if len(claimed) == 1 else None

    def name(self) -> str:
        """How an action names the job: its claimed key where the ranks agree on one, with its proof."""
        claimed = self.claimed()
        return f"{claimed} ({self.proof})" if claimed else self.proof


@dataclass(frozen=True)
class LeftAlone:
    rank: RankInfo
    why: str

    def text(self) -> str:
        return f"pid {self.rank.pid}: {self.why}"


def slurm_cgroup(cgroup: str, uid: int | None) -> str | None:
    """The Slurm job id slurmstepd's own cgroup names for a process of user `uid`, or None
    (sample/workload.py holds the rule)."""
    found = workloads.slurm_cgroup(cgroup, uid) if uid is not None else None
    return found[0] if found else None


def _unproven(rank: RankInfo, onset: float, own: Sequence[int]) -> str | None:
    """Why a process cannot be a target whatever proves its job, or None."""
    if rank.pid in own:
        return "this daemon or its parent"
    if rank.problems and rank.uid is None:
        return "could not be described (" + "; ".join(rank.problems) + ")"
    if "WORLD_SIZE" not in rank.env or not set(_LAUNCHED) & rank.env.keys():
        return "not a rank of a launched job (no RANK or LOCAL_RANK with WORLD_SIZE in its environment)"
    if rank.create_time > onset:
        return "started after the hang began"
    if rank.uid is None:
        return "its user could not be read"
    return None


def _digest(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode("utf-8", "surrogateescape")).hexdigest()[:16]


# The interpreter's options that take the next argument (python -W ignore -X dev train.py).
_OPTION_ARGUMENT = frozenset({"-W", "-X", "-Q"})


def _program(rank: RankInfo) -> tuple[str, ...]:
    """What a job runs, as its ranks' command line says it, without its arguments (a relaunch often names a
    new run id or output folder there) or the interpreter's options: the script (`train.py`) or module
    (`-m pkg.train`) a Python rank runs, else the program itself. The same after a relaunch, whatever run id
    the launcher picks or the arguments say."""
    argv = rank.cmdline
    if not argv or "python" not in os.path.basename(argv[0]):
        return argv[:1]
    position = 1
    while position < len(argv):
        arg = argv[position]
        if arg in ("-m", "-c") and position + 1 < len(argv):
            return (arg, argv[position + 1])
        if arg.startswith(("-m", "-c")) and len(arg) > 2:
            return (arg[:2], arg[2:])
        if arg == "-" or not arg.startswith("-"):
            return (os.path.normpath(arg),)  # ./train.py is train.py
        position += 2 if arg in _OPTION_ARGUMENT else 1
    return ()


_Proof = tuple[str, str, str, Workload, "str | None", bool]


def _prove(rank: RankInfo, slurm_check: SlurmCheck) -> _Proof | str:
    """(key, durable, proof, workload, pod uid, whether the ledger also knows the job by its program) for a rank
    whose job is proven, else why it is not."""
    assert rank.uid is not None
    notes = []
    job = slurm_cgroup(rank.cgroup, rank.uid)
    if job is not None:
        refused = slurm_check(job, rank.uid)
        if refused is None:
            w = rank.workload
            proven = Workload(slurm_job_id=job, slurm_step=w.slurm_step if "slurm_step" not in w.claimed else None,
                              slurm_user=w.slurm_user if "slurm_user" not in w.claimed else None)
            return (f"slurm:{job}", f"slurm:{job}", f"Slurm job {job}: slurmstepd's cgroup, confirmed by Slurm",
                    proven, None, True)
        notes.append(f"its cgroup names Slurm job {job}, which Slurm does not confirm ({refused})")
    pod_uid = workloads.pod_uid(rank.cgroup)
    w = rank.workload
    if pod_uid is not None and w.pod and w.namespace and not {"pod", "namespace"} & set(w.claimed):
        # The job is the pod the process runs in: its own cgroup's pod UID, which it cannot choose. The name is
        # the kubelet's for the GPU, which another pod's process sharing that GPU would wrongly carry: so the
        # key and the ledger's key hold the UID and the command, and a deletion is conditional on the UID.
        where = f"{w.namespace}/{w.pod}"
        # A pod's command line is its spec's, the same when its controller makes it again: kept whole, so that
        # two people's pods in one namespace running one script with their own arguments stay two jobs.
        argv = rank.cmdline
        command = argv[1:] if argv[:1] and "python" in os.path.basename(argv[0]) else argv
        return (f"pod:{pod_uid}", f"pod:{w.namespace}:{rank.uid}:{_digest(command)}",
                f"pod UID {pod_uid}, on a GPU the kubelet gave to pod {where}",
                Workload(namespace=w.namespace, pod=w.pod, container=w.container), pod_uid, False)
    if pod_uid is None and w.pod and not {"pod", "namespace"} & set(w.claimed):
        notes.append(f"it runs outside any pod on a GPU the kubelet gave to pod {w.namespace}/{w.pod}")
    parent = rank.parent
    if parent is None:
        return "; ".join([*notes, "no launcher proves its job (its parent is init or gone)"])
    if parent.uid != rank.uid:
        return "; ".join([*notes, f"no launcher proves its job (its parent, pid {parent.pid}, runs as another "
                                  "user)"])
    return (f"launcher:{parent.pid}@{parent.create_time:.2f}", _command_key(rank),
            f"started by pid {parent.pid} as uid {rank.uid}", Workload(), None, False)


def _command_key(rank: RankInfo) -> str:
    """The ledger's key for what a user runs (uid and program): the same on every node of a job and after any
    relaunch of it; two experiments of one user with one script share it, so the guard holds both (it only
    ever holds an action back)."""
    return f"command:{rank.uid}:{_digest(_program(rank))}"


def prove(ranks: Iterable[RankInfo], onset: float, slurm_check: SlurmCheck) -> tuple[list[ProvenJob], list[LeftAlone]]:
    """The proven jobs among `ranks` (each with its members, in rank order) and the processes left alone.
    `onset`: wall seconds the hang began."""
    own = (os.getpid(), os.getppid(), 1)
    groups: dict[str, tuple[_Proof, list[RankInfo]]] = {}
    left = []
    for rank in ranks:
        why = _unproven(rank, onset, own)
        proven = _prove(rank, slurm_check) if why is None else why
        if isinstance(proven, str):
            left.append(LeftAlone(rank, proven))
            continue
        groups.setdefault(proven[0], (proven, []))[1].append(rank)
    jobs = []
    for (key, durable, proof, workload, pod_uid, by_program), members in groups.values():
        uids = {r.uid for r in members}
        if len(uids) > 1:  # one job runs as one user; a mix is not one job
            left.extend(LeftAlone(r, f"{proof}, but its ranks run as {len(uids)} users") for r in members)
            continue
        members.sort(key=lambda r: (r.rank if r.rank is not None else 1 << 30, r.pid))
        extra = (_command_key(members[0]),) if by_program else ()  # its first rank's program: one key, however many
        jobs.append(ProvenJob(key, durable, proof, tuple(members), workload, pod_uid, extra))
    return jobs, left


_PROOF_ORDER = ("slurm:", "pod:", "launcher:")  # the stronger proof first


def named(jobs: Sequence[ProvenJob]) -> list[tuple[str, ProvenJob]]:
    """Each proven job with the name its pictures, dumps and labels use: the job key its ranks claim, where no
    other proven job claims it too. Of several that claim one key, the one proven by Slurm or a pod, else the
    one whose ranks started first, keeps it; the others are named with their proof ("run:x (started by pid 9
    as uid 1002)"), so a job that copies another's claims never answers in its name."""
    by_claim: dict[str, list[ProvenJob]] = {}
    for job in jobs:
        by_claim.setdefault(job.claimed() or "", []).append(job)
    out = []
    for claim, claimants in by_claim.items():
        claimants.sort(key=lambda j: (next((i for i, p in enumerate(_PROOF_ORDER) if j.key.startswith(p)), 9),
                                      min(r.create_time for r in j.ranks)))
        out += [(claim if claim and n == 0 else job.name(), job) for n, job in enumerate(claimants)]
    return out


def conflicts(jobs: Sequence[ProvenJob]) -> dict[str, str]:
    """Proven job key -> why it is not acted on, for the jobs among `jobs` (those on one episode's GPUs) that
    claim one job name and share a GPU, as two users: a process may copy another's RANK and run id onto the GPU
    it shares with that job, and then the name says nothing about which of them hangs, so neither is acted on
    (named() still keeps them apart). One user's jobs (two launchers of one run, a pod per GPU) are no
    conflict, nor are claims on GPUs of their own: a name claimed elsewhere never holds a job's action."""
    by_claim: dict[str, list[ProvenJob]] = {}
    for job in jobs:
        claim = job.claimed()
        if claim and claim != UNLAUNCHED:
            by_claim.setdefault(claim, []).append(job)
    out = {}
    for claim, named_so in by_claim.items():
        claimants = [job for job in named_so if any(
            _shared(job, other) and {r.uid for r in job.ranks} != {r.uid for r in other.ranks}
            for other in named_so if other is not job)]
        if len(claimants) > 1:
            proofs = "; ".join(job.proof for job in claimants[:4])
            for job in claimants:
                out[job.key] = (f"{len(claimants)} proven jobs on these GPUs claim the name {claim} ({proofs}): "
                                "which of them hangs is not known, so neither is acted on")
    return out


def _shared(one: ProvenJob, other: ProvenJob) -> bool:
    """Whether two jobs' ranks hold a GPU in common."""
    return bool({g for r in one.ranks for g in r.gpus} & {g for r in other.ranks for g in r.gpus})


def pictured(ranks: Sequence[RankInfo], slurm_check: SlurmCheck) -> list[Job]:
    """The jobs to look at together (one stack picture each): the proven jobs, whenever their ranks started,
    then the other processes by the job their environment claims (shown, never acted on)."""
    proven, claimed, _ = sorted_out(ranks, slurm_check)
    return proven + claimed


def sorted_out(ranks: Sequence[RankInfo], slurm_check: SlurmCheck) -> tuple[list[Job], list[Job], list[LeftAlone]]:
    """(the proven jobs, by their names; the other processes by the job they claim; why each of those is not
    proven). A claim never puts a process in a proven job's picture, nor gives its picture a proven job's name
    (it is then "<claim> (claimed, unproven)"), so one job's stacks and host activity speak for it alone."""
    jobs, left = prove(ranks, float("inf"), slurm_check)
    proven = [job_of(name, job.ranks) for name, job in named(jobs)]
    taken = {job.key for job in proven}
    claimed = [job_of(f"{job.key} (claimed, unproven)" if job.key in taken else job.key, job.ranks)
               for job in group_jobs(alone.rank for alone in left)]
    return proven, claimed, left


def proofs(found: Sequence[RankInfo], slurm_check: SlurmCheck) -> dict[int, tuple[str, int]]:
    """pid -> (how its job is proven: slurm, pod or launcher; the user the job runs as) of the proven ranks
    among `found`, for rank_info's labels (sample/rank_labels.py)."""
    jobs, _ = prove(found, float("inf"), slurm_check)
    return {r.pid: (job.key.split(":", 1)[0], r.uid) for job in jobs for r in job.ranks if r.uid is not None}


def sample_targets(found: Sequence[RankInfo], slurm_check: SlurmCheck) -> list[SampleTarget]:
    """The ranks among `found` (those on the GPUs now) that are proven members of a job (never a claim), for the
    stack sampler, with where each one's NCCL Inspector log lies if its job writes one. Each names its job by what
    proves it (ProvenJob.key: the Slurm job, the pod's UID, the launcher's process), never by a name it claims."""
    proven, _ = prove(found, float("inf"), slurm_check)
    return [SampleTarget(r.pid, r.create_time, r.gpus, r.rank, job.key, folder,
                         nccl_inspector.host_of(r.pid, r.env.get("HOSTNAME")) if folder else None)
            for job in proven for r in job.ranks if r.rank is not None
            for folder in (nccl_inspector.log_folder(r.env),)]
