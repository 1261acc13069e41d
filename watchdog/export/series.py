"""The table of every series the daemon exports, and which of them each `export.series` setting keeps.

Names are an API: prefix stall_watchdog_, base units in the name, ratios 0-1, counters end in _total,
labels bounded (gpu, uuid; rank/pid only on the small rank_info series, a job's labels on it and on the job
view's few series a job; no hostname).

The series budget (docs/metrics.md): a healthy node exports at most 12 series a GPU and 30 of its own by
default (`standard`), none multiplied by jobs or ranks but rank_info and the job view (export/job_view.py: a
handful a job on the node, what the fleet's rules read, joining nothing). Facts
that do not change are labels of gpu_info; a series marked sparse leaves out its rows that say nothing is
wrong (a 0, or an ok GPU's health) unless the setting is `full`, which keeps every reading as before.
`beside_dcgm`, for a node that already runs dcgm-exporter, keeps only what it lacks: the verdicts, host
progress, the ranks and their jobs' waits, and power as a share of the limit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from watchdog.export.job_view import JOB_LABELS, WAIT_LABELS
from watchdog.vocabulary.model import WORKLOAD_LABELS

PREFIX = "stall_watchdog_"
STANDARD, BESIDE_DCGM_MODE, FULL_MODE = "standard", "beside_dcgm", "full"
SERIES_MODES = (STANDARD, BESIDE_DCGM_MODE, FULL_MODE)
ALL = frozenset(SERIES_MODES)
NVML = frozenset({STANDARD, FULL_MODE})  # readings dcgm-exporter has too
BESIDE_DCGM = frozenset({BESIDE_DCGM_MODE, FULL_MODE})
FULL = frozenset({FULL_MODE})


@dataclass(frozen=True)
class MetricSpec:
    name: str  # without the prefix
    kind: str  # gauge | counter
    help: str
    labels: tuple[str, ...] = ()
    modes: frozenset[str] = ALL  # the export.series settings that export it
    sparse: bool = False  # rows that say nothing is wrong are left out unless export.series is full
    quiet_last_label: str | None = None  # a sparse series' last label value that says nothing is wrong (ok)
    quiet_value: float = 0.0  # a sparse series' value that says nothing is wrong

    def quiet(self, labels: tuple[str, ...], value: float) -> bool:
        """A row a sparse series leaves out: its quiet value (0, or 1 for component_up), or one whose last label
        says nothing is wrong."""
        return value == self.quiet_value or (self.quiet_last_label is not None and labels[-1] == self.quiet_last_label)


# The facts of a GPU that do not change while it runs: gpu_info's label -> the GpuSample field it renders.
FACTS: dict[str, str] = {
    "power_limit_watts": "power_limit_watts",
    "sm_clock_max_hertz": "sm_clock_max_hertz",
    "memory_total_bytes": "memory_total_bytes",
    "pcie_link_generation_max": "pcie_link_gen_max",
    "pcie_link_width_max": "pcie_link_width_max",
}
GPU_FACTS = tuple(FACTS)


def _given(modes: frozenset[str], sparse: bool, *specs: MetricSpec) -> tuple[MetricSpec, ...]:
    """Specs exported with these export.series settings, sparse or not."""
    return tuple(replace(spec, modes=modes, sparse=sparse) for spec in specs)

GPU = ("gpu", "uuid")
ALERT_LABELS = ("signature", "severity", "node", "training_job", "gpu", *WORKLOAD_LABELS, "culprit")
# The per-GPU readings: metric name -> the GpuSample field it renders.
READINGS: dict[str, str] = {
    "gpu_utilization_ratio": "utilization_ratio",
    "gpu_memory_utilization_ratio": "memory_utilization_ratio",
    "gpu_power_watts": "power_watts",
    "gpu_sm_clock_hertz": "sm_clock_hertz",
    "gpu_memory_used_bytes": "memory_used_bytes",
    "gpu_temperature_celsius": "temperature_celsius",
    "gpu_sm_activity_ratio": "sm_activity_ratio",
    "gpu_host_cpu_ratio": "host_cpu_ratio",
    "gpu_host_io_bytes_per_second": "host_io_bytes_per_second",
    "gpu_ecc_corrected_errors": "ecc_corrected",
    "gpu_ecc_uncorrected_errors": "ecc_uncorrected",
    "gpu_memory_repair_pending": "memory_repair_pending",
    "gpu_memory_repair_failed": "memory_repair_failed",
    "gpu_nvlink_errors": "nvlink_errors",
    "gpu_pcie_replays": "pcie_replays",
    "gpu_pcie_link_generation": "pcie_link_gen",
    "gpu_pcie_link_width": "pcie_link_width",
}

METRICS: tuple[MetricSpec, ...] = (
    # The NVML readings dcgm-exporter has too.
    *_given(NVML, False,
    MetricSpec("gpu_utilization_ratio", "gauge", "Fraction of the last sample period a kernel ran (NVML).", GPU),
    MetricSpec("gpu_memory_utilization_ratio", "gauge", "Fraction of time device memory was read or written.", GPU),
    MetricSpec("gpu_sm_clock_hertz", "gauge", "SM clock.", GPU),
    MetricSpec("gpu_sm_activity_ratio", "gauge", "GPM SM activity (Hopper and later): SMs doing work.", GPU),
    ),
    # Every other reading, and the daemon's working figures: only with `full`.
    *_given(FULL, False,
    MetricSpec("gpu_power_watts", "gauge", "Power draw.", GPU),
    MetricSpec("gpu_memory_used_bytes", "gauge", "Device memory in use.", GPU),
    MetricSpec("gpu_temperature_celsius", "gauge", "GPU temperature.", GPU),
    MetricSpec("gpu_pcie_link_generation", "gauge", "PCIe link generation now (it trains down at idle).", GPU),
    MetricSpec("gpu_pcie_link_width", "gauge", "PCIe link width (lanes) now.", GPU),
    MetricSpec("gpu_energy_joules_total", "counter", "Energy used since the driver loaded.", GPU),
    MetricSpec("episode_start_time_seconds", "gauge",
               "Unix time the GPU's active episode began: halfway between its first sample and the one before.",
               ("gpu", "signature")),
    MetricSpec("rank_stack_samples_total", "counter", "Stack samples taken of the main thread of the GPU's rank "
               "(stacks.sample_rate_hz) since the daemon first sampled that process.", GPU),
    MetricSpec("rank_stack_waits_total", "counter", "Of rank_stack_samples_total, those inside a collective or a "
               "sync: their ratio over a window is the rank's wait share (the job-wide rules read the node's figure "
               "for the job, job_wait_ratio).", GPU),
    MetricSpec("rank_nccl_wall_seconds_total", "counter", "Wall time the GPU's rank's NCCL Inspector log covered, "
               "where its job writes one.", GPU),
    MetricSpec("rank_nccl_seconds_total", "counter", "Of rank_nccl_wall_seconds_total, the time inside collectives by "
               "NCCL's own timing.", GPU),
    MetricSpec("rank_first_wait_ratio", "gauge", "The wait share of the GPU's rank in its first look "
               "(stacks.sample_learn_seconds): how it was before.", ("gpu",)),
    MetricSpec("rank_first_nccl_ratio", "gauge", "The share of its time the GPU's rank spent inside collectives "
               "by its NCCL Inspector log in its first look (stacks.sample_learn_seconds).", ("gpu",)),
    MetricSpec("rank_wait_ratio", "gauge", "Share of the stack samples of the GPU's rank, over the straggler's "
               "wait window, spent waiting in a collective or a sync (stacks.sample_rate_hz): the rank its peers "
               "wait for waits least.", ("gpu",)),
    ),
    # What only the daemon knows, in every setting.
    *_given(ALL, False,
    MetricSpec("gpu_power_ratio", "gauge", "Power draw as a share of the enforced limit: beside utilization, the "
               "busy-spin tell (100% util at a low share is a kernel spinning, not working).", GPU),
    MetricSpec("gpu_info", "gauge", "Each GPU's facts that do not change while it runs, as labels, always 1: its "
               "model, power limit, maximum SM clock, memory, and PCIe link at most (a limit set anew starts a new "
               "series; a fact not read yet is empty).", GPU + ("name", *GPU_FACTS)),
    MetricSpec("episode_culprit", "gauge", "1 on the GPUs the others wait on, while a waiting episode is active.",
               ("gpu", "signature")),
    MetricSpec("episode_alert_info", "gauge", "1 for each episode that has alerted, while it is open. Its labels "
               "are those of the daemon's own Alertmanager alert for it (culprit aside), so the shipped rules "
               "raise the same alert and Alertmanager keeps one per incident.", ALERT_LABELS),
    MetricSpec("straggler_slowdown_ratio", "gauge", "While a straggler warning is open on a GPU: how much slower "
               "the job runs for it, estimated (1.18 is 18% slower): from its rank's stack samples, 1 / (1 - the "
               "share of each step its peers wait for it); from the clocks alone, its peers' SM clock over its own.",
               ("gpu",)),
    MetricSpec("uneven_work_ratio", "gauge", "Share of each step the other ranks of its job on the node wait for "
               "the GPU's rank where that is a standing difference, not a straggler (`why`: from_start, as since "
               "it was first sampled; planned, while it saves a checkpoint or evaluates).", ("gpu", "why")),
    MetricSpec("episodes_total", "counter", "Episodes fired (escalations count again, as critical).",
               ("signature", "severity")),
    MetricSpec("rank_info", "gauge", "The training processes on each GPU, always 1. `training_job` (the run id, "
               "rendezvous address or Slurm job), the pod (`namespace`, `pod`, `container`) and the Slurm job "
               "(`slurm_*`) are claims; `proof` (slurm, pod, launcher) and `uid` (its user) are set only where the "
               "rank's job is proven, and the fleet's rules join a job's nodes on those alone.",
               ("gpu", "pid", "rank", "training_job", *WORKLOAD_LABELS, "proof", "uid")),
    MetricSpec("job_state", "gauge", "Each proven training job on this node (its ranks' training job, Slurm job, "
               "namespace, pod and user, as rank_info has them where `proof` is set), with its highest busy_spin, "
               "waiting or zero_util episode state on this node's GPUs: 0 none, 1 suspect, 2 warning, 3 critical. "
               "One series a job a node: what the fleet's job-wide rules read.", JOB_LABELS),
    MetricSpec("job_wait_ratio", "gauge", "The share of the stack samples of the job's ranks on this node that were "
               "inside a collective or a sync over the last 5 minutes (as far back as the node saw the job), "
               "computed by the node: the job-wide straggler rule compares it across the job's nodes.", WAIT_LABELS),
    MetricSpec("job_wait_samples", "gauge", "The stack samples job_wait_ratio counts (its rule's chance test).",
               WAIT_LABELS),
    MetricSpec("job_first_wait_ratio", "gauge", "The wait share of the job's ranks on this node in their first "
               "look (stacks.sample_learn_seconds).", WAIT_LABELS),
    MetricSpec("job_nccl_ratio", "gauge", "The share of their time the job's ranks on this node spent inside "
               "collectives over the last 5 minutes, by their NCCL Inspector logs, where the job writes them.",
               WAIT_LABELS),
    MetricSpec("job_first_nccl_ratio", "gauge", "The share of their time the job's ranks on this node spent "
               "inside collectives by their NCCL Inspector logs in their first look.", WAIT_LABELS),
    MetricSpec("stack_captures_total", "counter", "py-spy stack captures by result.", ("result",)),
    MetricSpec("alerts_total", "counter", "Alert deliveries by receiver and result.", ("receiver", "result")),
    MetricSpec("bundles_total", "counter", "Incident bundles by result (written, partial, failed).", ("result",)),
    MetricSpec("dumps_total", "counter", "POST /v1/dump requests by result (written, shared, no_ranks, "
               "rate_limited, bad_request).", ("result",)),
    MetricSpec("bundle_disk_bytes", "gauge", "Disk used by the incident bundles kept."),
    MetricSpec("component_errors_total", "counter", "Failures caught at a component's boundary.", ("component",)),
    MetricSpec("last_sample_timestamp_seconds", "gauge", "Unix time of the last completed sample."),
    MetricSpec("tick_duration_seconds", "gauge", "Wall time of the last sample-detect-act-export tick."),
    MetricSpec("tick_overruns_total", "counter", "Ticks that took longer than the sampling interval."),
    MetricSpec("actions_total", "counter", "Actions on a confirmed hang by action (terminate_ranks, slurm, kubernetes, "
               "command) and result (done, failed, timed_out, dry_run, skipped, stopped); a series is born at its "
               "first count (the rules read a series born in their window as an increase).", ("action", "result")),
    MetricSpec("ledger_last_action_timestamp_seconds", "gauge", "For each job this node acted on (ledger_key: its "
               "Slurm job, its pod, or its user and command line; at most 256), the wall time of the last action: "
               "the fleet reads it so that a job requeued to another node is known there.", ("ledger_key",)),
    MetricSpec("action_state", "gauge", "1 for the actions policy's mode (observe, dry_run, act) and state: observe "
               "(never acts), armed (would act on a confirmed hang), unready (a configured action would fail every "
               "time: a program, a token or a capability missing, as check-config says), acting, held (a guard said "
               "no: budget, cooldown, deterministic, breaker) or paused.", ("mode", "state")),
    MetricSpec("build_info", "gauge", "The running stall-watchdog, always 1.", ("version", "python")),
    ),
    # Host progress: with `beside_dcgm` and `full`.
    *_given(BESIDE_DCGM, False,
    MetricSpec("gpu_host_cpu_ratio", "gauge", "Host progress: CPU seconds per second used by the processes on "
               "this GPU since they were last read (every sample; every 5 s while the GPU's memory or SMs are "
               "busy).", GPU),
    MetricSpec("gpu_host_io_bytes_per_second", "gauge", "Host progress: bytes per second the processes on this "
               "GPU moved through read and write calls (rchar + wchar), read as gpu_host_cpu_ratio is.", GPU),
    ),
    # A GPU's faults: only where there is one, unless `full`.
    *_given(NVML, True,
    MetricSpec("gpu_ecc_corrected_errors", "gauge", "Corrected ECC errors since the driver loaded (volatile; read "
               "every 30 s, as are the health readings below).", GPU),
    MetricSpec("gpu_ecc_uncorrected_errors", "gauge", "Uncorrected ECC errors since the driver loaded.", GPU),
    MetricSpec("gpu_memory_repair_pending", "gauge", "1 while a memory row remap (or page retirement) waits for a "
               "GPU reset.", GPU),
    MetricSpec("gpu_memory_repair_failed", "gauge", "1 once a memory row remap failed: the GPU needs service.", GPU),
    MetricSpec("gpu_nvlink_errors", "gauge", "NVLink CRC, replay and recovery errors of the active links, summed.",
               GPU),
    MetricSpec("gpu_pcie_replays", "gauge", "PCIe replays since the driver loaded.", GPU),
    MetricSpec("gpu_throttle", "gauge", "1 while the clocks are pulled down by thermal, power-brake or hardware "
               "slowdown.", GPU),
    ),
    # Health and episodes: only what is wrong or open, unless `full`.
    *_given(ALL, True,
    MetricSpec("gpu_health", "gauge", "1 for the GPU's current NVML health: ok, lost (fell off the bus) or hung "
               "(an NVML call did not return); only a GPU that is not ok has one unless `export.series` is full.",
               GPU + ("health",), quiet_last_label="ok"),
    MetricSpec("component_up", "gauge", "0 while the component's last run failed, 1 while it succeeds (a component "
               "that runs has no series unless `export.series` is full).", ("component",), quiet_value=1.0),
    MetricSpec("job_culprit", "gauge", "1 while this node holds a GPU of the job that the job's other ranks wait "
               "on (a waiting episode past suspicion).", JOB_LABELS),
    MetricSpec("episode_state", "gauge", "Each GPU's open episode per signature: 1 suspect, 2 warning, 3 "
               "critical (0, ok, is left out unless `export.series` is full).",
               ("gpu", "signature")),
    ),
)


def metric_list_markdown() -> str:
    """The metric list of docs/metrics.md, generated from METRICS (a test keeps it in step)."""
    rows = ["| metric | type | labels | exported with `export.series` | meaning |", "|---|---|---|---|---|"]
    for spec in METRICS:
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "-"
        modes = ", ".join(mode for mode in SERIES_MODES if mode in spec.modes)
        if spec.sparse:
            modes += " (sparse)"
        rows.append(f"| `{PREFIX}{spec.name}` | {spec.kind} | {labels} | {modes} | {spec.help} |")
    return "\n".join(rows)
