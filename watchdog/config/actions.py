"""What may be done about a confirmed hang, and the guards around it."""

from __future__ import annotations

import os
from typing import Annotated, Literal

from watchdog.config.base import Ratio, Seconds, SecondsOrZero, _prometheus_url, _Section
from watchdog.config.schema import Field, field_validator, model_validator

ACTION_NAMES = ("terminate_ranks", "slurm", "kubernetes", "command")


class SlurmActionConfig(_Section):
    """The `slurm` action: what is done to the hung job's Slurm job, and to this node."""

    job: Literal["requeue", "cancel", "none"] = Field(
        "requeue", description="requeue: `scontrol requeue` (the job must be requeueable: sbatch --requeue); "
        "cancel: `scancel`; none: leave the job to terminate_ranks.")
    drain: bool = Field(False, description="Also drain this node (`scontrol update State=DRAIN`) with a reason "
                        "that begins with drain_reason_prefix.")
    drain_reason_prefix: str = Field(
        "stall-watchdog:", min_length=1, max_length=40, description="The daemon only ever resumes a node whose "
        "drain reason begins with this: a drain set by a person or another tool is never undone.")
    resume_after_seconds: Annotated[float, Field(ge=0, le=7 * 86400, allow_inf_nan=False)] = Field(
        0.0, description="Resume a node the daemon drained once it has had no open critical episode for this long. "
        "0: never (a person resumes it: scontrol update NodeName=... State=RESUME).")
    node_name: str | None = Field(None, description="This node's name in slurm.conf (default: the short host name).")
    scontrol: str = Field("scontrol", description="The scontrol program (the PATH is searched).")
    conf: str | None = Field(None, description="The slurm.conf scontrol, scancel and squeue read (SLURM_CONF). None: "
                             "Slurm's own default.")
    scancel: str = Field("scancel", description="The scancel program (the PATH is searched).")
    squeue: str = Field("squeue", description="The squeue program (the PATH is searched), which confirms that the "
                        "Slurm job a rank's cgroup names runs as the rank's user before anything is done to it.")


class KubernetesActionConfig(_Section):
    """The `kubernetes` action: delete the hung ranks' pods on this node (their controller recreates them)."""

    api_url: str = Field("https://kubernetes.default.svc", description="The API server.")
    token_file: str = Field("/var/run/secrets/kubernetes.io/serviceaccount/token",
                            description="The service account token (deploy/kubernetes/actions adds the RBAC).")
    ca_file: str | None = Field("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
                                description="The API server's CA bundle (None: the system's).")
    node_name_env: str = Field("NODE_NAME", description="The variable holding this node's name (the DaemonSet sets "
                               "it from spec.nodeName); needed for taint.")
    delete_pods: bool = Field(True, description="Delete the pods of the hung ranks on this node.")
    grace_seconds: Annotated[int, Field(ge=0, le=3600)] = Field(
        30, description="gracePeriodSeconds of the delete: the pod's containers get SIGTERM, then SIGKILL.")
    taint: bool = Field(False, description="Also taint this node NoSchedule with taint_key (the daemon removes only "
                        "its own key, and only by a person's hand: kubectl taint node NAME KEY-).")
    taint_key: str = Field("stall-watchdog.io/hang", description="The taint's key.")


class FleetConfig(_Section):
    """The fleet circuit breaker: no node acts while too many nodes acted lately (a fabric outage hangs
    every job at once; ending them all would only restart them into the same outage)."""

    prometheus_url: str | None = Field(
        None, description="A Prometheus that scrapes every node's daemon and loads deploy/prometheus/rules.yml. "
        "Asked for stall_watchdog:fleet_acted_ratio before each action; no answer: no action. None: no breaker.")
    max_ratio: Ratio = Field(0.1, description="Act only while at most this share of the fleet's nodes acted in the "
                             "rules' window (10 minutes).")
    timeout_seconds: Seconds = Field(5.0, description="The query is abandoned after this long (then: no action).")

    _url = field_validator("prometheus_url")(classmethod(lambda cls, value: _prometheus_url(value)))


class ActionsConfig(_Section):
    """What the daemon does about a confirmed hang by itself. Off (observe) by default: roll out as observe,
    then dry_run, then act on a canary partition, then act (docs/actions.md: Acting on a hang)."""

    mode: Literal["observe", "dry_run", "act"] = Field(
        "observe", description="observe: never act; dry_run: alert what would have been done; act: do it.")
    after_seconds: Annotated[float, Field(ge=0, le=7 * 86400, allow_inf_nan=False)] = Field(
        120.0, description="How long a critical episode must have lasted before anything is done.")
    do: list[Literal[ACTION_NAMES]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: ["terminate_ranks"], description="The actions, in order: terminate_ranks, slurm, "
        "kubernetes, command.")
    on_telemetry_only: bool = Field(
        False, description="Act on a proven job's critical episode that no live evidence confirms (its stacks "
        "not captured). Off: only a hang whose ranks' stacks show them blocked, or whose host progress is still. "
        "Either way only ranks proven in a job are acted on: no process on the GPUs, no action.")
    timeout_seconds: Seconds = Field(60.0, description="Each action is abandoned (and counted timed_out) after this "
                                     "long.")
    grace_seconds: Annotated[float, Field(ge=0, le=600, allow_inf_nan=False)] = Field(
        20.0, description="terminate_ranks: SIGTERM, then SIGKILL to a rank still there after this long.")
    max_per_job: Annotated[int, Field(ge=1, le=100)] = Field(
        2, description="At most this many actions on one training job within budget_window_seconds.")
    budget_window_seconds: Seconds = Field(6 * 3600.0, description="The window of max_per_job.")
    cooldown_seconds: SecondsOrZero = Field(300.0, description="No action on a job sooner than this after the last "
                                            "one on it (another job is not held).")
    deterministic_within_seconds: SecondsOrZero = Field(
        1800.0, description="A hang that comes back on the same job within this long after an action is called "
        "deterministic: the daemon alerts and does not act again (a restart would only hang again).")
    paused: bool = Field(False, description="Pause every action (alerts still say what would have been done).")
    pause_file: str | None = Field(
        "/run/stall-watchdog/actions.pause", description="While this file exists, actions are paused: `touch` it "
        "to stop a misbehaving rollout at once, without a reload. None: no pause file.")
    slurm: SlurmActionConfig = SlurmActionConfig()
    kubernetes: KubernetesActionConfig = KubernetesActionConfig()
    command: list[str] | None = Field(
        None, description="The `command` action's argv (no shell), the episode JSON on stdin and the bundle path "
        "as the last argument; a non-zero exit is a failed action.")
    fleet: FleetConfig = FleetConfig()

    @field_validator("pause_file")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not os.path.isabs(value):
            raise ValueError(f"expected an absolute path (or null for none), got {value!r}")
        return value

    @model_validator(mode="after")
    def _usable(self) -> ActionsConfig:
        if len(set(self.do)) != len(self.do):
            raise ValueError("do: an action is named twice")
        if "command" in self.do and not (self.command and self.command[0]):
            raise ValueError("do names command: give actions.command (the program first)")
        if self.mode != "observe" and not self.do:
            raise ValueError(f"do is empty: mode {self.mode} would never do anything (use mode observe)")
        return self
