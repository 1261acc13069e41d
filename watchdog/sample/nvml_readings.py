"""What the live source reads from each GPU, one NVML call (or a few) per reading: the table of readings a
tick walks through (sample/nvml.py runs it on the GPU's worker thread, with the errors and the unsupported
readings it remembers), what each reading means in nvidia-smi's words, and which readings are slow or move
slowly and so are read less often than every tick."""

from __future__ import annotations

import concurrent.futures as futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from watchdog.vocabulary.model import HEALTH_COUNTERS, GpuSample

ENERGY_SECONDS = 30.0  # the energy counter is read this often (see _Readings.energy: it is a slow call)
HEALTH_SECONDS = 30.0  # the health counters are read this often: they move slowly, and NVLink takes a call a link

@dataclass
class Device:
    """One GPU as the live source holds it: its handle, what it does not support, and the state of its
    slower readings."""

    index: int
    handle: Any
    uuid: str | None = None
    name: str | None = None
    sm_clock_max_hertz: float | None = None
    unsupported: set[str] = field(default_factory=set)
    gpm_samples: list[Any] = field(default_factory=list)
    gpm_primed: bool = False
    pending: futures.Future[GpuSample] | None = None
    executor: futures.ThreadPoolExecutor | None = None
    energy: tuple[float, float] | None = None  # (monotonic time read, joules)
    health: tuple[float, tuple[int | None, ...]] | None = None  # (monotonic time read, HEALTH_COUNTERS)
    health_unsupported: set[str] = field(default_factory=set)
    nvlinks: list[int] | None = None  # the links that answered, found at the first health read


Reader = tuple[tuple[str, ...], Callable[[Device], Any]]


class _Readings:
    """The readings of one NVML binding: each a method over one GPU."""

    def __init__(self, nv: ModuleType | Any, lost: tuple[type[BaseException], ...]):
        self.nv, self.lost = nv, lost

    def utilization(self, d: Device) -> tuple[float, float]:
        # nvmlDeviceGetUtilizationRates: percent of the last sample period a kernel ran / memory was
        # read or written; nvidia-smi utilization.gpu, utilization.memory
        rates = self.nv.nvmlDeviceGetUtilizationRates(d.handle)
        return rates.gpu / 100.0, rates.memory / 100.0

    def power(self, d: Device) -> float:  # nvmlDeviceGetPowerUsage, mW; nvidia-smi power.draw
        return self.nv.nvmlDeviceGetPowerUsage(d.handle) / 1000.0

    def power_limit(self, d: Device) -> float:  # nvmlDeviceGetEnforcedPowerLimit, mW; enforced.power.limit
        return self.nv.nvmlDeviceGetEnforcedPowerLimit(d.handle) / 1000.0

    def sm_clock(self, d: Device) -> float:  # nvmlDeviceGetClockInfo(SM), MHz; nvidia-smi clocks.sm
        return self.nv.nvmlDeviceGetClockInfo(d.handle, self.nv.NVML_CLOCK_SM) * 1e6

    def memory(self, d: Device) -> tuple[int, int]:  # nvmlDeviceGetMemoryInfo, bytes; memory.used/.total
        info = self.nv.nvmlDeviceGetMemoryInfo(d.handle)
        return int(info.used), int(info.total)

    def temperature(self, d: Device) -> float:  # nvmlDeviceGetTemperature(GPU), C; temperature.gpu
        return float(self.nv.nvmlDeviceGetTemperature(d.handle, self.nv.NVML_TEMPERATURE_GPU))

    def clock_events(self, d: Device) -> int:
        # nvmlDeviceGetCurrentClocksEventReasons, bit mask; clocks_event_reasons.active. Drivers
        # before r535 only have the deprecated throttle-reasons call.
        try:
            return int(self.nv.nvmlDeviceGetCurrentClocksEventReasons(d.handle))
        except (self.nv.NVMLError_FunctionNotFound, AttributeError):
            return int(self.nv.nvmlDeviceGetCurrentClocksThrottleReasons(d.handle))

    def energy(self, d: Device) -> float:
        # nvmlDeviceGetTotalEnergyConsumption, mJ since driver load. It costs milliseconds of driver
        # time on some GPUs (3 ms on an H100 with r580: most of a tick's NVML time) and only feeds a
        # counter: read every ENERGY_SECONDS, its last value in between.
        now = time.monotonic()
        if d.energy is None or now - d.energy[0] >= ENERGY_SECONDS:
            d.energy = (now, self.nv.nvmlDeviceGetTotalEnergyConsumption(d.handle) / 1000.0)
        return d.energy[1]

    def sm_activity(self, d: Device) -> float | None:
        # GPM SM_UTIL between this tick's sample and the last one, percent of SMs busy (Hopper+);
        # no nvidia-smi equivalent (dcgm's DCGM_FI_PROF_SM_ACTIVE is the closest)
        previous, current = d.gpm_samples
        self.nv.nvmlGpmSampleGet(d.handle, current)
        d.gpm_samples.reverse()
        if not d.gpm_primed:
            d.gpm_primed = True
            return None
        request = self.nv.c_nvmlGpmMetricsGet_t()
        request.version = self.nv.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = 1
        request.sample1 = previous
        request.sample2 = current
        request.metrics[0].metricId = self.nv.NVML_GPM_METRIC_SM_UTIL
        self.nv.nvmlGpmMetricsGet(request)
        metric = request.metrics[0]
        if metric.nvmlReturn != self.nv.NVML_SUCCESS:
            raise self.nv.NVMLError(metric.nvmlReturn)
        return float(metric.value) / 100.0

    def health(self, d: Device) -> tuple[int | None, ...]:
        # The health counters (model.HEALTH_COUNTERS), read every HEALTH_SECONDS; their last values
        # in between. Each part a GPU does not support is not asked again; a failed part reads None
        # and is asked again next time.
        now = time.monotonic()
        if d.health is not None and now - d.health[0] < HEALTH_SECONDS:
            return d.health[1]
        values: dict[str, int | None] = {}
        for names, part in self.health_parts():
            if names[0] in d.health_unsupported:
                continue
            try:
                values.update(zip(names, part(d)))
            except (self.nv.NVMLError_NotSupported, self.nv.NVMLError_FunctionNotFound):
                d.health_unsupported.update(names)
            except self.lost:
                raise
            except self.nv.NVMLError:
                continue
        counters = tuple(values.get(name) for name in HEALTH_COUNTERS)
        d.health = (now, counters)
        return counters

    def ecc(self, d: Device) -> tuple[int, int]:  # nvmlDeviceGetTotalEccErrors(volatile); ecc.errors.*.volatile.total
        return (int(self.nv.nvmlDeviceGetTotalEccErrors(d.handle, self.nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                                   self.nv.NVML_VOLATILE_ECC)),
                int(self.nv.nvmlDeviceGetTotalEccErrors(d.handle, self.nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                   self.nv.NVML_VOLATILE_ECC)))

    def memory_repair(self, d: Device) -> tuple[int, int | None]:
        # nvmlDeviceGetRemappedRows (Ampere and later): pending, failed; remapped_rows.pending/.failure.
        # Before Ampere, page retirement: nvmlDeviceGetRetiredPagesPendingStatus; retired_pages.pending.
        try:
            _, _, pending, failed = self.nv.nvmlDeviceGetRemappedRows(d.handle)
            return int(bool(pending)), int(bool(failed))
        except self.nv.NVMLError_NotSupported:
            status = self.nv.nvmlDeviceGetRetiredPagesPendingStatus(d.handle)
            return int(status == self.nv.NVML_FEATURE_ENABLED), None

    def nvlink(self, d: Device) -> tuple[int]:
        # nvmlDeviceGetNvLinkErrorCounter: replay, recovery and CRC (flit, data) errors of each active link
        if d.nvlinks is None:
            d.nvlinks = []
            for link in range(self.nv.NVML_NVLINK_MAX_LINKS):
                try:
                    if self.nv.nvmlDeviceGetNvLinkState(d.handle, link) == self.nv.NVML_FEATURE_ENABLED:
                        d.nvlinks.append(link)
                except self.nv.NVMLError_NotSupported:
                    if link == 0:
                        raise
                    break
                except self.nv.NVMLError_InvalidArgument:
                    break
        if not d.nvlinks:
            raise self.nv.NVMLError(self.nv.NVML_ERROR_NOT_SUPPORTED)
        return (sum(int(self.nv.nvmlDeviceGetNvLinkErrorCounter(d.handle, link, counter)) for link in d.nvlinks
                    for counter in (self.nv.NVML_NVLINK_ERROR_DL_REPLAY, self.nv.NVML_NVLINK_ERROR_DL_RECOVERY,
                                    self.nv.NVML_NVLINK_ERROR_DL_CRC_FLIT, self.nv.NVML_NVLINK_ERROR_DL_CRC_DATA)),)

    def pcie_replays(self, d: Device) -> tuple[int]:  # nvmlDeviceGetPcieReplayCounter; pcie.link... replay count
        return (int(self.nv.nvmlDeviceGetPcieReplayCounter(d.handle)),)

    def pcie_link(self, d: Device) -> tuple[int, int, int, int]:
        # pcie.link.gen.current/.max, pcie.link.width.current/.max (a link trains down at idle to save
        # power: detect/gpu_health.py judges the generation only while the GPU works)
        h = d.handle
        nv = self.nv
        return (int(nv.nvmlDeviceGetCurrPcieLinkGeneration(h)), int(nv.nvmlDeviceGetMaxPcieLinkGeneration(h)),
                int(nv.nvmlDeviceGetCurrPcieLinkWidth(h)), int(nv.nvmlDeviceGetMaxPcieLinkWidth(h)))

    def processes(self, d: Device) -> list[int]:  # nvmlDeviceGetComputeRunningProcesses, host pids
        return [p.pid for p in self.nv.nvmlDeviceGetComputeRunningProcesses(d.handle)]

    def health_parts(self) -> list[tuple[tuple[str, ...], Callable[[Device], tuple[int | None, ...]]]]:
        """The health counters' parts: the HEALTH_COUNTERS each fills, and its reading."""
        return [
            (("ecc_corrected", "ecc_uncorrected"), self.ecc),
            (("memory_repair_pending", "memory_repair_failed"), self.memory_repair),
            (("nvlink_errors",), self.nvlink),
            (("pcie_replays",), self.pcie_replays),
            (("pcie_link_gen", "pcie_link_gen_max", "pcie_link_width", "pcie_link_width_max"), self.pcie_link),
        ]


def readers(nv: ModuleType | Any, lost: tuple[type[BaseException], ...]) -> list[Reader]:
    """The table of readings, in the order a tick asks for them: the GpuSample fields each fills and the
    function that reads them from one GPU through `nv` (pynvml or its fake). `lost` are the errors that
    mean the GPU is gone (they end the GPU's read)."""
    readings = _Readings(nv, lost)
    return [
        (("utilization_ratio", "memory_utilization_ratio"), readings.utilization),
        (("power_watts",), readings.power),
        (("power_limit_watts",), readings.power_limit),
        (("sm_clock_hertz",), readings.sm_clock),
        (("memory_used_bytes", "memory_total_bytes"), readings.memory),
        (("temperature_celsius",), readings.temperature),
        (("clock_event_reasons",), readings.clock_events),
        (("energy_joules",), readings.energy),
        (("sm_activity_ratio",), readings.sm_activity),
        (("pids",), readings.processes),
        (HEALTH_COUNTERS, readings.health),
    ]
