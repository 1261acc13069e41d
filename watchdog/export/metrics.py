"""Prometheus metrics: one table of every series, and the collector that renders the daemon's last
published state from it. A scrape never touches NVML; a GPU that vanished simply stops appearing.

Names are an API: prefix stall_watchdog_, base units in the name, ratios 0-1, counters end in _total,
labels bounded (gpu, uuid; rank/pid/training_job only on the small rank_info series; no hostname).
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from watchdog import __version__
from watchdog.config import ACTION_NAMES
from watchdog.plumbing.counters import Counters
from watchdog.sample.rank_labels import RankRow
from watchdog.vocabulary.alert_identity import AlertIdentity
from watchdog.vocabulary.model import (
    RANK_WAITS,
    WORKLOAD_LABELS,
    GpuHealth,
    GpuSample,
    NodeSnapshot,
    Severity,
    Signature,
)

PREFIX = "stall_watchdog_"


@dataclass(frozen=True)
class MetricSpec:
    name: str  # without the prefix
    kind: str  # gauge | counter
    help: str
    labels: tuple[str, ...] = ()


GPU = ("gpu", "uuid")
ALERT_LABELS = ("signature", "severity", "node", "training_job", "gpu", *WORKLOAD_LABELS, "culprit")
# The per-GPU readings: metric name -> the GpuSample field it renders.
READINGS: dict[str, str] = {
    "gpu_utilization_ratio": "utilization_ratio",
    "gpu_memory_utilization_ratio": "memory_utilization_ratio",
    "gpu_power_watts": "power_watts",
    "gpu_power_limit_watts": "power_limit_watts",
    "gpu_sm_clock_hertz": "sm_clock_hertz",
    "gpu_sm_clock_max_hertz": "sm_clock_max_hertz",
    "gpu_memory_used_bytes": "memory_used_bytes",
    "gpu_memory_total_bytes": "memory_total_bytes",
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
    "gpu_pcie_link_generation_max": "pcie_link_gen_max",
    "gpu_pcie_link_width": "pcie_link_width",
    "gpu_pcie_link_width_max": "pcie_link_width_max",
}

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("gpu_utilization_ratio", "gauge", "Fraction of the last sample period a kernel ran (NVML).", GPU),
    MetricSpec("gpu_memory_utilization_ratio", "gauge", "Fraction of time device memory was read or written.", GPU),
    MetricSpec("gpu_power_watts", "gauge", "Power draw.", GPU),
    MetricSpec("gpu_power_limit_watts", "gauge", "Enforced power limit.", GPU),
    MetricSpec("gpu_sm_clock_hertz", "gauge", "SM clock.", GPU),
    MetricSpec("gpu_sm_clock_max_hertz", "gauge", "Maximum SM clock.", GPU),
    MetricSpec("gpu_memory_used_bytes", "gauge", "Device memory in use.", GPU),
    MetricSpec("gpu_memory_total_bytes", "gauge", "Device memory in total.", GPU),
    MetricSpec("gpu_temperature_celsius", "gauge", "GPU temperature.", GPU),
    MetricSpec("gpu_sm_activity_ratio", "gauge", "GPM SM activity (Hopper and later): SMs doing work.", GPU),
    MetricSpec("gpu_host_cpu_ratio", "gauge", "Host progress: CPU seconds per second used by the processes on "
               "this GPU since they were last read (every sample; every 5 s while the GPU's memory or SMs are "
               "busy).", GPU),
    MetricSpec("gpu_host_io_bytes_per_second", "gauge", "Host progress: bytes per second the processes on this "
               "GPU moved through read and write calls (rchar + wchar), read as gpu_host_cpu_ratio is.", GPU),
    MetricSpec("gpu_ecc_corrected_errors", "gauge", "Corrected ECC errors since the driver loaded (volatile; read "
               "every 30 s, as are the health readings below).", GPU),
    MetricSpec("gpu_ecc_uncorrected_errors", "gauge", "Uncorrected ECC errors since the driver loaded.", GPU),
    MetricSpec("gpu_memory_repair_pending", "gauge", "1 while a memory row remap (or page retirement) waits for a "
               "GPU reset.", GPU),
    MetricSpec("gpu_memory_repair_failed", "gauge", "1 once a memory row remap failed: the GPU needs service.", GPU),
    MetricSpec("gpu_nvlink_errors", "gauge", "NVLink CRC, replay and recovery errors of the active links, summed.",
               GPU),
    MetricSpec("gpu_pcie_replays", "gauge", "PCIe replays since the driver loaded.", GPU),
    MetricSpec("gpu_pcie_link_generation", "gauge", "PCIe link generation now (it trains down at idle).", GPU),
    MetricSpec("gpu_pcie_link_generation_max", "gauge", "PCIe link generation at most.", GPU),
    MetricSpec("gpu_pcie_link_width", "gauge", "PCIe link width (lanes) now.", GPU),
    MetricSpec("gpu_pcie_link_width_max", "gauge", "PCIe link width (lanes) at most.", GPU),
    MetricSpec("gpu_energy_joules_total", "counter", "Energy used since the driver loaded.", GPU),
    MetricSpec("rank_stack_samples_total", "counter", "Stack samples taken of the main thread of the GPU's rank "
               "(stacks.sample_rate_hz) since the daemon first sampled that process.", GPU),
    MetricSpec("rank_stack_waits_total", "counter", "Of rank_stack_samples_total, those inside a collective or a "
               "sync: their ratio over a window is the rank's wait share, comparable across nodes (the job-wide "
               "straggler rule).", GPU),
    MetricSpec("rank_nccl_wall_seconds_total", "counter", "Wall time the GPU's rank's NCCL Inspector log covered, "
               "where its job writes one.", GPU),
    MetricSpec("rank_nccl_seconds_total", "counter", "Of rank_nccl_wall_seconds_total, the time inside collectives by "
               "NCCL's own timing (the job-wide straggler rule compares their ratio across nodes).", GPU),
    MetricSpec("gpu_throttle", "gauge", "1 while the clocks are pulled down by thermal, power-brake or hardware "
               "slowdown.", GPU),
    MetricSpec("gpu_health", "gauge", "1 for the GPU's current NVML health: ok, lost (fell off the bus) or hung "
               "(an NVML call did not return).", GPU + ("health",)),
    MetricSpec("gpu_info", "gauge", "Static facts about each GPU, always 1.", GPU + ("name",)),
    MetricSpec("episode_state", "gauge", "Each GPU's episode per signature: 0 ok, 1 suspect, 2 warning, 3 critical.",
               ("gpu", "signature")),
    MetricSpec("episode_culprit", "gauge", "1 on the GPUs the others wait on, while a waiting episode is active.",
               ("gpu", "signature")),
    MetricSpec("episode_start_time_seconds", "gauge", "Unix time of the first sample of the GPU's active episode.",
               ("gpu", "signature")),
    MetricSpec("episode_alert_info", "gauge", "1 for each episode that has alerted, while it is open. Its labels "
               "are those of the daemon's own Alertmanager alert for it (culprit aside), so the shipped rules "
               "raise the same alert and Alertmanager keeps one per incident.", ALERT_LABELS),
    MetricSpec("straggler_slowdown_ratio", "gauge", "While a straggler warning is open on a GPU: how much slower "
               "the job runs for it, estimated (1.18 is 18% slower): from its rank's stack samples, 1 / (1 - the "
               "share of each step its peers wait for it); from the clocks alone, its peers' SM clock over its own.",
               ("gpu",)),
    MetricSpec("rank_wait_ratio", "gauge", "Share of the stack samples of the GPU's rank, over the straggler's "
               "wait window, spent waiting in a collective or a sync (stacks.sample_rate_hz): the rank its peers "
               "wait for waits least.", ("gpu",)),
    MetricSpec("rank_first_wait_ratio", "gauge", "The wait share of the GPU's rank in its first look "
               "(stacks.sample_learn_seconds): how it was before, for the job-wide straggler rule to tell a rank "
               "that became slow from uneven work.", ("gpu",)),
    MetricSpec("rank_first_nccl_ratio", "gauge", "The share of its time the GPU's rank spent inside collectives "
               "by its NCCL Inspector log in its first look (stacks.sample_learn_seconds).", ("gpu",)),
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
    MetricSpec("stack_captures_total", "counter", "py-spy stack captures by result.", ("result",)),
    MetricSpec("alerts_total", "counter", "Alert deliveries by receiver and result.", ("receiver", "result")),
    MetricSpec("bundles_total", "counter", "Incident bundles by result (written, partial, failed).", ("result",)),
    MetricSpec("dumps_total", "counter", "POST /v1/dump requests by result (written, shared, no_ranks, "
               "rate_limited, bad_request).", ("result",)),
    MetricSpec("bundle_disk_bytes", "gauge", "Disk used by the incident bundles kept."),
    MetricSpec("component_up", "gauge", "1 if the component's last run succeeded.", ("component",)),
    MetricSpec("component_errors_total", "counter", "Failures caught at a component's boundary.", ("component",)),
    MetricSpec("last_sample_timestamp_seconds", "gauge", "Unix time of the last completed sample."),
    MetricSpec("tick_duration_seconds", "gauge", "Wall time of the last sample-detect-act-export tick."),
    MetricSpec("tick_overruns_total", "counter", "Ticks that took longer than the sampling interval."),
    MetricSpec("actions_total", "counter", "Actions on a confirmed hang by action (terminate_ranks, slurm, kubernetes, "
               "command) and result (done, failed, timed_out, dry_run, skipped, stopped).", ("action", "result")),
    MetricSpec("ledger_last_action_timestamp_seconds", "gauge", "For each job this node acted on (ledger_key: its "
               "Slurm job, its pod, or its user and command line; at most 256), the wall time of the last action: "
               "the fleet reads it so that a job requeued to another node is known there.", ("ledger_key",)),
    MetricSpec("action_state", "gauge", "1 for the actions policy's mode (observe, dry_run, act) and state: observe "
               "(never acts), armed (would act on a confirmed hang), unready (a configured action would fail every "
               "time: a program, a token or a capability missing, as check-config says), acting, held (a guard said "
               "no: budget, cooldown, deterministic, breaker) or paused.", ("mode", "state")),
    MetricSpec("build_info", "gauge", "The running stall-watchdog, always 1.", ("version", "python")),
)
_STATE = {None: 1, Severity.WARNING: 2, Severity.CRITICAL: 3}


@dataclass(frozen=True)
class EpisodeView:
    signature: Signature
    severity: Severity | None  # None while suspect
    gpus: tuple[int, ...]
    culprit_gpus: tuple[int, ...]
    onset_wall: float
    slowdown: float | None = None  # straggler: how much slower the job runs for it (estimated)


class AlertRow(NamedTuple):
    identity: AlertIdentity
    severity: Severity
    culprit: str


@dataclass(frozen=True)
class Published:
    """What the loop swaps in after each tick; the collector renders only this."""

    snapshot: NodeSnapshot | None = None
    episodes: tuple[EpisodeView, ...] = ()
    ranks: tuple[RankRow, ...] = ()
    alerts: tuple[AlertRow, ...] = ()
    component_up: Mapping[str, bool] = field(default_factory=dict)
    last_sample_wall: float | None = None
    tick_seconds: float | None = None
    bundle_disk_bytes: int | None = None
    action: tuple[str, str] = ("observe", "observe")  # the actions policy's (mode, state)
    ledger: tuple[tuple[str, float], ...] = ()  # (ledger key, its last action) of the actions ledger
    waits: tuple[tuple[int, float], ...] = ()  # (GPU, its rank's wait share) from the stack samples
    uneven: tuple[tuple[int, str, float], ...] = ()  # (GPU, why, gap) of uneven work

    def slow_gpus(self) -> dict[int, dict[str, float]]:
        """Per GPU, what the node knows of its rank's pace: its wait share where compared (`wait_ratio`), and the
        slowdown of a straggler episode on it past suspicion (`straggler_slowdown`), for the dump answer."""
        out: dict[int, dict[str, float]] = {gpu: {"wait_ratio": share} for gpu, share in self.waits}
        for episode in self.episodes:
            if episode.signature is Signature.STRAGGLER and episode.slowdown is not None and episode.severity:
                for gpu in episode.gpus:
                    out.setdefault(gpu, {})["straggler_slowdown"] = round(episode.slowdown, 3)
        return out


COUNTER_NAMES = tuple(spec.name for spec in METRICS if spec.kind == "counter")


def new_counters() -> Counters:
    """The counters every series of kind counter in METRICS is rendered from."""
    return Counters(COUNTER_NAMES)


def _family(spec: MetricSpec) -> GaugeMetricFamily | CounterMetricFamily:
    name = PREFIX + spec.name
    if spec.kind == "counter":
        return CounterMetricFamily(name.removesuffix("_total"), spec.help, labels=spec.labels)
    return GaugeMetricFamily(name, spec.help, labels=spec.labels)


Series = dict[str, list[tuple[tuple[str, ...], float]]]  # metric -> (label values in its spec's order, value)


class WatchdogCollector(Collector):
    """Renders the last published state: `series()` says what is there, once; collect() hands it to
    prometheus_client, exposition() writes the text a scrape gets (the same bytes as prometheus_client's
    generate_latest, at a fraction of its cost: 64 GPUs are 1,500 lines)."""

    def __init__(self, published: Callable[[], Published], counters: Counters):
        self._published, self._counters = published, counters
        # A scrape repeats the last one's series with mostly the same values: each line's name and labels,
        # and each value's text, are written once and remembered (64 GPUs: 1,600 lines every scrape).
        self._names: dict[tuple[str, tuple[str, ...]], str] = {}
        self._values: dict[float, str] = {}

    def series(self) -> Series:
        state = self._published()
        out: Series = {spec.name: [] for spec in METRICS}
        snapshot = state.snapshot
        if snapshot is not None:
            for sample in snapshot.gpus:
                self._gpu(out, sample)
        indexes = [g.index for g in snapshot.gpus] if snapshot is not None else []
        self._episodes(out, state.episodes, indexes)
        for gpu, pid, rank, job, workload, proof, uid in state.ranks:
            out["rank_info"].append(((str(gpu), str(pid), "" if rank is None else str(rank), job,
                                      *workload.labels(), proof, uid), 1))
        out["rank_wait_ratio"] += [((str(gpu),), share) for gpu, share in state.waits]
        out["uneven_work_ratio"] += [((str(gpu), why), gap) for gpu, why, gap in state.uneven]
        for identity, severity, culprit in state.alerts:
            named = identity.labels(severity)
            out["episode_alert_info"].append((tuple(named.get(name, "") for name in ALERT_LABELS[:-1]) + (culprit,), 1))
        for component, up in sorted(state.component_up.items()):
            out["component_up"].append(((component,), 1 if up else 0))
        if state.last_sample_wall is not None:
            out["last_sample_timestamp_seconds"].append(((), state.last_sample_wall))
        if state.tick_seconds is not None:
            out["tick_duration_seconds"].append(((), state.tick_seconds))
        if state.bundle_disk_bytes is not None:
            out["bundle_disk_bytes"].append(((), state.bundle_disk_bytes))
        out["action_state"].append((state.action, 1))
        for key, last in state.ledger:
            out["ledger_last_action_timestamp_seconds"].append(((key,), last))
        out["build_info"].append(((__version__, platform.python_version()), 1))
        counted = self._counters.snapshot()
        # Each action's done series exists from the start at 0, so that the fleet breaker's increase() sees a
        # node's first action (a series born at 1 increases by nothing).
        counted["actions_total"] = {**{(name, "done"): 0.0 for name in ACTION_NAMES}, **counted["actions_total"]}
        for name, values in counted.items():
            for labels, value in sorted(values.items()):
                out[name].append((tuple(labels), value))
        return out

    def collect(self) -> Iterator[Metric]:
        series = self.series()
        for spec in METRICS:
            family = _family(spec)
            for labels, value in series[spec.name]:
                family.add_metric(list(labels), value)
            yield family

    def exposition(self) -> bytes:
        series = self.series()
        out: list[str] = []
        names, values = self._names, self._values
        if len(names) > _REMEMBERED or len(values) > _REMEMBERED:  # labels and values come and go: bounded
            names.clear()
            values.clear()
        for spec, header, sample, order in _TEXT:
            out.append(header)
            for labels, value in series[spec.name]:
                name = names.get((sample, labels))
                if name is None:
                    pairs = ",".join([f'{spec.labels[i]}="{_escaped(labels[i])}"' for i in order])
                    name = names[(sample, labels)] = f"{sample}{{{pairs}}} " if labels else f"{sample} "
                text = values.get(value)
                if text is None:
                    text = values[value] = floatToGoString(value)
                out.append(name)
                out.append(text)
                out.append("\n")
        return "".join(out).encode("utf-8")

    @staticmethod
    def _gpu(out: Series, gpu: GpuSample) -> None:
        labels = (str(gpu.index), gpu.uuid or "")
        for metric, slot in _READING_SLOTS:
            value = gpu[slot]
            if value is not None:
                out[metric].append((labels, value))  # type: ignore[arg-type]  # READINGS are numbers
        if gpu.energy_joules is not None:
            out["gpu_energy_joules_total"].append((labels, gpu.energy_joules))
        for counts, names, unit in ((gpu.rank_waits, _STACK_SERIES, 1), (gpu.nccl_waits, _NCCL_SERIES, 1000)):
            if counts:  # samples, or milliseconds
                out[names[0]].append((labels, counts[_SAMPLES] / unit))
                out[names[1]].append((labels, counts[_WAITS] / unit))
                if counts[_FIRST_SAMPLES]:
                    out[names[2]].append(((labels[0],), counts[_FIRST_WAITS] / counts[_FIRST_SAMPLES]))
        if gpu.clock_event_reasons is not None:
            out["gpu_throttle"].append((labels, 1 if gpu.throttle_reasons else 0))
        health = out["gpu_health"]
        for each, value in _HEALTHS:
            health.append(((*labels, value), 1 if gpu.health is each else 0))
        out["gpu_info"].append(((*labels, gpu.name or ""), 1))

    @staticmethod
    def _episodes(out: Series, episodes: tuple[EpisodeView, ...], gpus: list[int]) -> None:
        state: dict[tuple[int, Signature], int] = {}
        for episode in episodes:
            for gpu in episode.gpus:
                key = (gpu, episode.signature)
                state[key] = max(state.get(key, 0), _STATE[episode.severity])
                if episode.severity is not None:
                    out["episode_start_time_seconds"].append(((str(gpu), episode.signature.value), episode.onset_wall))
            if episode.slowdown is not None and episode.severity is not None:
                for gpu in episode.gpus:
                    out["straggler_slowdown_ratio"].append(((str(gpu),), episode.slowdown))
            if episode.signature is Signature.WAITING and episode.severity is not None:
                for gpu in episode.culprit_gpus:
                    out["episode_culprit"].append(((str(gpu), episode.signature.value), 1))
        rows = out["episode_state"]
        for gpu in gpus:
            label = str(gpu)
            for signature, value in _SIGNATURES:
                rows.append(((label, value), state.get((gpu, signature), 0)))


_JOB, _RANK, _SAMPLES, _WAITS, _PLANNED, _FIRST_SAMPLES, _FIRST_WAITS = range(len(RANK_WAITS))  # its order
_STACK_SERIES = ("rank_stack_samples_total", "rank_stack_waits_total", "rank_first_wait_ratio")  # a rank's counts:
_NCCL_SERIES = ("rank_nccl_wall_seconds_total", "rank_nccl_seconds_total", "rank_first_nccl_ratio")  # all, waits, first
_REMEMBERED = 1 << 15
# Iterated for every GPU at every scrape: each member with its label value, and each reading's slot.
_HEALTHS = tuple((health, health.value) for health in GpuHealth)
_SIGNATURES = tuple((signature, signature.value) for signature in Signature)
_READING_SLOTS = tuple((metric, GpuSample._fields.index(field_name)) for metric, field_name in READINGS.items())


def _escaped(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')
    return value


def _text_layout(spec: MetricSpec) -> tuple[MetricSpec, str, str, list[int]]:
    """The HELP and TYPE lines, the sample name and the label order (sorted by name) of one series."""
    name = PREFIX + spec.name
    help_text = spec.help.replace("\\", r"\\").replace("\n", r"\n")
    order = sorted(range(len(spec.labels)), key=spec.labels.__getitem__)
    return spec, f"# HELP {name} {help_text}\n# TYPE {name} {spec.kind}\n", name, order


_TEXT = [_text_layout(spec) for spec in METRICS]


def metric_list_markdown() -> str:
    """The metric list of docs/metrics.md, generated from METRICS (a test keeps it in step)."""
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for spec in METRICS:
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "-"
        rows.append(f"| `{PREFIX}{spec.name}` | {spec.kind} | {labels} | {spec.help} |")
    return "\n".join(rows)
