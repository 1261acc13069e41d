"""Prometheus metrics: the collector that renders the daemon's last published state from the series
table (export/series.py), keeping what the `export.series` setting asks for. A scrape never touches NVML; a
GPU that vanished simply stops appearing."""

from __future__ import annotations

import math
import platform
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from watchdog import __version__
from watchdog.export.job_view import JobWindows, job_rows
from watchdog.export.series import ALERT_LABELS, FACTS, FULL_MODE, METRICS, PREFIX, READINGS, STANDARD, MetricSpec
from watchdog.plumbing.counters import Counters
from watchdog.sample.rank_labels import RankRow
from watchdog.vocabulary.alert_identity import AlertIdentity
from watchdog.vocabulary.model import (
    WAIT_FIRST_SAMPLES,
    WAIT_FIRST_WAITS,
    WAIT_SAMPLES,
    WAIT_WAITS,
    GpuHealth,
    GpuSample,
    NodeSnapshot,
    Severity,
    Signature,
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


EXPOSITION_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus's text format, as exposition() writes it


def go_float(value: float) -> str:
    """A sample's value as Prometheus's own (Go) writes it: +Inf, -Inf, NaN, 1e+06 for a million, else Python's
    shortest repr (prometheus_client's floatToGoString, whose bytes a test holds ours to)."""
    if value == math.inf:
        return "+Inf"
    if value == -math.inf:
        return "-Inf"
    if value != value:
        return "NaN"
    text = repr(float(value))
    dot = text.find(".")
    if value > 0 and dot > 6:  # Go turns to an exponent sooner than Python
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text


Series = dict[str, list[tuple[tuple[str, ...], float]]]  # metric -> (label values in its spec's order, value)


class WatchdogCollector:
    """Renders the last published state: `series()` says what is there, once; exposition() writes the text a
    scrape gets. collect() hands the same to prometheus_client (a registry's collector), which the daemon
    never imports: a test holds exposition() to its generate_latest byte for byte, which costs a multiple of
    ours (64 GPUs are 1,500 lines)."""

    def __init__(self, published: Callable[[], Published], counters: Counters, mode: str = STANDARD):
        self._published, self._counters = published, counters
        self._specs = tuple(spec for spec in METRICS if mode in spec.modes)  # what export.series keeps
        kept = {spec.name for spec in self._specs}
        self._text = [layout for layout in _TEXT if layout[0].name in kept]
        self._readings = tuple((metric, slot) for metric, slot in _READING_SLOTS if metric in kept)
        self._sparse = mode != FULL_MODE
        # Each GPU's facts as last read (gpu and uuid -> gpu_info's labels): a fact that fails to read for a
        # tick keeps its value rather than start a second gpu_info series.
        self._facts: dict[tuple[str, str], tuple[str, ...]] = {}
        self._job_windows = JobWindows()  # the job view's counts (export/job_view.py)
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
        stall, culprits = self._episodes(out, state.episodes, indexes)
        gpus, now = (snapshot.gpus, snapshot.time_seconds) if snapshot is not None else ((), 0.0)
        for name, rows in job_rows(state.ranks, gpus, now, stall, culprits, self._job_windows).items():
            out[name] += rows
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
        for name, values in counted.items():
            for labels, value in sorted(values.items()):
                out[name].append((tuple(labels), value))
        kept = {spec.name: out[spec.name] for spec in self._specs}
        if self._sparse:
            for spec in self._specs:
                if spec.sparse:
                    kept[spec.name] = [(labels, value) for labels, value in out[spec.name]
                                       if not spec.quiet(labels, value)]
        return kept

    def collect(self) -> Iterator[object]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        series = self.series()
        for spec in self._specs:
            name = PREFIX + spec.name
            family = (CounterMetricFamily(name.removesuffix("_total"), spec.help, labels=spec.labels)
                      if spec.kind == "counter" else GaugeMetricFamily(name, spec.help, labels=spec.labels))
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
        for spec, header, sample, order in self._text:
            out.append(header)
            for labels, value in series[spec.name]:
                name = names.get((sample, labels))
                if name is None:
                    pairs = ",".join([f'{spec.labels[i]}="{_escaped(labels[i])}"' for i in order])
                    name = names[(sample, labels)] = f"{sample}{{{pairs}}} " if labels else f"{sample} "
                text = values.get(value)
                if text is None:
                    text = values[value] = go_float(value)
                out.append(name)
                out.append(text)
                out.append("\n")
        return "".join(out).encode("utf-8")

    def _gpu(self, out: Series, gpu: GpuSample) -> None:
        labels = (str(gpu.index), gpu.uuid or "")
        for metric, slot in self._readings:  # those export.series keeps
            value = gpu[slot]
            if value is not None:
                out[metric].append((labels, value))  # type: ignore[arg-type]  # READINGS are numbers
        if gpu.power_watts is not None and gpu.power_limit_watts:
            out["gpu_power_ratio"].append((labels, gpu.power_watts / gpu.power_limit_watts))
        if gpu.energy_joules is not None:
            out["gpu_energy_joules_total"].append((labels, gpu.energy_joules))
        for counts, names, unit in ((gpu.rank_waits, _STACK_SERIES, 1), (gpu.nccl_waits, _NCCL_SERIES, 1000)):
            if counts:  # samples, or milliseconds
                out[names[0]].append((labels, counts[WAIT_SAMPLES] / unit))
                out[names[1]].append((labels, counts[WAIT_WAITS] / unit))
                if counts[WAIT_FIRST_SAMPLES]:
                    out[names[2]].append(((labels[0],), counts[WAIT_FIRST_WAITS] / counts[WAIT_FIRST_SAMPLES]))
        if gpu.clock_event_reasons is not None:
            out["gpu_throttle"].append((labels, 1 if gpu.throttle_reasons else 0))
        health = out["gpu_health"]
        for each, value in _HEALTHS:
            health.append(((*labels, value), 1 if gpu.health is each else 0))
        out["gpu_info"].append(((*labels, gpu.name or "", *self._facts_of(labels, gpu)), 1))

    def _facts_of(self, labels: tuple[str, str], gpu: GpuSample) -> tuple[str, ...]:
        known = self._facts.get(labels)
        facts = tuple(_fact_text(gpu[slot]) for slot in _FACT_SLOTS)  # type: ignore[arg-type]  # numbers
        if known is not None:
            facts = tuple(now or before for now, before in zip(facts, known))
        if known != facts:
            if len(self._facts) > _REMEMBERED:  # GPUs come and go (a uuid per card): bounded
                self._facts.clear()
            self._facts[labels] = facts
        return facts

    @staticmethod
    def _episodes(out: Series, episodes: tuple[EpisodeView, ...], gpus: list[int]) -> tuple[dict[int, int], set[int]]:
        """Renders the episodes; returns each GPU's highest stall state (busy_spin, waiting, zero_util) and the
        GPUs others wait on, for the job view."""
        state: dict[tuple[int, Signature], int] = {}
        stall: dict[int, int] = {}
        culprits: set[int] = set()
        for episode in episodes:
            for gpu in episode.gpus:
                key = (gpu, episode.signature)
                state[key] = max(state.get(key, 0), _STATE[episode.severity])
                if episode.signature in _STALLS:
                    stall[gpu] = max(stall.get(gpu, 0), _STATE[episode.severity])
                if episode.severity is not None:
                    out["episode_start_time_seconds"].append(((str(gpu), episode.signature.value), episode.onset_wall))
            if episode.slowdown is not None and episode.severity is not None:
                for gpu in episode.gpus:
                    out["straggler_slowdown_ratio"].append(((str(gpu),), episode.slowdown))
            if episode.signature is Signature.WAITING and episode.severity is not None:
                for gpu in episode.culprit_gpus:
                    out["episode_culprit"].append(((str(gpu), episode.signature.value), 1))
                    culprits.add(gpu)
        rows = out["episode_state"]
        for gpu in gpus:
            label = str(gpu)
            for signature, value in _SIGNATURES:
                rows.append(((label, value), state.get((gpu, signature), 0)))
        return stall, culprits


_STACK_SERIES = ("rank_stack_samples_total", "rank_stack_waits_total", "rank_first_wait_ratio")  # a rank's counts:
_NCCL_SERIES = ("rank_nccl_wall_seconds_total", "rank_nccl_seconds_total", "rank_first_nccl_ratio")  # all, waits, first
_REMEMBERED = 1 << 15
# Iterated for every GPU at every scrape: each member with its label value, and each reading's slot.
_HEALTHS = tuple((health, health.value) for health in GpuHealth)
_SIGNATURES = tuple((signature, signature.value) for signature in Signature)
_STALLS = frozenset({Signature.BUSY_SPIN, Signature.WAITING, Signature.ZERO_UTIL})  # a job's stall state
_READING_SLOTS = tuple((metric, GpuSample._fields.index(field_name)) for metric, field_name in READINGS.items())
_FACT_SLOTS = tuple(GpuSample._fields.index(field_name) for field_name in FACTS.values())


def _fact_text(value: float | None) -> str:
    """A fact as a label value: a whole number without a decimal point (700, 85899345920), else as is."""
    if value is None:
        return ""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


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
