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

from watchdog.model import HEALTH_COUNTERS, GpuSample

ENERGY_SECONDS = 30.0  # the energy counter is read this often (see _readers: it is a slow call)
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


def readers(nv: ModuleType | Any, lost: tuple[type[BaseException], ...]) -> list[Reader]:
    """The table of readings, in the order a tick asks for them: the GpuSample fields each fills and the
    function that reads them from one GPU through `nv` (pynvml or its fake). `lost` are the errors that
    mean the GPU is gone (they end the GPU's read)."""

    def utilization(d: Device) -> tuple[float, float]:
        # nvmlDeviceGetUtilizationRates: percent of the last sample period a kernel ran / memory was
        # read or written; nvidia-smi utilization.gpu, utilization.memory
        rates = nv.nvmlDeviceGetUtilizationRates(d.handle)
        return rates.gpu / 100.0, rates.memory / 100.0

    def power(d: Device) -> float:  # nvmlDeviceGetPowerUsage, mW; nvidia-smi power.draw
        return nv.nvmlDeviceGetPowerUsage(d.handle) / 1000.0

    def power_limit(d: Device) -> float:  # nvmlDeviceGetEnforcedPowerLimit, mW; enforced.power.limit
        return nv.nvmlDeviceGetEnforcedPowerLimit(d.handle) / 1000.0

    def sm_clock(d: Device) -> float:  # nvmlDeviceGetClockInfo(SM), MHz; nvidia-smi clocks.sm
        return nv.nvmlDeviceGetClockInfo(d.handle, nv.NVML_CLOCK_SM) * 1e6

    def memory(d: Device) -> tuple[int, int]:  # nvmlDeviceGetMemoryInfo, bytes; memory.used/.total
        info = nv.nvmlDeviceGetMemoryInfo(d.handle)
        return int(info.used), int(info.total)

    def temperature(d: Device) -> float:  # nvmlDeviceGetTemperature(GPU), C; temperature.gpu
        return float(nv.nvmlDeviceGetTemperature(d.handle, nv.NVML_TEMPERATURE_GPU))

    def clock_events(d: Device) -> int:
        # nvmlDeviceGetCurrentClocksEventReasons, bit mask; clocks_event_reasons.active. Drivers
        # before r535 only have the deprecated throttle-reasons call.
        try:
            return int(nv.nvmlDeviceGetCurrentClocksEventReasons(d.handle))
        except (nv.NVMLError_FunctionNotFound, AttributeError):
            return int(nv.nvmlDeviceGetCurrentClocksThrottleReasons(d.handle))

    def energy(d: Device) -> float:
        # nvmlDeviceGetTotalEnergyConsumption, mJ since driver load. It costs milliseconds of driver
        # time on some GPUs (3 ms on an H100 with r580: most of a tick's NVML time) and only feeds a
        # counter: read every ENERGY_SECONDS, its last value in between.
        now = time.monotonic()
        if d.energy is None or now - d.energy[0] >= ENERGY_SECONDS:
            d.energy = (now, nv.nvmlDeviceGetTotalEnergyConsumption(d.handle) / 1000.0)
        return d.energy[1]

    def sm_activity(d: Device) -> float | None:
        # GPM SM_UTIL between this tick's sample and the last one, percent of SMs busy (Hopper+);
        # no nvidia-smi equivalent (dcgm's DCGM_FI_PROF_SM_ACTIVE is the closest)
        previous, current = d.gpm_samples
        nv.nvmlGpmSampleGet(d.handle, current)
        d.gpm_samples.reverse()
        if not d.gpm_primed:
            d.gpm_primed = True
            return None
        request = nv.c_nvmlGpmMetricsGet_t()
        request.version = nv.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = 1
        request.sample1 = previous
        request.sample2 = current
        request.metrics[0].metricId = nv.NVML_GPM_METRIC_SM_UTIL
        nv.nvmlGpmMetricsGet(request)
        metric = request.metrics[0]
        if metric.nvmlReturn != nv.NVML_SUCCESS:
            raise nv.NVMLError(metric.nvmlReturn)
        return float(metric.value) / 100.0

    def health(d: Device) -> tuple[int | None, ...]:
        # The health counters (model.HEALTH_COUNTERS), read every HEALTH_SECONDS; their last values
        # in between. Each part a GPU does not support is not asked again; a failed part reads None
        # and is asked again next time.
        now = time.monotonic()
        if d.health is not None and now - d.health[0] < HEALTH_SECONDS:
            return d.health[1]
        values: dict[str, int | None] = {}
        for names, part in health_parts:
            if names[0] in d.health_unsupported:
                continue
            try:
                values.update(zip(names, part(d)))
            except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound):
                d.health_unsupported.update(names)
            except lost:
                raise
            except nv.NVMLError:
                continue
        counters = tuple(values.get(name) for name in HEALTH_COUNTERS)
        d.health = (now, counters)
        return counters

    def ecc(d: Device) -> tuple[int, int]:  # nvmlDeviceGetTotalEccErrors(volatile); ecc.errors.*.volatile.total
        return (int(nv.nvmlDeviceGetTotalEccErrors(d.handle, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                                   nv.NVML_VOLATILE_ECC)),
                int(nv.nvmlDeviceGetTotalEccErrors(d.handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                   nv.NVML_VOLATILE_ECC)))

    def memory_repair(d: Device) -> tuple[int, int | None]:
        # nvmlDeviceGetRemappedRows (Ampere and later): pending, failed; remapped_rows.pending/.failure.
        # Before Ampere, page retirement: nvmlDeviceGetRetiredPagesPendingStatus; retired_pages.pending.
        try:
            _, _, pending, failed = nv.nvmlDeviceGetRemappedRows(d.handle)
            return int(bool(pending)), int(bool(failed))
        except nv.NVMLError_NotSupported:
            status = nv.nvmlDeviceGetRetiredPagesPendingStatus(d.handle)
            return int(status == nv.NVML_FEATURE_ENABLED), None

    def nvlink(d: Device) -> tuple[int]:
        # nvmlDeviceGetNvLinkErrorCounter: replay, recovery and CRC (flit, data) errors of each active link
        if d.nvlinks is None:
            d.nvlinks = []
            for link in range(nv.NVML_NVLINK_MAX_LINKS):
                try:
                    if nv.nvmlDeviceGetNvLinkState(d.handle, link) == nv.NVML_FEATURE_ENABLED:
                        d.nvlinks.append(link)
                except nv.NVMLError_NotSupported:
                    if link == 0:
                        raise
                    break
                except nv.NVMLError_InvalidArgument:
                    break
        if not d.nvlinks:
            raise nv.NVMLError(nv.NVML_ERROR_NOT_SUPPORTED)
        return (sum(int(nv.nvmlDeviceGetNvLinkErrorCounter(d.handle, link, counter)) for link in d.nvlinks
                    for counter in (nv.NVML_NVLINK_ERROR_DL_REPLAY, nv.NVML_NVLINK_ERROR_DL_RECOVERY,
                                    nv.NVML_NVLINK_ERROR_DL_CRC_FLIT, nv.NVML_NVLINK_ERROR_DL_CRC_DATA)),)

    def pcie_replays(d: Device) -> tuple[int]:  # nvmlDeviceGetPcieReplayCounter; pcie.link... replay count
        return (int(nv.nvmlDeviceGetPcieReplayCounter(d.handle)),)

    def pcie_link(d: Device) -> tuple[int, int, int, int]:
        # pcie.link.gen.current/.max, pcie.link.width.current/.max (a link trains down at idle to save
        # power: detect/gpu_health.py judges the generation only while the GPU works)
        h = d.handle
        return (int(nv.nvmlDeviceGetCurrPcieLinkGeneration(h)), int(nv.nvmlDeviceGetMaxPcieLinkGeneration(h)),
                int(nv.nvmlDeviceGetCurrPcieLinkWidth(h)), int(nv.nvmlDeviceGetMaxPcieLinkWidth(h)))

    health_parts: list[tuple[tuple[str, ...], Callable[[Device], tuple[int | None, ...]]]] = [
        (("ecc_corrected", "ecc_uncorrected"), ecc),
        (("memory_repair_pending", "memory_repair_failed"), memory_repair),
        (("nvlink_errors",), nvlink),
        (("pcie_replays",), pcie_replays),
        (("pcie_link_gen", "pcie_link_gen_max", "pcie_link_width", "pcie_link_width_max"), pcie_link),
    ]

    def processes(d: Device) -> list[int]:  # nvmlDeviceGetComputeRunningProcesses, host pids
        return [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(d.handle)]

    return [
        (("utilization_ratio", "memory_utilization_ratio"), utilization),
        (("power_watts",), power),
        (("power_limit_watts",), power_limit),
        (("sm_clock_hertz",), sm_clock),
        (("memory_used_bytes", "memory_total_bytes"), memory),
        (("temperature_celsius",), temperature),
        (("clock_event_reasons",), clock_events),
        (("energy_joules",), energy),
        (("sm_activity_ratio",), sm_activity),
        (("pids",), processes),
        (HEALTH_COUNTERS, health),
    ]
