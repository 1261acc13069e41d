"""Typed configuration: the one home of every default, threshold and unit.

Unknown keys are rejected and every problem is reported at once with its key path, e.g.
`config.yaml: detectors.busy_spin.for_seconds: expected a number > 0, got '30s'`.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from watchdog import logfmt
from watchdog.model import RUNBOOK_URL

# Every duration is finite and at most a week: `.inf` or `1e10` would be accepted and then overflow a timer.
Seconds = Annotated[float, Field(gt=0, le=7 * 86400, allow_inf_nan=False)]
SecondsOrZero = Annotated[float, Field(ge=0, le=7 * 86400, allow_inf_nan=False)]
Interval = Annotated[float, Field(ge=0.05, le=3600, allow_inf_nan=False)]  # a loop period: 50 ms to an hour
Ratio = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
# The built-in scenarios of sample/sim.py (a test keeps the two lists equal; config imports nothing else).
SCENARIO_NAMES = ("healthy", "checkpoint", "spin_hang", "startup_spin", "zero_util_hang", "odd_rank", "underuse",
                  "throttle", "straggler", "xid_then_spin", "gpu_lost", "tp_small_batch", "t4_spin")
MAX_DOCUMENT_BYTES = 1 << 20  # a configuration is a few KiB; more is a mistake or an attack
MAX_NODES = 20_000  # values in the document, aliases counted each time they are used
MAX_DEPTH = 32
_EXCERPT = 60  # characters of an offending value quoted in an error
_SECRET_KEYS = {"url", "token", "password"}


def _http_url(value: str | None) -> str | None:
    """A URL given inline: http or https (the one rule for every URL key)."""
    if value is not None and not value.startswith(("http://", "https://")):
        raise ValueError("expected an http:// or https:// URL")
    return value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EpisodeTiming(_Section):
    """How long a condition must hold before it fires, and be absent before it resolves."""

    enabled: bool = Field(True, description="Run this detector.")
    for_seconds: SecondsOrZero = Field(30.0, description="Condition must hold this long before firing.")
    clear_seconds: Seconds = Field(
        10.0, description="Condition must be absent this long before an episode resolves (hysteresis)."
    )


class BusySpinConfig(EpisodeTiming):
    """Utilization pinned at 100% while the GPU does no real work (a collective spinning on a flag)."""

    window_seconds: Seconds = Field(20.0, description="Trailing window the legs are computed over.")
    utilization_min_ratio: Ratio = Field(
        0.995,
        description="Half the window samples must be at or above this utilization. A spinning kernel is "
        "resident every sample period (reads 100%); real work leaves gaps (97-99%).",
    )
    idle_power_max_multiple: Annotated[float, Field(gt=1)] = Field(
        2.5,
        description="Leg power_near_idle: median power at most this multiple of the GPU's idle power "
        "(H100: 150 W vs 70 W idle; V100: 70 W vs 40 W).",
    )
    default_idle_power_ratio: Ratio = Field(
        0.12,
        description="Idle power assumed, as a fraction of the power limit, until this GPU has been "
        "seen idle.",
    )
    busy_power_max_ratio: Ratio = Field(
        0.5,
        description="Leg power_below_busy: median power at most this fraction of the power this GPU drew "
        "while it was doing real work earlier.",
    )
    power_flat_max_ratio: Ratio = Field(
        0.05, description="Leg power_flat: interquartile range of power at most this fraction of its median."
    )
    power_flat_min_watts: Annotated[float, Field(ge=0)] = Field(
        5.0, description="Leg power_flat also holds when the interquartile range is within this many watts (the "
        "sensor noise of small GPUs: a T4 reads +-4 W).")
    fell_max_ratio: Ratio = Field(
        0.75, description="Leg power_fell (weak): median power at most this fraction of the power this GPU drew "
        "doing real work. It counts only when every GPU of the job is pinned at 100% with it (a T4 spins at "
        "60-65% of its busy power).")
    memory_utilization_max_ratio: Ratio = Field(
        0.05,
        description="Leg memory_idle: memory-controller utilization at most this over the window. Above it "
        "vetoes the spin (a spinning kernel moves no memory).",
    )
    sm_activity_max_ratio: Ratio = Field(
        0.2,
        description="Leg sm_activity_low (GPM, Hopper and later): SM activity at most this. Above it vetoes.",
    )
    clock_min_ratio: Ratio = Field(
        0.5, description="SM clock below this fraction of its maximum vetoes the spin (throttled, not spinning)."
    )
    min_legs: Annotated[int, Field(ge=1, le=5)] = Field(
        2, description="Legs that must fire, at least one of them other than power_flat."
    )


class ZeroUtilConfig(EpisodeTiming):
    """Utilization 0 with the job's memory still held, not growing and not released."""

    for_seconds: SecondsOrZero = Field(45.0, description="Condition must hold this long before firing.")
    window_seconds: Seconds = Field(15.0, description="Trailing window the condition is computed over.")
    utilization_max_ratio: Ratio = Field(
        0.02, description="At least half the window's samples at or below this utilization."
    )
    blip_max_ratio: Ratio = Field(
        0.05, description="The other samples at or below this: an idle GPU with a context shows brief 1-4% "
        "blips now and then, which neither end nor restart a pause.")
    memory_growth_max_bytes: Annotated[int, Field(ge=0)] = Field(
        256 * 2**20, description="Memory growing by more than this over the window is start-up, not a hang."
    )
    critical_after_seconds: Seconds = Field(
        540.0, description="Telemetry alone (no process seen on the GPUs): a pause is a warning, critical once it "
        "lasts this long, or sooner once it outlasts the pauses this job has recovered from "
        "(job.recovered_pause_margin_ratio), but never before critical_min_seconds.")
    critical_min_seconds: Seconds = Field(
        300.0, description="Telemetry alone: never critical before this (checkpoints of large models take minutes).")


class WaitingConfig(EpisodeTiming):
    """Most of the job's GPUs spin while the others do something else: they wait on those others."""

    critical_after_seconds: Seconds = Field(
        540.0,
        description="Escalate to critical once the wait on idle GPUs outlives what a checkpoint or evaluation "
        "plausibly takes (every hang is critical within 10 minutes).",
    )
    critical_after_busy_seconds: Seconds = Field(
        900.0, description="The same while an odd GPU has been seen at work on something else during the wait (a "
        "checkpoint writer's copies read 5-7% util): rank 0 writing a large checkpoint takes longer.")


class UnderuseConfig(EpisodeTiming):
    """A running job that keeps its GPUs mostly idle (warning, never a page)."""

    for_seconds: SecondsOrZero = Field(1800.0, description="Condition must hold this long before firing.")
    clear_seconds: Seconds = Field(120.0, description="Condition must be absent this long to resolve.")
    window_seconds: Seconds = Field(600.0, description="Trailing window for the mean utilization.")
    utilization_max_ratio: Ratio = Field(0.5, description="Mean utilization at or below this is under-use.")
    utilization_min_ratio: Ratio = Field(
        0.05, description="Mean utilization below this is not a running job (zero_util's case)."
    )


class ThrottleConfig(EpisodeTiming):
    """Clocks pulled down by thermal, power-brake or hardware slowdown (warning)."""


class GpuLostConfig(EpisodeTiming):
    """The GPU stopped answering NVML (fell off the bus) or an NVML call on it hung."""

    for_seconds: SecondsOrZero = Field(0.0, description="Condition must hold this long before firing.")


class GpuHealthConfig(EpisodeTiming):
    """A GPU reporting a fault: a hardware Xid, uncorrected or climbing ECC errors, a memory repair pending or
    failed, NVLink or PCIe errors climbing, a PCIe link trained down (warning)."""

    for_seconds: SecondsOrZero = Field(0.0, description="Condition must hold this long before firing.")
    clear_seconds: Seconds = Field(
        60.0, description="Condition must be absent this long before an episode resolves (hysteresis).")
    xid_hold_seconds: Seconds = Field(
        600.0, description="A hardware Xid keeps its GPU's episode open this long after it was reported.")
    window_seconds: Seconds = Field(
        3600.0, description="Climbing counters (corrected ECC, NVLink and PCIe replay errors) are counted over "
        "this trailing window.")
    corrected_ecc_rise: Annotated[int, Field(ge=1)] = Field(
        100, description="Corrected ECC errors within window_seconds that make a warning (a few are routine).")
    nvlink_errors_rise: Annotated[int, Field(ge=1)] = Field(
        100, description="NVLink CRC, replay and recovery errors within window_seconds that make a warning.")
    pcie_replays_rise: Annotated[int, Field(ge=1)] = Field(
        100, description="PCIe replays within window_seconds that make a warning.")
    busy_min_ratio: Ratio = Field(
        0.5, description="A PCIe link below its maximum generation counts only while the GPU is at least this "
        "busy (links train down at idle to save power); a narrower link always counts.")
    hang_lookback_seconds: Seconds = Field(
        900.0, description="A hang's verdict names the Xids its GPUs reported within this long before it.")


class StragglerConfig(EpisodeTiming):
    """One rank of a job that its peers wait for in every step (warning): its GPU computes at clocks its working
    peers do not, or its stack samples show it waiting in collectives less than its job's other ranks do."""

    for_seconds: SecondsOrZero = Field(60.0, description="Condition must hold this long before firing.")
    clear_seconds: Seconds = Field(
        60.0, description="Condition must be absent this long before an episode resolves (hysteresis).")
    window_seconds: Seconds = Field(
        120.0, description="Trailing window over which a GPU's median SM clock is compared with its peers'.")
    wait_window_seconds: Seconds = Field(
        45.0, description="Trailing window over which each rank's share of stack samples spent waiting in a "
        "collective or a sync is compared with its job's other ranks' (stacks.sample_rate_hz); the rule also looks "
        "over five times it, where a smaller gap stands out of chance.")
    wait_gap_ratio: Annotated[float, Field(gt=0, lt=1)] = Field(
        0.05, description="A rank that waits at least this share of its time less than the median of its job's "
        "other ranks on the node, beyond chance, is the one they wait for (between 0 and 1).")
    wait_sigmas: Annotated[float, Field(ge=1, le=20)] = Field(
        5.0, description="Beyond chance: the gap is at least this many standard errors of the two shares.")
    wait_min_samples: Annotated[int, Field(ge=10, le=100000)] = Field(
        100, description="Stack samples a rank needs in the window to be compared.")
    clock_deficit_ratio: Annotated[float, Field(gt=0, lt=1)] = Field(
        0.1, description="A GPU whose median SM clock is at least this fraction below the median of its working "
        "peers' is a straggler (between 0 and 1).")
    busy_min_ratio: Ratio = Field(
        0.5, description="The GPUs compared are those at least this busy (utilization), each over its own busy "
        "samples.")
    min_gpus: Annotated[int, Field(ge=2, le=4096)] = Field(
        3, description="Working GPUs a tick needs for one of them to be called slower than its peers.")


class DetectorsConfig(_Section):
    busy_spin: BusySpinConfig = BusySpinConfig()
    zero_util: ZeroUtilConfig = ZeroUtilConfig()
    waiting: WaitingConfig = WaitingConfig()
    underuse: UnderuseConfig = UnderuseConfig()
    throttle: ThrottleConfig = ThrottleConfig()
    gpu_lost: GpuLostConfig = GpuLostConfig()
    gpu_health: GpuHealthConfig = GpuHealthConfig()
    straggler: StragglerConfig = StragglerConfig()


class JobConfig(_Section):
    memory_min_bytes: Annotated[int, Field(ge=0)] = Field(
        2**30,
        description="A GPU belongs to the running job when it holds at least this much memory (a bare "
        "CUDA context holds ~0.5 GiB) or runs a kernel.",
    )
    progress_cpu_min_ratio: Ratio = Field(
        0.2, description="Host progress: the processes on a GPU that use at least this many CPU seconds per "
        "second are moving (computing on the host).")
    progress_io_min_bytes_per_second: Annotated[float, Field(ge=0)] = Field(
        65536.0, description="Host progress: ... or that read and write at least this many bytes per second "
        "(a checkpoint writer).")
    progress_still_seconds: Seconds = Field(
        30.0, description="Processes that have not moved for this long are still: a pause whose ranks are still "
        "is a hang, not a checkpoint.")
    busy_pause_quiet_seconds: SecondsOrZero = Field(
        300.0, description="A pause (zero_util, waiting) whose ranks are busy on the host (writing a checkpoint, "
        "evaluating) is not alerted before it lasts this long; critical as soon as they stop moving.")
    relapse_seconds: SecondsOrZero = Field(
        600.0, description="After a critical stall episode ends on evidence of recovery (work resumed, memory "
        "released), a stall on the same GPUs within this long is the same episode continuing: one page, one "
        "bundle. Its resolve is sent once this long has passed without one.")
    recovered_pause_margin_ratio: Annotated[float, Field(ge=1.0)] = Field(
        1.5, description="A pause (zero_util, waiting) no longer than this multiple of the longest pause this job "
        "has already recovered from is not alerted again.")


class SampleConfig(_Section):
    interval_seconds: Interval = Field(1.0, description="Sampling period of the live source (0.05 s to 1 h).")
    nvml_call_timeout_seconds: Seconds = Field(
        2.0, description="An NVML call that takes longer marks the GPU hung; the loop goes on."
    )
    evaluate_interval_seconds: Interval = Field(
        1.0, description="Detectors run at most this often (traces sampled faster are still all ingested)."
    )


class StacksConfig(_Section):
    """Capturing the ranks' Python stacks with py-spy."""

    py_spy_command: list[str] | None = Field(
        None, description="How to start py-spy, as an argv list; null: the py-spy installed with stall-watchdog, "
        "else the one on PATH.")
    timeout_seconds: Seconds = Field(5.0, description="A capture still running after this long is killed.")
    native: bool = Field(
        False, description="Add C/C++ frames (NCCL, CUDA). Needs a blocking read: pauses each rank for milliseconds.")
    max_parallel: Annotated[int, Field(ge=1, le=256)] = Field(16, description="Captures running at once.")
    observe_seconds: Annotated[float, Field(ge=0)] = Field(
        1.0, description="How long to watch each rank's CPU time and I/O around the capture.")
    flight_recorder: bool = Field(
        True, description="Ask PyTorch to dump its NCCL Flight Recorder when a rank enables the debug pipe.")
    recheck_seconds: Seconds = Field(
        60.0, description="While a stall episode is open and not critical, look at the stacks again this often "
        "(a rank that stopped moving between two looks makes it critical).")
    confirm_seconds: Annotated[float, Field(ge=0, le=60)] = Field(
        3.0, description="When the first look at a stall's stacks shows a hang, look again this long after it: the "
        "same ranks in the same places, with no host progress on a rank the others wait for in between, confirm "
        "the hang and make the episode critical before its for_seconds (see confirm_min_seconds). 0: one look only.")
    confirm_min_seconds: Annotated[float, Field(ge=0, le=600)] = Field(
        15.0, description="A hang the second look confirmed is critical before its signature's for_seconds only "
        "once the stall has lasted this long (a rank can wait seconds on a slow data loader or a subprocess), and "
        "not when it is a pause of a length this job has recovered from.")
    flight_recorder_wait_seconds: Annotated[float, Field(ge=0, le=120)] = Field(
        5.0, description="How long to wait for the Flight Recorder dumps asked for before reading what came.")
    nccl_ras: bool = Field(
        True, description="Ask NCCL's RAS service (NCCL 2.24+, localhost:28028 or the ranks' NCCL_RAS_ADDR) for "
        "every rank's collective counts across the job, twice, and name the ranks behind.")
    nccl_ras_gap_seconds: Annotated[float, Field(ge=0, le=60)] = Field(
        3.0, description="Time between the two RAS queries: counts unchanged across it mean stuck.")
    nccl_ras_timeout_seconds: Annotated[float, Field(gt=0, le=60)] = Field(
        5.0, description="How long RAS may gather the job's data for one query.")
    sample_rate_hz: Annotated[float, Field(ge=0, le=50)] = Field(
        8.0, description="Straggler sampling: stack samples per second of each rank's main thread, taken all the time "
        "with py-spy record --nonblocking (the rank is never paused), to tell which rank its peers wait for. "
        "0: off.")
    sample_seconds: Annotated[float, Field(ge=2, le=300)] = Field(
        15.0, description="Straggler sampling: the length of one py-spy record; its counts reach the detectors when "
        "it ends.")
    sample_learn_seconds: Annotated[float, Field(ge=0, le=86400)] = Field(
        120.0, description="Straggler sampling: the first this-long of a rank's samples are kept apart as how it "
        "was before: a rank slow since then is uneven work, not a rank that became slow.")


class SourceConfig(_Section):
    """Where `run` reads the GPUs from."""

    kind: Literal["nvml", "sim"] = Field("nvml", description="nvml: the real GPUs; sim: a built-in scenario played in "
                                         "real time (tests, demos).")
    scenario: Literal[SCENARIO_NAMES] = Field(  # type: ignore[valid-type]
        "spin_hang", description="With kind sim: the scenario (see `stall-watchdog replay --help`).")
    start_offset_seconds: Annotated[float, Field(ge=0)] = Field(
        0.0, description="With kind sim: start this far into the scenario.")
    pids: dict[int, list[int]] = Field(
        default_factory=dict, description="With kind sim: real processes to treat as running on each simulated GPU "
        "(GPU index -> pids), so stacks can be captured.")


class ExportConfig(_Section):
    """The Prometheus endpoint (/metrics, /healthz)."""

    listen_address: str = Field("127.0.0.1:9944", description="host:port to serve on. Loopback by default.")
    tls_cert_file: str | None = Field(None, description="Serve HTTPS with this certificate (PEM).")
    tls_key_file: str | None = Field(None, description="The certificate's private key (PEM).")
    basic_auth_user: str | None = Field(None, description="Require HTTP basic auth with this user name.")
    basic_auth_password_file: str | None = Field(None, description="File holding the basic auth password.")
    basic_auth_password_env: str | None = Field(None, description="Environment variable holding the password.")
    stale_after_seconds: Seconds = Field(10.0, description="/healthz fails when the last sample is older than this.")

    @field_validator("listen_address")
    @classmethod
    def _address(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError("expected host:port with a port from 1 to 65535 (0: any free port)")
        if host.startswith("[") != host.endswith("]"):
            raise ValueError("expected [IPv6]:port")
        return value

    @model_validator(mode="after")
    def _all_or_none(self) -> ExportConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: give both or neither")
        has_password = self.basic_auth_password_file is not None or self.basic_auth_password_env is not None
        if self.basic_auth_user is not None and not has_password:
            raise ValueError("basic_auth_user needs basic_auth_password_file or basic_auth_password_env")
        if self.basic_auth_user is None and has_password:
            raise ValueError("a basic auth password without basic_auth_user would serve without auth: set the user")
        if self.basic_auth_password_file is not None and self.basic_auth_password_env is not None:
            raise ValueError("give basic_auth_password_file or basic_auth_password_env, not both")
        return self


class DumpConfig(_Section):
    """`POST /v1/dump` on the endpoint: capture a job's stacks now (for Alertmanager and the coordinator)."""

    enabled: bool = Field(True, description="Serve POST /v1/dump.")
    token_file: str | None = Field(
        None, description="File holding a bearer token that POST /v1/dump requires (besides basic auth, if set). "
        "Dumps are refused unless this or export.basic_auth_user is set (or open_on_loopback).")
    open_on_loopback: bool = Field(
        False, description="Serve POST /v1/dump without credentials when the endpoint listens on loopback. Only "
        "on a node whose every local user may read every job's stacks: loopback is no trust boundary on a "
        "shared node.")
    cooldown_seconds: Annotated[float, Field(ge=0, le=3600)] = Field(
        30.0, description="A request for a job dumped less than this ago gets that dump's answer again.")
    max_per_minute: Annotated[int, Field(ge=1, le=600)] = Field(
        6, description="Dumps started per minute at most; more get 429 with Retry-After.")
    max_body_bytes: Annotated[int, Field(ge=1024, le=16 * 2**20)] = Field(
        1 * 2**20, description="Largest request body accepted (Alertmanager payloads with many alerts).")


class BundlesConfig(_Section):
    """Incident bundles: one folder per fired episode, with everything an on-call engineer needs."""

    directory: str = Field("/var/lib/stall-watchdog/incidents", description="Where bundles are written (mode 0700).")
    max_total_bytes: Annotated[int, Field(ge=0)] = Field(
        1 << 30, description="Disk budget: the oldest bundles are removed to stay under it.")
    max_count: Annotated[int, Field(ge=1)] = Field(200, description="Keep at most this many bundles.")
    max_bundle_bytes: Annotated[int, Field(ge=1 << 20)] = Field(
        64 << 20, description="One bundle's budget: a write that would pass it is refused before it reaches the "
        "disk and the bundle is not kept (nothing a rank makes the daemon write can grow past it).")
    telemetry_window_seconds: Seconds = Field(300.0, description="Telemetry kept before the onset, in the bundle.")
    capture_stacks: bool = Field(True, description="Capture the affected job's stacks with py-spy when an episode "
                                 "fires.")


class ReceiverConfig(_Section):
    """One alert receiver."""

    type: Literal["webhook", "alertmanager", "command"] = Field(description="Which kind of receiver.")
    name: str = Field(description="Name used in logs and the alerts_total metric.")
    url: str | None = Field(None, description="webhook / alertmanager: the URL (no secrets here: use url_file).")
    url_file: str | None = Field(None, description="File holding the URL (for URLs that carry a key).")
    url_env: str | None = Field(None, description="Environment variable holding the URL.")
    token_file: str | None = Field(None, description="File holding a bearer token sent as Authorization.")
    token_env: str | None = Field(None, description="Environment variable holding a bearer token.")
    argv: list[str] | None = Field(None, description="command: the program and its arguments; no shell. The alert "
                                   "JSON comes on standard input, the bundle path as the last argument.")
    timeout_seconds: Seconds = Field(10.0, description="One delivery attempt is abandoned after this long.")
    min_severity: Literal["warning", "critical"] = Field("warning", description="Send only alerts at least this "
                                                         "severe.")

    _inline_url = field_validator("url")(classmethod(lambda cls, value: _http_url(value)))

    @model_validator(mode="after")
    def _complete(self) -> ReceiverConfig:
        sources = [v for v in (self.url, self.url_file, self.url_env) if v is not None]
        if self.type == "command":
            if not self.argv or not self.argv[0]:
                raise ValueError(f"receiver {self.name!r}: a command receiver needs argv (the program first)")
            if sources:
                raise ValueError(f"receiver {self.name!r}: a command receiver takes argv, not a URL")
        elif len(sources) != 1:
            raise ValueError(f"receiver {self.name!r}: give exactly one of url, url_file, url_env")
        if self.token_file is not None and self.token_env is not None:
            raise ValueError(f"receiver {self.name!r}: give token_file or token_env, not both")
        return self


class AlertsConfig(_Section):
    """Alert delivery. Deliveries run off the loop; a dead receiver is counted and logged, nothing waits on it."""

    receivers: list[ReceiverConfig] = Field(default_factory=list, description="Where alerts go (several at once).")
    max_attempts: Annotated[int, Field(ge=1, le=20)] = Field(4, description="Attempts per alert, with backoff.")
    backoff_seconds: Seconds = Field(2.0, description="First retry delay; doubles each attempt.")
    rate_limit_per_minute: Annotated[int, Field(ge=1)] = Field(
        20, description="At most this many alerts per receiver per minute; the rest are counted as dropped.")
    node: str | None = Field(None, description="The `node` label on alerts (the shipped rules give it the same "
                             "value, from the episode_alert_info series); default: this host's name.")
    node_env: str | None = Field(
        None, description="Take the `node` label from this environment variable instead (Kubernetes: NODE_NAME, "
        "set from spec.nodeName, since a pod's host name is the pod's).")
    runbook_url: str = Field(RUNBOOK_URL, description="Where the runbook lives; each alert links to its section "
                             "(`#stallwatchdogbusyspin`, ...). Point it, and the rules' runbook_url, at your copy.")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: object) -> object:
        """`instance` and `instance_env` are the old names of `node` and `node_env` (Prometheus's `instance`
        is the scrape address, not the host): still read, with a warning."""
        if isinstance(data, dict):
            for old, new in (("instance", "node"), ("instance_env", "node_env")):
                if old in data and new not in data:
                    data = {**{k: v for k, v in data.items() if k != old}, new: data[old]}
                    logfmt.event("config_key_renamed", level=logfmt.WARNING, key=f"alerts.{old}",
                                 use=f"alerts.{new}")
        return data

    @model_validator(mode="after")
    def _one_node(self) -> AlertsConfig:
        if self.node is not None and self.node_env is not None:
            raise ValueError("give node or node_env, not both")
        return self


class KubernetesConfig(_Section):
    """On Kubernetes: which pod and container each rank is, from the kubelet's pod-resources API."""

    pod_resources_socket: str = Field(
        "/var/lib/kubelet/pod-resources/kubelet.sock", description="The kubelet's pod-resources socket, asked which "
        "pod holds each GPU. Not there (not a Kubernetes node, or not mounted): pods are named from each rank's "
        "cgroup and HOSTNAME instead. Empty: never ask.")
    refresh_seconds: Seconds = Field(30.0, description="Ask the kubelet again after this long (sooner, at most once a "
                                     "second, for a GPU its last answer did not name).")
    timeout_seconds: Seconds = Field(2.0, description="A pod-resources call still unanswered after this long fails.")


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

    _url = field_validator("prometheus_url")(classmethod(lambda cls, value: _http_url(value)))


class ActionsConfig(_Section):
    """What the daemon does about a confirmed hang by itself. Off (observe) by default: roll out as observe,
    then dry_run, then act on a canary partition, then act (README: Acting on a hang)."""

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


class Config(_Section):
    sample: SampleConfig = SampleConfig()
    source: SourceConfig = SourceConfig()
    job: JobConfig = JobConfig()
    detectors: DetectorsConfig = DetectorsConfig()
    stacks: StacksConfig = StacksConfig()
    export: ExportConfig = ExportConfig()
    dump: DumpConfig = DumpConfig()
    bundles: BundlesConfig = BundlesConfig()
    alerts: AlertsConfig = AlertsConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()
    actions: ActionsConfig = ActionsConfig()

    @model_validator(mode="after")
    def _actions_can_see_ranks(self) -> Config:
        if self.actions.mode != "observe" and not self.bundles.capture_stacks:
            raise ValueError(f"actions.mode is {self.actions.mode} but bundles.capture_stacks is off: no rank would "
                             "ever be seen, so nothing would ever be done (turn capture_stacks on, or mode observe)")
        return self


class ConfigError(Exception):
    """A config that cannot be used. `problems` holds one 'key.path: what is wrong' line each."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__("\n".join(f"{source}: {p}" for p in problems))


def _valid_keys(loc: tuple[int | str, ...]) -> list[str]:
    """The keys of the section at `loc`, through lists and optional sections (alerts.receivers.0 is a
    receiver)."""
    model: type[BaseModel] = Config
    for part in loc:
        if isinstance(part, int):
            continue  # an item of the list the previous part named: `model` is already its type
        field_info = model.model_fields.get(str(part))
        inner = _section_type(field_info.annotation) if field_info is not None else None
        if inner is None:
            return []
        model = inner
    return list(model.model_fields)


def _section_type(annotation: object) -> type[BaseModel] | None:
    """The configuration section an annotation holds: itself, or the model inside list[...] or X | None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for inner in typing.get_args(annotation):
        found = _section_type(inner)
        if found is not None:
            return found
    return None


def _excerpt(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _EXCERPT else text[:_EXCERPT] + f"... ({len(text)} characters)"


def _describe(error: ErrorDetails) -> str:
    path = ".".join(str(part) for part in error["loc"]) or "(top level)"
    kind = error["type"]
    given = error.get("input")
    if kind == "extra_forbidden":
        return f"{path}: unknown key; valid keys here: {', '.join(_valid_keys(error['loc'][:-1]))}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        op = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}[kind]
        limit = next(iter(error.get("ctx", {}).values()))
        return f"{path}: expected a number {op} {limit:g}, got {_excerpt(given)}"
    if kind in ("float_parsing", "float_type", "int_parsing", "int_type", "int_from_float"):
        whole = "a whole number" if kind.startswith("int") else "a number"
        unit = " of seconds" if path.endswith("_seconds") else ""
        return f"{path}: expected {whole}{unit}, got {_excerpt(given)}"
    if kind in ("bool_parsing", "bool_type"):
        return f"{path}: expected true or false, got {_excerpt(given)}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"{path}: expected a mapping of keys, got {type(given).__name__}"
    message = error["msg"].removeprefix("Value error, ")
    # A whole section, or a value that may carry a secret (a URL with a key in it): the message names the
    # problem, never the value.
    if isinstance(given, (dict, list)) or str(error["loc"][-1] if error["loc"] else "") in _SECRET_KEYS:
        return f"{path}: {message[0].lower()}{message[1:]}"
    return f"{path}: {message[0].lower()}{message[1:]}, got {_excerpt(given)}"


def parse_config(data: object, source: str = "config") -> Config:
    _check_size(data, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(source, [f"(top level): expected a mapping of sections, got {type(data).__name__}"])
    try:
        return Config.model_validate(data, strict=False)
    except ValidationError as exc:
        raise ConfigError(source, [_describe(e) for e in exc.errors()]) from None


def load_config(path: str | Path | None) -> Config:
    """The defaults when path is None; otherwise the YAML file, validated. Every problem, whatever the
    file holds (bytes that are not UTF-8, a YAML alias bomb, a document 3000 levels deep), is a
    ConfigError: `check-config` reports it and a reload rejects it, exactly as `run` would."""
    if path is None:
        return Config()
    source = str(path)
    try:
        with Path(path).open("rb") as f:
            raw = f.read(MAX_DOCUMENT_BYTES + 1)
    except OSError as exc:
        raise ConfigError(source, [f"cannot read: {exc.strerror or exc}"]) from None
    if len(raw) > MAX_DOCUMENT_BYTES:
        raise ConfigError(source, [f"larger than {MAX_DOCUMENT_BYTES // 1024} KiB: not a configuration"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(source, [f"byte {exc.start}: not UTF-8 text"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = str(getattr(exc, "problem", None) or "unreadable")
        raise ConfigError(source, [f"{where}not valid YAML ({problem[:_EXCERPT]})"]) from None
    except RecursionError:
        raise ConfigError(source, [f"nested deeper than {MAX_DEPTH} levels"]) from None
    return parse_config(data, source)  # which checks the size before anything walks the document


def _check_size(data: object, source: str) -> None:
    """Refuse documents whose values, with every alias expanded, exceed MAX_NODES or MAX_DEPTH, before
    anything walks them (a 'billion laughs' document is a few lines that expand to billions of values)."""
    count = 0
    stack: list[tuple[object, int]] = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise ConfigError(source, [f"more than {MAX_NODES} values (aliases expanded): not a configuration"])
        if depth > MAX_DEPTH:
            raise ConfigError(source, [f"nested deeper than {MAX_DEPTH} levels"])
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
            stack.extend((k, depth + 1) for k in value)
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def _keys(model: BaseModel, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], BaseModel | None,
                                                                        str, str]]:
    """Every key of the configuration in order, depth first: (path, section or None for a leaf,
    the section's first doc line or the leaf's description, the leaf's default as flow YAML)."""
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            doc = (type(value).__doc__ or "").strip().splitlines()
            yield (*path, name), value, doc[0] if doc else "", ""
            yield from _keys(value, (*path, name))
        else:
            shown = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
            yield (*path, name), None, info.description or "", shown


def example_yaml() -> str:
    """config.example.yaml: every key at its default, each with its description. A test keeps the
    checked-in file identical to this, so the documented defaults cannot drift from the code."""
    lines = [
        "# stall-watchdog configuration: every key at its default.",
        "# Validate with: stall-watchdog check-config FILE",
        "# Units are in the key names: _seconds, _ratio (0-1), _bytes, _multiple.",
    ]
    for path, section, doc, shown in _keys(Config()):
        indent = "  " * (len(path) - 1)
        if doc:
            lines.append(f"{indent}# {doc}")
        lines.append(f"{indent}{path[-1]}:" if section is not None else f"{indent}{path[-1]}: {shown}")
    lines += [
        "# Receivers, for example (secrets from files or the environment, never in this file):",
        "#   receivers:",
        "#     - {type: alertmanager, name: am, url: 'http://alertmanager:9093'}",
        "#     - {type: webhook, name: slack, url_file: /etc/stall-watchdog/slack-url}",
        "#     - {type: command, name: page, argv: [/usr/local/bin/page-oncall, --team, ml-infra]}",
    ]
    return "\n".join(lines) + "\n"


def reference_markdown() -> str:
    """The README's configuration reference: every key, its default and meaning, from the model."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `{'.'.join(path)}` | `{shown}` | {doc.replace('|', '/')} |"
             for path, section, doc, shown in _keys(Config()) if section is None]
    return "\n".join(rows)


if __name__ == "__main__":  # python -m watchdog.config > config.example.yaml
    print(example_yaml(), end="")
