"""Training ranks: which processes run on each GPU, which rank and job each is, and what it does on
the host (CPU time, I/O, thread states).

NVML reports host pids per GPU; without a GPU (or to find ranks NVML does not list) a scan finds the
processes that a launcher gave a rank (RANK/LOCAL_RANK with WORLD_SIZE: torchrun, Slurm, DeepSpeed).
Environment variables are kept for diagnosis only; they are never exported as metric labels.
A process that exits, a reused pid or an unreadable /proc file is counted and reported, never fatal.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from watchdog.boundary.secrets import REDACTED as REDACTED  # re-exported: tests and callers name it here
from watchdog.boundary.secrets import redact_arguments, redact_variable
from watchdog.sample import workload
from watchdog.sample.kubelet import PodDirectory
from watchdog.sample.proc_counters import HostActivity, proc_counters, read_proc, stat_counters
from watchdog.sample.workload import WORKLOAD_VARIABLES
from watchdog.vocabulary.model import NodeSnapshot, Workload
from watchdog.vocabulary.stack_model import member_id

# How many times the launcher restarted a rank (torchrun's elastic agent; Slurm's requeue).
RESTART_VARIABLES = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
# Launch variables read from each rank's environment, and those that say which pod or Slurm job it is.
RANK_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID",
    "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_JOBID", "CUDA_VISIBLE_DEVICES", *RESTART_VARIABLES,
    *WORKLOAD_VARIABLES,
)
KEPT_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_FR_", "GLOO_")
_CONTAINER_ID = re.compile(r"[0-9a-f]{64}")
_CGROUP_MAX = 16 * 1024
# /proc/<pid>/environ is as long as the process made it (the kernel bounds each string, not their number):
# what is read of it is bounded. Launchers put their variables in the first few KiB.
_ENVIRON_MAX = 1 << 20
_ENVIRON_KEPT = 256  # variables kept of one process (NCCL_* and the like: a real job sets a few dozen)


JOB_KEY_MAX = 200  # characters of a job key (a metric and alert label)
UNLAUNCHED = "unlaunched"  # the key of processes that claim no job


def _job_key(kind: str, claim: str) -> str:
    """A job key from what a rank's environment claims: the claim as it is when it is printable and short,
    else its printable head and a digest of the whole, so that two long claims stay two jobs."""
    if len(claim) <= JOB_KEY_MAX and claim.isprintable():
        return f"{kind}:{claim}"
    digest = hashlib.sha256(claim.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    head = "".join(c if c.isprintable() else "?" for c in claim[:JOB_KEY_MAX - len(digest) - 1])
    return f"{kind}:{head}~{digest}"


def claimed_key(env: Mapping[str, str]) -> str:
    """The job a rank's environment claims: the elastic run id, else the rendezvous address, else Slurm's job."""
    if env.get("TORCHELASTIC_RUN_ID") and env["TORCHELASTIC_RUN_ID"] != "none":
        return _job_key("run", env["TORCHELASTIC_RUN_ID"])
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return _job_key("master", f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}")
    if env.get("SLURM_JOB_ID"):
        return _job_key("slurm", env["SLURM_JOB_ID"])
    return UNLAUNCHED  # no launcher variables: the processes chosen (or on the GPUs) form one picture


@dataclass(frozen=True)
class Parent:
    """The process that started a rank, as the kernel says (its /proc/<pid>/stat): what a launcher's tree is
    made of. A process cannot choose its parent; it can choose every variable and name."""

    pid: int
    create_time: float
    uid: int | None  # its real user id


@dataclass(frozen=True)
class RankInfo:
    pid: int
    create_time: float
    cmdline: tuple[str, ...]
    gpus: tuple[int, ...]
    env: Mapping[str, str]  # launch variables plus NCCL_*, TORCH_NCCL_*, GLOO_*; diagnosis only
    activity: HostActivity | None
    container: str | None = None  # the container id (or cgroup path) the process runs in
    problems: tuple[str, ...] = ()  # what could not be read
    workload: Workload = Workload()  # its pod or Slurm job
    uid: int | None = None  # the real user id it runs as (the kernel's word)
    parent: Parent | None = None  # None where it has none to read (pid 1's children, a parent gone)
    cgroup: str = ""  # /proc/<pid>/cgroup: where slurmstepd or the kubelet put it (the kernel's word)
    env_read: bool = True  # False: its environment could not be read (env is empty, not unset; problems say why)

    def _int(self, name: str) -> int | None:
        return number(self.env.get(name))

    @property
    def rank(self) -> int | None:
        rank = self._int("RANK")
        return rank if rank is not None else self._int("SLURM_PROCID")

    @property
    def local_rank(self) -> int | None:
        return self._int("LOCAL_RANK")

    @property
    def world_size(self) -> int | None:
        return self._int("WORLD_SIZE")

    @property
    def job_key(self) -> str:
        """Ranks of one job share this (claimed_key of its environment)."""
        return claimed_key(self.env)

    @property
    def label(self) -> str:
        """How a person names this process: 'rank 4 (pid 688514, GPU 4)'."""
        where = [f"pid {self.pid}"] + ([f"GPU {', '.join(map(str, self.gpus))}"] if self.gpus else [])
        head = member_id(self.pid, self.rank)
        return f"{head} ({', '.join(where)})" if self.rank is not None else (
            f"{head} ({where[1]})" if len(where) > 1 else head)


@dataclass(frozen=True)
class Job:
    key: str
    ranks: tuple[RankInfo, ...]
    world_size: int | None

    @property
    def spans_other_nodes(self) -> bool:
        """More ranks in the job than on this node: an all-local wait may be a wait on a remote rank."""
        return self.world_size is not None and self.world_size > len(self.ranks)


def job_of(key: str, members: Iterable[RankInfo]) -> Job:
    """One job of these ranks, in rank order, its world size the one most of them give."""
    ranks = sorted(members, key=lambda r: (r.rank if r.rank is not None else 1 << 30, r.pid))
    sizes = Counter(r.world_size for r in ranks if r.world_size is not None)
    return Job(key, tuple(ranks), sizes.most_common(1)[0][0] if sizes else None)


def group_jobs(ranks: Iterable[RankInfo]) -> list[Job]:
    """The ranks by the job their environment claims: for pictures and words, never to act on
    (act/membership.py proves a job)."""
    by_key: dict[str, list[RankInfo]] = {}
    for rank in ranks:
        by_key.setdefault(rank.job_key, []).append(rank)
    return [job_of(key, members) for key, members in by_key.items()]


class RankDiscovery:
    """Describes processes. `proc_root` is where environ, cgroup and thread states are read from (tests
    point it at a fixture tree); psutil supplies the rest. `pods` names the pod holding a GPU (the kubelet's
    pod-resources API), where the daemon runs on Kubernetes."""

    def __init__(self, proc_root: str | Path = "/proc", pods: PodDirectory | None = None):
        self.proc_root = Path(proc_root)
        self.pods = pods
        self.counters: Counter[str] = Counter()  # gone, pid_reused, unreadable_environ, ...

    def _read(self, pid: int, name: str, limit: int) -> bytes:
        """The first `limit` bytes of /proc/<pid>/<name> (read in one go: a /proc file is no pipe)."""
        with open(self.proc_root / str(pid) / name, "rb", buffering=0) as file:
            chunks, left = [], limit
            while left > 0:
                chunk = file.read(min(left, 1 << 16))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
        return b"".join(chunks)

    def environment(self, pid: int, count: bool = True) -> tuple[dict[str, str], str | None]:
        """(kept variables, problem). Reads /proc/<pid>/environ: the environment the process started with.
        `count`: whether an unreadable one is counted (a scan reads every process; most are not ours)."""
        try:
            raw = self._read(pid, "environ", _ENVIRON_MAX)
        except OSError as exc:
            if count:
                self.counters["unreadable_environ"] += 1
            if isinstance(exc, PermissionError):
                return {}, ("environ: permission denied (another user's or a more privileged process needs "
                            "CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH)")
            return {}, f"environ: {exc.strerror or exc}"
        entries = raw.split(b"\0")
        if len(raw) >= _ENVIRON_MAX:  # cut: its last entry may be half a variable (RANK=1 of RANK=12)
            entries.pop()
        env: dict[str, str] = {}
        for entry in entries:
            key, sep, value = entry.partition(b"=")
            if not sep:
                continue
            name = key.decode(errors="replace")
            if (name in RANK_VARIABLES or name.startswith(KEPT_PREFIXES)) and len(env) < _ENVIRON_KEPT:
                env[name] = redact_variable(name, value.decode(errors="replace"))
        return env, None

    def cgroup(self, pid: int) -> str:
        """/proc/<pid>/cgroup, '' where it cannot be read (at most 16 KiB: the kernel writes it, paths are
        bounded, but a deep tree of long names is not small)."""
        try:
            return self._read(pid, "cgroup", _CGROUP_MAX).decode(errors="replace")
        except OSError:
            return ""

    @staticmethod
    def parent(process: psutil.Process) -> Parent | None:
        """The rank's parent with its start time and user, or None where it has none worth naming (pid 0 or
        1: an orphan adopted by init) or it is gone."""
        try:
            ppid = process.ppid()
            if ppid <= 1:
                return None
            up = psutil.Process(ppid)
            return Parent(ppid, up.create_time(), up.uids().real)
        except (psutil.Error, OSError):
            return None

    @staticmethod
    def container(cgroup: str) -> str | None:
        """The container id (or the cgroup path) in a process's /proc/<pid>/cgroup text."""
        for line in cgroup.splitlines():
            path = line.rpartition(":")[2]
            found = _CONTAINER_ID.findall(path)
            if found:
                return found[-1][:12]
            if path not in ("", "/") and not path.startswith("/user.slice") and not path.startswith("/init.scope"):
                return path
        return None

    def thread_states(self, pid: int) -> dict[str, int]:
        states: Counter[str] = Counter()
        try:
            tasks = list((self.proc_root / str(pid) / "task").iterdir())
        except OSError:
            return {}
        for task in tasks:
            try:
                stat = read_proc(str(task / "stat"))
            except OSError:
                continue  # the thread ended while we looked
            # "tid (comm) S ...": the comm is whatever bytes the thread named itself (spaces, parentheses,
            # invalid UTF-8); the state follows the last ')'
            state = stat.rpartition(b")")[2].split(None, 1)
            if state:
                states[state[0].decode("ascii", "replace")] += 1
        return dict(states)

    def activity(self, process: psutil.Process) -> HostActivity:
        try:
            _, cpu, read, write = proc_counters(process.pid)
        except (OSError, ValueError, IndexError):
            raise psutil.NoSuchProcess(process.pid) from None
        return HostActivity(cpu, read, write, self.thread_states(process.pid))

    def pod_answers(self) -> int:
        """How many answers the kubelet has given (0 without one): with_pod's reading changes only with a new one."""
        return self.pods.answers if self.pods is not None else 0

    def settle_pods(self, uuids: Iterable[str]) -> None:
        """Off the loop, before an incident's look names its ranks' pods: wait (at most the kubelet's
        timeout and a second) for an answer that can name these GPUs' holders."""
        if self.pods is not None:
            self.pods.settle(uuids, self.pods.client.timeout_seconds + 1.0)

    def with_pod(self, found: Workload, uuids: Iterable[str]) -> Workload:
        """`found`, with the pod and container the kubelet says hold these GPUs in first place (its last
        answer; never waits)."""
        held = self.pods.holder(uuids) if self.pods is not None else None
        if held is None:
            return found
        return workload.merged(Workload(namespace=held.namespace, pod=held.pod, container=held.container), found)

    def workload(self, env: Mapping[str, str], cgroup: str, uuids: Iterable[str] = (),
                 uid: int | None = None) -> Workload:
        """The pod (the kubelet's answer for the rank's GPUs, else its cgroup) and the Slurm job of a rank."""
        return self.with_pod(workload.merged(workload.pod_from_cgroup(env, cgroup),
                                             workload.slurm(env, cgroup, uid)), uuids)

    def describe(self, pid: int, gpus: tuple[int, ...] = (), expect_create_time: float | None = None,
                 uuids: tuple[str, ...] = ()) -> RankInfo | None:
        """The process now, or None when it is gone (or its pid now belongs to another process). `uuids`:
        its GPUs' UUIDs, to ask the kubelet which pod holds them."""
        try:
            process = psutil.Process(pid)
            create_time = process.create_time()
            if expect_create_time is not None and abs(create_time - expect_create_time) > 0.01:
                self.counters["pid_reused"] += 1
                return None
            try:
                cmdline = redact_arguments(process.cmdline())
            except psutil.AccessDenied:
                cmdline = ()
            activity = self.activity(process)
            uid = process.uids().real
        except psutil.NoSuchProcess:
            self.counters["gone"] += 1
            return None
        except psutil.AccessDenied:
            self.counters["access_denied"] += 1
            return RankInfo(pid, 0.0, (), gpus, {}, None, problems=("process: access denied",), env_read=False)
        env, problem = self.environment(pid)
        cgroup = self.cgroup(pid)
        return RankInfo(pid, create_time, cmdline, gpus, env, activity, self.container(cgroup),
                        problems=(problem,) if problem else (), workload=self.workload(env, cgroup, uuids, uid),
                        uid=uid, parent=self.parent(process), cgroup=cgroup, env_read=problem is None)

    def from_snapshot(self, snapshot: NodeSnapshot) -> list[RankInfo]:
        """The compute processes NVML lists on each GPU."""
        gpus_of: dict[int, list[int]] = {}
        uuids_of: dict[int, list[str]] = {}
        for gpu in snapshot.gpus:
            for pid in gpu.pids:
                gpus_of.setdefault(pid, []).append(gpu.index)
                if gpu.uuid:
                    uuids_of.setdefault(pid, []).append(gpu.uuid)
        ranks = (self.describe(pid, tuple(gpus), uuids=tuple(uuids_of.get(pid, ())))
                 for pid, gpus in sorted(gpus_of.items()))
        return [r for r in ranks if r is not None]

    def scan(self, keys: Collection[str] = (), limit: int | None = None) -> list[RankInfo]:
        """Every process a launcher gave a rank: RANK or LOCAL_RANK (or SLURM_PROCID) with WORLD_SIZE. `keys`:
        only those claiming one of these jobs (claimed_key). `limit`: describe at most this many, the longest
        running first (a job's ranks were there before anyone who copies its claims), and count the rest
        (`scan_over_limit`): any user can start thousands of processes that claim to be ranks."""
        claims = []
        for pid in (int(p.name) for p in self.proc_root.iterdir() if p.name.isdigit() and int(p.name) != os.getpid()):
            env, _ = self.environment(pid, count=False)
            if "WORLD_SIZE" in env and {"RANK", "LOCAL_RANK", "SLURM_PROCID"} & env.keys() and (
                    not keys or claimed_key(env) in keys):
                with contextlib.suppress(OSError, ValueError, IndexError):  # else gone
                    claims.append((stat_counters(read_proc(f"{self.proc_root}/{pid}/stat"))[0], pid, env))
        claims.sort()
        if limit is not None and len(claims) > limit:
            self.counters["scan_over_limit"] += len(claims) - limit
        found = (self.describe(pid, _visible_gpus(env)) for _, pid, env in sorted(claims[:limit], key=lambda c: c[1]))
        return [rank for rank in found if rank is not None]


def _visible_gpus(env: Mapping[str, str]) -> tuple[int, ...]:
    """Without NVML, the GPU a rank uses is a guess: its LOCAL_RANK-th visible device. Returned only
    when CUDA_VISIBLE_DEVICES lists indexes."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    position = number(env.get("LOCAL_RANK"))
    if visible is None or position is None:
        return ()
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    if position < len(devices) and (device := number(devices[position])) is not None:
        return (device,)
    return ()


def number(text: str | None) -> int | None:
    """A rank, size or device index a rank's environment claims: ASCII digits (at most 9), else None.
    (`str.isdigit` and `int` take other scripts' digits and superscripts: '²', '٣'.)"""
    if text is None:
        return None
    text = text.strip()
    if not text or len(text) > 9 or not text.isascii() or not text.isdigit():
        return None
    return int(text)
