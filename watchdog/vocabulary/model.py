"""Shared vocabulary: one GPU reading, one node snapshot, signatures, severities and episode events.

Units are converted once, where a reading is born, into the base units named in each field.
"""

from __future__ import annotations

import enum
import itertools
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, NamedTuple

from watchdog.vocabulary.words import iso_time

# What nvidia-smi prints in place of a GPU it cannot reach (in a CSV log when its stderr is logged too, in a
# pasted kernel or console log): "Unable to determine the device handle for GPU 0000:3B:00.0: GPU is lost".
NO_DEVICE_HANDLE = "Unable to determine the device handle for GPU"
# ... and its other words in place of rows, when it cannot read the GPUs at all.
SMI_SAYS = (NO_DEVICE_HANDLE, "No devices were found", "Unable to query NVML", "Failed to initialize NVML",
            "Unable to communicate with the NVIDIA driver", "NVIDIA-SMI has failed")


class GpuHealth(str, enum.Enum):
    """Whether the GPU answered at all. A lost GPU is a signal, never folded into missing values."""

    OK = "ok"
    LOST = "lost"  # NVML_ERROR_GPU_IS_LOST / NVML_ERROR_UNKNOWN: fell off the bus, needs a reset
    HUNG = "hung"  # an NVML call on this GPU did not return within the call timeout


class Severity(str, enum.Enum):
    WARNING = "warning"
    CRITICAL = "critical"


class Signature(str, enum.Enum):
    """The stall signatures. The same word is used in config keys, event output, metrics and docs."""

    BUSY_SPIN = "busy_spin"
    ZERO_UTIL = "zero_util"
    WAITING = "waiting"
    UNDERUSE = "underuse"
    THROTTLE = "throttle"
    GPU_LOST = "gpu_lost"
    GPU_HEALTH = "gpu_health"
    STRAGGLER = "straggler"


# Clock-event reason bits (nvmlClocksEventReason*; nvidia-smi clocks_event_reasons.*). Only these mean
# "the clocks were pulled down by the hardware"; SwPowerCap is routine on a busy GPU and GpuIdle is benign.
CLOCK_EVENT_HW_SLOWDOWN = 0x8
CLOCK_EVENT_SW_THERMAL = 0x20
CLOCK_EVENT_HW_THERMAL = 0x40
CLOCK_EVENT_HW_POWER_BRAKE = 0x80
THROTTLE_REASON_NAMES: dict[int, str] = {
    CLOCK_EVENT_HW_SLOWDOWN: "hw_slowdown",
    CLOCK_EVENT_SW_THERMAL: "sw_thermal_slowdown",
    CLOCK_EVENT_HW_THERMAL: "hw_thermal_slowdown",
    CLOCK_EVENT_HW_POWER_BRAKE: "hw_power_brake_slowdown",
}
THROTTLE_REASON_MASK = sum(THROTTLE_REASON_NAMES)


def throttle_reason_names(bits: int) -> list[str]:
    """The names of the hardware slowdown reasons set in a clock-event bit mask."""
    return [name for bit, name in THROTTLE_REASON_NAMES.items() if bits & bit]


class GpuSample(NamedTuple):
    """One GPU at one instant. None means "not supported by this GPU" or "could not be read"; the
    reason for a failed read is in `errors` (field name -> message). A NamedTuple: immutable, and
    cheap to build a million of when a day-long trace is replayed."""

    index: int  # type: ignore[assignment]  # NVML's word for it; shadows tuple.index, which is unused
    uuid: str | None = None
    name: str | None = None
    health: GpuHealth = GpuHealth.OK
    utilization_ratio: float | None = None
    memory_utilization_ratio: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    sm_clock_hertz: float | None = None
    sm_clock_max_hertz: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_celsius: float | None = None
    clock_event_reasons: int | None = None
    energy_joules: float | None = None
    sm_activity_ratio: float | None = None
    # Host progress of the processes on this GPU since the previous sample (sample/host_progress.py):
    # CPU seconds per second, and bytes per second through read and write calls. None: no process seen.
    host_cpu_ratio: float | None = None
    host_io_bytes_per_second: float | None = None
    pids: tuple[int, ...] = ()
    errors: tuple[tuple[str, str], ...] = ()
    # Health (detect/gpu_health.py): the Xid events NVML reported since the previous sample, and counters
    # read every sample/nvml_readings.py HEALTH_SECONDS (their last values repeat between). ECC counts are volatile
    # (since the driver loaded); memory repair is row remapping (Ampere and later) or page retirement:
    # 1 pending (a GPU reset applies it) or failed; NVLink errors are the CRC, replay and recovery errors of
    # the active links summed; PCIe replays since the driver loaded; the PCIe link's generation and width now
    # and at most.
    xids: tuple[int, ...] = ()
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    memory_repair_pending: int | None = None
    memory_repair_failed: int | None = None
    nvlink_errors: int | None = None
    pcie_replays: int | None = None
    pcie_link_gen: int | None = None
    pcie_link_gen_max: int | None = None
    pcie_link_width: int | None = None
    pcie_link_width_max: int | None = None
    # The stack samples of this GPU's rank (stacks/sampling.py), as whole numbers named by RANK_WAITS: its job
    # (a number for the job key) and rank, then counts since the daemon first sampled it. () where none.
    rank_waits: tuple[int, ...] = ()
    # The same counts from the rank's NCCL Inspector log (stacks/nccl_inspector.py), where it writes one:
    # "samples" are wall milliseconds and "waits" milliseconds inside collectives, timed by NCCL.
    nccl_waits: tuple[int, ...] = ()

    @property
    def throttle_reasons(self) -> list[str]:
        return throttle_reason_names(self.clock_event_reasons or 0)


# The readings that are numbers (the detectors hold them as float64 arrays, a missing one NaN).
NUMERIC_FIELDS = ("utilization_ratio", "memory_utilization_ratio", "power_watts", "power_limit_watts", "sm_clock_hertz",
                  "sm_clock_max_hertz", "memory_used_bytes", "temperature_celsius", "clock_event_reasons",
                  "sm_activity_ratio", "host_cpu_ratio", "host_io_bytes_per_second")


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """Every GPU of the node at one instant. `time_seconds` is wall time (epoch seconds, or the trace's
    own clock for a naive-time trace); detectors only ever subtract two of them."""

    time_seconds: float
    gpus: tuple[GpuSample, ...]


SAMPLE_DEFAULTS = tuple(GpuSample._field_defaults.get(name) for name in GpuSample._fields)  # index: None
_new_sample = tuple.__new__


def samples_of(columns: Sequence[Sequence[Any] | None], count: int,
               defaults: Sequence[Any] = SAMPLE_DEFAULTS) -> list[GpuSample]:
    """`count` samples from one column per GpuSample field, in its order (None: every sample has the
    field's default): built a row at a time without a call per sample, as trace readers need them."""
    rows = [itertools.repeat(default, count) if column is None else column
            for column, default in zip(columns, defaults)]
    return list(map(_new_sample, itertools.repeat(GpuSample), zip(*rows)))


@dataclass(frozen=True, slots=True)
class SnapshotBlock:
    """Consecutive snapshots of the same GPUs in the same order, held column by column: what a trace
    reader hands the detectors without building a GpuSample per reading. Row `n * width + p` is GPU
    `layout[p]` in snapshot n. `columns` has one entry per GpuSample field, in its order: a value per
    row, or None where every row has the field's default (a column the log does not have); the index
    column is always there. `present` is None where every snapshot has every GPU of the layout, else a flag
    per row, False where the snapshot lacks that GPU (a log's dropped row: its row holds defaults)."""

    times: Sequence[float]  # one per snapshot
    layout: tuple[int, ...]  # the GPU indexes, as the rows of each snapshot list them
    columns: tuple[Sequence[Any] | None, ...]
    present: Sequence[bool] | None = None

    def __len__(self) -> int:
        return len(self.times)

    def snapshots(self, start: int = 0, stop: int | None = None) -> list[NodeSnapshot]:
        stop = len(self.times) if stop is None else stop
        width = len(self.layout)
        first, last = start * width, stop * width
        samples = samples_of([None if values is None else _plain(slot, values[first:last])
                              for slot, values in enumerate(self.columns)], last - first)
        if self.present is None:
            return [NodeSnapshot(t, tuple(samples[n:n + width]))
                    for t, n in zip(self.times[start:stop], range(0, last - first, width))]
        present = self.present[first:last]
        return [NodeSnapshot(t, tuple(itertools.compress(samples[n:n + width], present[n:n + width])))
                for t, n in zip(self.times[start:stop], range(0, last - first, width))]


HEALTH_COUNTERS = ("ecc_corrected", "ecc_uncorrected", "memory_repair_pending", "memory_repair_failed",
                   "nvlink_errors", "pcie_replays", "pcie_link_gen", "pcie_link_gen_max", "pcie_link_width",
                   "pcie_link_width_max")
# The positions of GpuSample.rank_waits: the job (a number standing for the job key, to compare a rank with
# its own job's only), the rank, how many samples of its main thread were taken, how many of them were inside a
# collective or a sync (waiting for peers), how many in planned extra work (checkpoint I/O, evaluation), and
# the samples and waits of its first look (stacks.sample_learn_seconds): what it was like before.
RANK_WAITS = ("job", "rank", "samples", "waits", "planned", "first_samples", "first_waits")
(WAIT_JOB, WAIT_RANK, WAIT_SAMPLES, WAIT_WAITS, WAIT_PLANNED, WAIT_FIRST_SAMPLES,
 WAIT_FIRST_WAITS) = range(len(RANK_WAITS))  # each name's position, for the readers of the counts

INTEGER_FIELDS = ("memory_used_bytes", "memory_total_bytes", "clock_event_reasons", *HEALTH_COUNTERS)
_WHOLE = {GpuSample._fields.index(name) for name in INTEGER_FIELDS}


def _plain(slot: int, values: Sequence[Any]) -> Sequence[Any]:
    """A column as samples hold it: a reader's float64 array (sample/read_ahead.py) back to numbers and None."""
    if not hasattr(values, "tolist"):
        return values
    whole = slot in _WHOLE
    return [None if v != v else int(v) if whole else v for v in values.tolist()]


def each_snapshot(stretches: Iterable[NodeSnapshot | SnapshotBlock]) -> Iterator[NodeSnapshot]:
    """Snapshots and blocks of them, as snapshots one at a time."""
    for item in stretches:
        yield from item.snapshots() if isinstance(item, SnapshotBlock) else (item,)


def snapshot_range(stream: Sequence[NodeSnapshot] | SnapshotBlock, start: int, stop: int) -> Sequence[NodeSnapshot]:
    """Snapshots start..stop-1 of a list of them or of a block."""
    return stream.snapshots(start, stop) if isinstance(stream, SnapshotBlock) else stream[start:stop]


def snapshot_times(stream: Sequence[NodeSnapshot] | SnapshotBlock, start: int, stop: int) -> Sequence[float]:
    """The times of snapshots start..stop-1 of a list of them or of a block."""
    if isinstance(stream, SnapshotBlock):
        return stream.times[start:stop]
    return [snapshot.time_seconds for snapshot in stream[start:stop]]


class Progress(str, enum.Enum):
    """Whether the processes on a set of GPUs move on the host (CPU or I/O), from GpuSample's host readings."""

    UNKNOWN = "unknown"  # no process seen on these GPUs: a CSV replay, a simulation without pids
    MOVING = "moving"  # computing or reading/writing on the host: a checkpoint, an evaluation
    STILL = "still"  # neither CPU nor I/O for a while: blocked


@dataclass(frozen=True, slots=True)
class Finding:
    """What the detectors see on one tick: a signature on a set of GPUs, with the evidence.
    `since` is the first sample showing it; `facts` holds the numbers the summary quotes."""

    signature: Signature
    severity: Severity
    gpus: tuple[int, ...]
    since: float
    culprit_gpus: tuple[int, ...] = ()
    legs: tuple[str, ...] = ()
    facts: dict[str, float | str] = field(default_factory=dict)
    key: str = ""  # what makes two findings the same episode; defaults to the signature
    # Host progress of the GPUs that decide the verdict (all of them for zero_util, the culprits for
    # waiting) and for how long they have not moved.
    progress: Progress = Progress.UNKNOWN
    still_seconds: float = 0.0
    culprits_busy: bool = False  # waiting: a culprit GPU is not idle (at work on something else)
    early: bool = False  # on the newest samples of a spin only: suspected, alerted only once the stacks confirm it

    @property
    def episode_key(self) -> str:
        return self.key or self.signature.value


@dataclass(frozen=True)
class Verdict:
    """What the ranks' stacks say about a stall (stacks/verdict.py decides it; detect/ weighs it in).
    `headline` is the conclusion in one clause, `sentence` the whole picture."""

    kind: str  # "hang" | "waiting" | "remote" | "no_stall" | "unknown" (the evidence cannot tell)
    severity: Severity | None
    reason: str  # what the stacks show, as the rule that decided the kind says it
    headline: str = ""
    confirmed: bool = False  # a hang seen again at a second look, nothing moved between (stacks/confirm.py)
    # What else was found or missed, each said once after the reason: what the Flight Recorder or NCCL RAS say,
    # stacks that could not be captured, the second look, ranks that left no trace
    notes: tuple[str, ...] = ()

    @property
    def title(self) -> str:
        """The kind as a reader sees it: a hang that no second look or timeout confirmed is a suspected one."""
        return "suspected hang" if self.kind == "hang" and self.severity is not Severity.CRITICAL else self.kind

    @property
    def sentence(self) -> str:
        """The whole picture, rendered from the reason and the notes (the one place they are joined)."""
        parts = [self.reason, *self.notes]
        return ". ".join([*(part.rstrip(".") for part in parts[:-1]), parts[-1]])

    def noted(self, notes: Sequence[str]) -> Verdict:
        """The verdict with `notes` after its own (each said once)."""
        fresh = tuple(n for n in dict.fromkeys(notes) if n and n not in self.notes)
        return replace(self, notes=self.notes + fresh) if fresh else self

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind, "severity": self.severity.value if self.severity else None,
                "headline": self.headline, "sentence": self.sentence, "confirmed": self.confirmed,
                "notes": list(self.notes)}


class EventKind(str, enum.Enum):
    SUSPECTED = "suspected"  # the condition appeared; not alerted, but the ranks' stacks are worth a look
    FIRED = "fired"
    ESCALATED = "escalated"  # same episode, severity raised (waiting -> critical)
    RELAPSED = "relapsed"  # a critical episode's GPUs stalled again within the hold: the same episode, no new page
    RESOLVED = "resolved"


@dataclass(frozen=True, slots=True)
class EpisodeEvent:
    event: EventKind
    signature: Signature
    severity: Severity
    gpus: tuple[int, ...]
    culprit_gpus: tuple[int, ...]
    onset_seconds: float
    at_seconds: float
    summary: str
    legs: tuple[str, ...] = field(default=())
    key: str = ""  # the episode's identity: the same for its suspected, fired, escalated and resolved events
    headline: str = ""  # the verdict in one line: "HANG (critical): ..."; the summary begins with it

    def to_json(self, naive_time: bool = False) -> dict[str, object]:
        return {
            "event": self.event.value,
            "signature": self.signature.value,
            "severity": self.severity.value,
            "gpus": list(self.gpus),
            "culprit_gpus": list(self.culprit_gpus),
            "onset": iso_time(self.onset_seconds, naive_time),
            "at": iso_time(self.at_seconds, naive_time),
            "duration_seconds": round(self.at_seconds - self.onset_seconds, 3),
            "legs": list(self.legs),
            "headline": self.headline,
            "summary": self.summary,
        }


@dataclass(frozen=True)
class Workload:
    """Where a process runs, in its scheduler's words: its Kubernetes pod or its Slurm job (sample/workload.py
    reads them). Each field None where nothing says it."""

    namespace: str | None = None
    pod: str | None = None
    container: str | None = None
    slurm_job_id: str | None = None
    slurm_step: str | None = None
    slurm_user: str | None = None
    # Fields only the process's own environment claims (no cgroup, no kubelet says so): a rank may set
    # SLURM_JOB_ID or HOSTNAME to anything. Kept in bundles and answers, never a label of its own.
    claimed: tuple[str, ...] = field(default=(), compare=False)

    def labels(self) -> tuple[str, ...]:
        """The values of WORKLOAD_LABELS, '' where unknown (Prometheus drops an empty label)."""
        return tuple(getattr(self, name) or "" for name in WORKLOAD_LABELS)

    def label_values(self) -> dict[str, str]:
        """The labels that are known, by name."""
        return {name: value for name in WORKLOAD_LABELS if (value := getattr(self, name))}

    def to_json(self) -> dict[str, object]:
        found: dict[str, object] = dict(self.label_values())
        claimed = [name for name in self.claimed if name in found]
        if claimed:
            found["claimed_by_environment"] = claimed
        return found

    def describe(self) -> str:
        """'pod ml/trainer-0 (container main)', 'Slurm job 4242 step 0 (user alice)', or ''."""
        parts = []
        if self.pod:
            where = f"{self.namespace}/{self.pod}" if self.namespace else self.pod
            parts.append(f"pod {where}" + (f" (container {self.container})" if self.container else ""))
        if self.slurm_job_id:
            step = f" step {self.slurm_step}" if self.slurm_step else ""
            user = f" (user {self.slurm_user})" if self.slurm_user else ""
            parts.append(f"Slurm job {self.slurm_job_id}{step}{user}")
        said = " (as its environment says)" if self.claimed and parts else ""
        return ", ".join(parts) + said

    def __bool__(self) -> bool:
        return any(self.labels())


WORKLOAD_LABELS = tuple(f.name for f in fields(Workload) if f.name != "claimed")
K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")  # a Kubernetes namespace, pod or node name
SLURM_JOB_ID = re.compile(r"^[0-9]{1,20}$")  # ASCII digits (str.isdigit() takes other scripts' digits too)
