"""The actions that end a confirmed hang, each bounded in time, each reporting one Step:

terminate_ranks  SIGTERM the job's ranks on the episode's GPUs through a pidfd opened and checked against
                 the rank's start time (a pid reused since it was listed is never signalled), SIGKILL after
                 actions.grace_seconds; a rank is gone when its pidfd says it exited (a zombie is gone).
                 Under torchrun's elastic agent the workers restart and resume from their checkpoint.
slurm            `scontrol requeue` (or `scancel`) the job's Slurm job; optionally drain this node with a
                 reason of our own (and resume it later, only if that reason is still ours).
kubernetes       delete the ranks' pods (their controller recreates them); optionally taint this node.
command          an argv with the episode JSON on stdin, as the command receiver runs it.

The ranks, the Slurm job and the pod come from act/membership.py: proven, never claimed. Before each step,
and while a grace period runs, `stop` is asked (the pause file, a reload out of act mode, the evidence
bundle gone): what has not been done then is not done.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

from watchdog.act import pidfds
from watchdog.boundary import children, http_client, privileges, secrets
from watchdog.config import ActionsConfig
from watchdog.sample.ranks import RankInfo
from watchdog.vocabulary.model import K8S_NAME, Workload
from watchdog.vocabulary.words import iso_time, number_runs

DONE, FAILED, TIMED_OUT, DRY_RUN, SKIPPED, STOPPED = "done", "failed", "timed_out", "dry_run", "skipped", "stopped"
RESULTS = (DONE, FAILED, TIMED_OUT, DRY_RUN, SKIPPED, STOPPED)
_SLURM_CACHE_SECONDS = 30.0
_SLURM_JOB = re.compile(r"^\d{1,12}(_\d{1,9})?$")


class ActionError(Exception):
    """An action that could not be done; the message says why (never a secret)."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


class Skipped(Exception):
    """An action that does not apply to this hang (no Slurm job, no pod): said, not failed."""


class Stopped(Exception):
    """An action stopped between two of its steps (paused, reloaded out of act, the evidence gone)."""


@dataclass(frozen=True)
class Target:
    """What an action acts on: the hung job's ranks on this node, where they run, the episode."""

    job: str
    ranks: tuple[RankInfo, ...]
    workload: Workload
    episode: dict[str, object]  # the episode JSON the command action gets on stdin
    bundle: str | None
    node: str
    pod_uid: str | None = None  # the pod UID the ranks' own cgroup names: a delete is conditional on it

    def rank_text(self) -> str:
        """'ranks 0-3', 'pids 812, 813' where ranks have no number."""
        numbers = sorted({r.rank for r in self.ranks if r.rank is not None})
        if numbers and len(numbers) == len(self.ranks):
            return ("rank " if len(numbers) == 1 else "ranks ") + number_runs(numbers)
        return ("pid " if len(self.ranks) == 1 else "pids ") + ", ".join(str(r.pid) for r in self.ranks)


@dataclass
class Step:
    action: str
    result: str
    started: float  # wall seconds
    seconds: float
    detail: str
    ended: bool = False  # done, and what it did ends the job (ranks gone, job requeued, pod deleted, the command)

    def to_json(self) -> dict[str, object]:
        return {"action": self.action, "result": self.result, "started": self.started,
                "seconds": round(self.seconds, 3), "detail": self.detail, "ended_the_job": self.ended}


@dataclass
class Actions:
    """The configured actions, run in order. `wall` is handed in by tests."""

    cfg: ActionsConfig
    wall: Callable[[], float] = time.time
    drained: set[str] = field(default_factory=set)  # nodes this daemon drained (for resume)
    # job -> (monotonic time, squeue's answer, why squeue failed or None)
    _slurm_seen: dict[str, tuple[float, str, str | None]] = field(default_factory=dict)

    def run(self, target: Target, dry: bool, stop: Callable[[], str | None] = lambda: None) -> list[Step]:
        """Each configured action in order. `stop()` says why to stop now (or None): asked before each action
        and during terminate_ranks' grace period; the actions not done are said as stopped."""
        steps = []
        for name in self.cfg.do:
            started, clock = self.wall(), time.monotonic()
            if dry:
                steps.append(Step(name, DRY_RUN, started, 0.0, "would " + self.describe(name, target)))
                continue
            why = stop()
            if why is not None:
                steps.append(Step(name, STOPPED, started, 0.0, f"not done: {why}"))
                continue
            try:
                detail, result = (self.terminate_ranks(target, stop) if name == "terminate_ranks"
                                  else getattr(self, name)(target)), DONE
            except Skipped as exc:
                detail, result = str(exc), SKIPPED
            except Stopped as exc:
                detail, result = str(exc), STOPPED
            except ActionError as exc:
                detail, result = str(exc), TIMED_OUT if exc.timed_out else FAILED
            steps.append(Step(name, result, started, time.monotonic() - clock, detail,
                              ended=result == DONE and self._ends_the_job(name)))
        return steps

    def _ends_the_job(self, name: str) -> bool:
        """Whether `name`, done, ended the job: not a drain or a taint alone."""
        if name == "slurm":
            return self.cfg.slurm.job != "none"
        if name == "kubernetes":
            return self.cfg.kubernetes.delete_pods
        return True

    def describe(self, name: str, target: Target) -> str:
        """What the action would do, in a clause: 'terminate ranks 0-3 of job run:abc'."""
        if name == "terminate_ranks":
            return f"terminate {target.rank_text()} of job {target.job}"
        if name == "slurm":
            s = self.cfg.slurm
            what = {"requeue": "requeue", "cancel": "cancel", "none": "leave"}[s.job]
            job = _slurm_job(target.workload)
            return (f"{what} Slurm job {job or '(none known)'}" + (f" and drain node {self._slurm_node()}"
                                                                    if s.drain else ""))
        if name == "kubernetes":
            k = self.cfg.kubernetes
            pod = target.workload.pod if "pod" not in target.workload.claimed else None
            return " and ".join(filter(None, [f"delete pod {target.workload.namespace}/{pod}" if k.delete_pods
                                              else "", "taint this node" if k.taint else ""])) or "nothing"
        return f"run {os.path.basename((self.cfg.command or ['?'])[0])}"

    # -- terminate_ranks ---------------------------------------------------------------------------
    def terminate_ranks(self, target: Target, stop: Callable[[], str | None] = lambda: None) -> str:
        victims: list[tuple[int, int]] = []  # (pid, pidfd)
        try:
            for rank in target.ranks:
                if rank.pid in (1, os.getpid(), os.getppid()):
                    continue
                fd = pidfds.open_checked(rank.pid, rank.create_time)
                if fd is not None:
                    victims.append((rank.pid, fd))
            if not victims:
                raise Skipped("no rank of the job is left on the episode's GPUs")
            for pid, fd in victims:
                pidfds.send(pid, fd, signal.SIGTERM)
            grace = min(self.cfg.grace_seconds, self.cfg.timeout_seconds)
            alive = pidfds.wait_gone(victims, grace, stop)
            if alive:
                why = stop()
                if why is not None:
                    raise Stopped(f"sent SIGTERM to {target.rank_text()}; SIGKILL not sent to pids "
                                  f"{', '.join(str(p) for p, _ in alive)}: {why}")
                for pid, fd in alive:
                    pidfds.send(pid, fd, signal.SIGKILL)
            still = pidfds.wait_gone(alive, max(1.0, self.cfg.timeout_seconds - grace), lambda: None)
            if still:
                raise ActionError(f"pids {', '.join(str(p) for p, _ in still)} still there after SIGKILL, within "
                                  f"{self.cfg.timeout_seconds:g} s", timed_out=True)
            killed = f"; {len(alive)} needed SIGKILL after {grace:g} s" if alive else ""
            return f"terminated {target.rank_text()} of job {target.job} ({len(victims)} processes{killed})"
        except pidfds.SignalRefused as exc:
            raise ActionError(str(exc)) from None
        finally:
            for _, fd in victims:
                os.close(fd)

    # -- slurm -------------------------------------------------------------------------------------
    def _slurm_node(self) -> str:
        return self.cfg.slurm.node_name or os.uname().nodename.split(".")[0]

    def _slurm_command(self, *argv: str) -> str:
        conf = self.cfg.slurm.conf
        try:
            return children.run(argv, timeout=self.cfg.timeout_seconds, env={"SLURM_CONF": conf} if conf else None)
        except children.CommandError as exc:
            raise ActionError(str(exc), exc.timed_out) from None

    def _scontrol(self, *args: str) -> str:
        return self._slurm_command(self.cfg.slurm.scontrol, *args)

    def slurm_job_runs_as(self, job: str, uid: int) -> str | None:
        """None when Slurm says job `job` is running (or suspended) as user `uid`; else why not. Slurm's own
        word for what a cgroup path suggests (act/membership.py), asked of squeue in a fixed format with no
        text a user chose in it (a job's name or comment could hold "UserId=..."); answers are kept a while."""
        cached = self._slurm_seen.get(job)
        if cached is None or time.monotonic() - cached[0] > _SLURM_CACHE_SECONDS:
            try:
                cached = (time.monotonic(), self._slurm_command(self.cfg.slurm.squeue, "--noheader", "--jobs", job,
                                                                "--format", "%A|%U|%T"), None)
            except ActionError as exc:
                cached = (time.monotonic(), "", str(exc))
            self._slurm_seen[job] = cached
            while len(self._slurm_seen) > 64:
                self._slurm_seen.pop(next(iter(self._slurm_seen)))
        _, shown, failed = cached
        if failed is not None:
            return f"squeue --jobs {job}: {failed}"
        rows = [line.split("|") for line in shown.splitlines() if line.strip()]
        mine = [row for row in rows if len(row) == 3 and row[0].strip() == job]
        if not mine:
            return f"Slurm has no job {job}"
        _, user, state = (field.strip() for field in mine[0])
        if state not in ("RUNNING", "SUSPENDED"):
            return f"Slurm says job {job} is {state}"
        if user != str(uid):
            return f"Slurm says job {job} runs as uid {user}, not as uid {uid}"
        return None

    def slurm(self, target: Target) -> str:
        s, done = self.cfg.slurm, []
        job = _slurm_job(target.workload)
        if s.job != "none":
            if job is None:
                raise Skipped("no Slurm job known from the ranks' cgroups (a rank's own SLURM_JOB_ID is not trusted)")
            if s.job == "requeue":
                self._scontrol("requeue", job)
                done.append(f"requeued Slurm job {job}")
            else:
                self._slurm_command(s.scancel, job)
                done.append(f"cancelled Slurm job {job}")
        if s.drain:
            node = self._slurm_node()
            reason = f"{s.drain_reason_prefix} hang of job {job or target.job} at {iso_time(self.wall())}"
            self._scontrol("update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}")
            self.drained.add(node)
            done.append(f"drained node {node}")
        if not done:
            raise Skipped("slurm.job is none and slurm.drain is off")
        return "; ".join(done)

    def resume_drained(self) -> list[str]:
        """Resume the nodes this daemon drained whose reason is still ours; returns what was resumed."""
        resumed = []
        for node in sorted(self.drained):
            shown = self._scontrol("show", "node", node, "--oneliner")
            reason = shown.split(" Reason=", 1)[1] if " Reason=" in shown else ""
            if reason.startswith(self.cfg.slurm.drain_reason_prefix):
                self._scontrol("update", f"NodeName={node}", "State=RESUME")
                resumed.append(node)
            self.drained.discard(node)
        return resumed

    # -- kubernetes --------------------------------------------------------------------------------
    def _api(self, method: str, path: str, body: object | None = None,
             content_type: str = "application/json") -> dict[str, object]:
        k = self.cfg.kubernetes
        try:
            token = secrets.read_file(k.token_file, "actions.kubernetes.token_file")
        except secrets.SecretError as exc:
            raise ActionError(str(exc)) from None
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        ca = k.ca_file if k.ca_file and os.path.exists(k.ca_file) else None
        try:
            answer = http_client.request(method, k.api_url.rstrip("/") + path, data, headers,
                                         timeout=self.cfg.timeout_seconds, ca_file=ca)
        except http_client.HttpError as exc:
            raise ActionError(f"Kubernetes API: {exc}", exc.timed_out) from None
        except ValueError as exc:
            raise ActionError(f"actions.kubernetes.api_url: {exc}") from None
        if answer.status == 404 and method == "DELETE":
            return {}
        if not 200 <= answer.status < 300:
            raise ActionError(f"Kubernetes API answered {method} with HTTP {answer.status}")
        try:
            parsed = json.loads(answer.body or b"{}")
        except ValueError:
            raise ActionError("Kubernetes API: the answer is not JSON") from None
        return parsed if isinstance(parsed, dict) else {}

    def kubernetes(self, target: Target) -> str:
        k, w, done = self.cfg.kubernetes, target.workload, []
        if k.delete_pods:
            trusted = not {"namespace", "pod"} & set(w.claimed)
            if not (w.namespace and w.pod and trusted and target.pod_uid and K8S_NAME.match(w.namespace)
                    and K8S_NAME.match(w.pod)):
                raise Skipped("no pod proven: the kubelet's allocation and the ranks' own pod cgroup must agree (a "
                              "rank's HOSTNAME is not trusted)")
            path = (f"/api/v1/namespaces/{urllib.parse.quote(w.namespace)}/pods/{urllib.parse.quote(w.pod)}")
            # Deleted only if it is still the pod the ranks run in: the API server checks the UID (409 if not).
            self._api("DELETE", path, {"apiVersion": "v1", "kind": "DeleteOptions",
                                       "gracePeriodSeconds": k.grace_seconds, "propagationPolicy": "Background",
                                       "preconditions": {"uid": target.pod_uid}})
            done.append(f"deleted pod {w.namespace}/{w.pod}")
        if k.taint:
            node = os.environ.get(k.node_name_env, "")
            if not K8S_NAME.match(node):
                raise ActionError(f"cannot taint: {k.node_name_env} does not hold a node name")
            done.append(self._taint(node))
        if not done:
            raise Skipped("kubernetes.delete_pods and kubernetes.taint are both off")
        return "; ".join(done)

    def _taint(self, node: str) -> str:
        """Add our NoSchedule taint, keeping every other one; the node's resourceVersion makes a concurrent
        change fail (HTTP 409) rather than be lost."""
        key = self.cfg.kubernetes.taint_key
        path = f"/api/v1/nodes/{urllib.parse.quote(node)}"
        current = self._api("GET", path)
        spec, metadata = current.get("spec"), current.get("metadata")
        spec = spec if isinstance(spec, dict) else {}
        metadata = metadata if isinstance(metadata, dict) else {}
        listed = spec.get("taints")
        taints = [t for t in listed if isinstance(t, dict)] if isinstance(listed, list) else []
        if any(t.get("key") == key for t in taints):
            return f"node {node} already carries taint {key}"
        taints.append({"key": key, "value": "true", "effect": "NoSchedule",
                       "timeAdded": iso_time(self.wall())})
        patch = {"metadata": {"resourceVersion": metadata.get("resourceVersion")}, "spec": {"taints": taints}}
        self._api("PATCH", path, patch, "application/merge-patch+json")
        return f"tainted node {node} with {key}:NoSchedule"

    # -- command -----------------------------------------------------------------------------------
    def command(self, target: Target) -> str:
        argv = [*(self.cfg.command or []), target.bundle or ""]
        try:
            children.run(argv, json.dumps(target.episode), self.cfg.timeout_seconds)
        except children.CommandError as exc:
            raise ActionError(str(exc), exc.timed_out) from None
        return f"ran {os.path.basename(argv[0])}"


def problems(cfg: ActionsConfig) -> list[str]:
    """What would make a configured action fail every time, found before any hang: a program not on the
    PATH, an unreadable token, a URL that is not one, a capability the action needs. Nothing while the mode is
    observe."""
    if cfg.mode == "observe":
        return []
    found = []
    path = children.environment()["PATH"]
    programs = {"slurm": [cfg.slurm.scontrol] + ([cfg.slurm.scancel] if cfg.slurm.job == "cancel" else []),
                "command": (cfg.command or [])[:1]}
    for action in cfg.do:
        for program in programs.get(action, []):
            if shutil.which(program, path=path) is None:
                found.append(f"actions.{action}: {program} is not an executable found on the daemon's PATH")
    if cfg.mode == "act" and "terminate_ranks" in cfg.do:
        found += [short.text() for short in privileges.shortfalls(stacks=False, terminate=True)]
    if cfg.mode == "act" and cfg.pause_file and not os.path.isdir(os.path.dirname(cfg.pause_file)):
        found.append(f"actions.pause_file: its folder {os.path.dirname(cfg.pause_file)} does not exist, so the pause "
                     "switch could never be set (systemd: deploy/systemd/actions.conf makes /run/stall-watchdog; "
                     "Kubernetes: the actions component mounts it)")
    if "kubernetes" in cfg.do:
        try:
            http_client.split(cfg.kubernetes.api_url)
            secrets.read_file(cfg.kubernetes.token_file, "actions.kubernetes.token_file")
        except (ValueError, secrets.SecretError) as exc:
            found.append(f"actions.kubernetes: {exc}")
    return found


def _slurm_job(workload: Workload) -> str | None:
    job = workload.slurm_job_id
    if job is None or "slurm_job_id" in workload.claimed or not _SLURM_JOB.match(job):
        return None
    return job
