"""A faithful fake of the pynvml module for the functions watchdog.sample.nvml calls.

Same function names and argument lists, pynvml's own exception classes and constants, and real
ctypes structures where pynvml hands them back (GPM). Tests script each GPU through `FakeGpu`:
readings, fields that are not supported, functions the driver lacks, a GPU lost mid-run, a call
that hangs until released.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml as _real

# Everything the real module exports that is not a function we fake: exception classes, constants,
# ctypes structures.
_EXPORTS = {name: getattr(_real, name) for name in dir(_real)
            if name.startswith(("NVMLError", "NVML_", "c_nvml", "nvmlClocks", "nvmlEventType"))}


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    util_percent: int = 0
    memory_util_percent: int = 0
    power_mw: int = 70_000
    power_limit_mw: int = 700_000
    sm_clock_mhz: int = 1980
    sm_clock_max_mhz: int = 1980
    memory_used: int = 500 * 2**20
    memory_total: int = 80 * 2**30
    temperature_c: int = 35
    clock_event_reasons: int = 0
    energy_mj: int = 1_000_000
    gpm: bool = True
    sm_activity_percent: float = 0.0
    pids: list[int] = field(default_factory=list)
    bus_id: str = "00000000:07:00.0"
    persistence: int = 1
    pcie_gen: tuple[int, int] = (5, 5)
    pcie_width: tuple[int, int] = (16, 16)
    nvlinks: tuple[int, ...] = ()  # per link: 1 active, 0 down; empty: no NVLink
    ecc: tuple[int, int] = (0, 0)  # volatile (corrected, uncorrected)
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)  # corrected rows, uncorrected rows, pending, failed
    retired_pages_pending: int = 0  # NVML_FEATURE_ENABLED (1) when a retirement waits for a reset
    nvlink_errors: dict[tuple[int, int], int] = field(default_factory=dict)  # (link, counter) -> count
    pcie_replays: int = 0
    not_supported: set[str] = field(default_factory=set)  # pynvml function names
    lost: bool = False
    errors: dict[str, int] = field(default_factory=dict)  # function name -> NVML error code
    hang_in: str | None = None  # function name that blocks until `release` is set
    release: threading.Event = field(default_factory=threading.Event)
    calls: list[str] = field(default_factory=list)


@dataclass(eq=False)
class FakeEventSet:
    """An NVML event set: the GPUs registered with it and the events waiting in it."""

    devices: set[int] = field(default_factory=set)
    queue: list[tuple[int, int]] = field(default_factory=list)  # (GPU handle, Xid)
    freed: bool = False
    hang: threading.Event | None = None  # set: nvmlEventSetWait_v2 blocks until it is set
    failing: int | None = None  # an NVML error code the wait raises once the queue is empty (not a timeout)


class FakeNvml(SimpleNamespace):
    """Pass as `NvmlSource(nvml=FakeNvml(gpus=[...]))`."""

    def __init__(self, gpus: list[FakeGpu], missing: set[str] | None = None, init_error: int | None = None,
                 driver_version: str = "550.54.15", p2p: dict[tuple[int, int], int] | None = None,
                 topology: dict[tuple[int, int], int] | None = None):
        super().__init__(**_EXPORTS)
        self.gpus = gpus
        self.missing = missing or set()  # functions this driver lacks (NVML_ERROR_FUNCTION_NOT_FOUND)
        self.init_error = init_error
        self.driver = driver_version
        self.initialized = False
        self.p2p = p2p or {}  # (i, j) -> NVML_P2P_STATUS_*; default OK
        self.topology = topology or {}  # (i, j) -> NVML_TOPOLOGY_*; default NVML_TOPOLOGY_NODE
        self.event_sets: list[FakeEventSet] = []

    def xid(self, gpu: int, xid: int) -> None:
        """The driver reports Xid `xid` on GPU `gpu`: it reaches every event set that GPU is registered with."""
        for events in self.event_sets:
            if gpu in events.devices and not events.freed:
                events.queue.append((gpu, xid))

    # -- helpers ---------------------------------------------------------------------------------
    def _gpu(self, handle: Any, function: str) -> FakeGpu:
        if function in self.missing:
            raise _real.NVMLError(_real.NVML_ERROR_FUNCTION_NOT_FOUND)
        if not self.initialized:
            raise _real.NVMLError(_real.NVML_ERROR_UNINITIALIZED)
        gpu = self.gpus[handle]
        gpu.calls.append(function)
        if gpu.hang_in == function:
            gpu.release.wait()
        if gpu.lost:
            raise _real.NVMLError(_real.NVML_ERROR_GPU_IS_LOST)
        if function in gpu.not_supported:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        if function in gpu.errors:
            raise _real.NVMLError(gpu.errors[function])
        return gpu

    # -- the functions watchdog.sample.nvml.FUNCTIONS names --------------------------------------
    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise _real.NVMLError(self.init_error)
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < len(self.gpus):
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self._gpu(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetName(self, handle: int) -> str:
        return self._gpu(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetMaxClockInfo(self, handle: int, type: int) -> int:
        assert type == _real.NVML_CLOCK_SM
        return self._gpu(handle, "nvmlDeviceGetMaxClockInfo").sm_clock_max_mhz

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        g = self._gpu(handle, "nvmlDeviceGetUtilizationRates")
        rates = _real.c_nvmlUtilization_t()
        rates.gpu, rates.memory = g.util_percent, g.memory_util_percent
        return rates

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return self._gpu(handle, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: int) -> int:
        return self._gpu(handle, "nvmlDeviceGetEnforcedPowerLimit").power_limit_mw

    def nvmlDeviceGetClockInfo(self, handle: int, type: int) -> int:
        assert type == _real.NVML_CLOCK_SM
        return self._gpu(handle, "nvmlDeviceGetClockInfo").sm_clock_mhz

    def nvmlDeviceGetMemoryInfo(self, handle: int, version: Any = None) -> Any:
        g = self._gpu(handle, "nvmlDeviceGetMemoryInfo")
        info = _real.c_nvmlMemory_t()
        info.total, info.used, info.free = g.memory_total, g.memory_used, g.memory_total - g.memory_used
        return info

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        assert sensor == _real.NVML_TEMPERATURE_GPU
        return self._gpu(handle, "nvmlDeviceGetTemperature").temperature_c

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        return self._gpu(handle, "nvmlDeviceGetCurrentClocksEventReasons").clock_event_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: int) -> int:
        return self._gpu(handle, "nvmlDeviceGetCurrentClocksThrottleReasons").clock_event_reasons

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        return self._gpu(handle, "nvmlDeviceGetTotalEnergyConsumption").energy_mj

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        g = self._gpu(handle, "nvmlDeviceGetComputeRunningProcesses")
        return [SimpleNamespace(pid=pid, usedGpuMemory=None) for pid in g.pids]

    def nvmlGpmQueryDeviceSupport(self, device: int) -> Any:
        g = self._gpu(device, "nvmlGpmQueryDeviceSupport")
        support = _real.c_nvmlGpmSupport_t()
        support.version = _real.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = 1 if g.gpm else 0
        return support

    def nvmlGpmSampleAlloc(self) -> Any:
        return _real.c_nvmlGpmSample_t()

    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        return None

    def nvmlGpmSampleGet(self, device: int, gpmSample: Any) -> Any:
        self._gpu(device, "nvmlGpmSampleGet")
        self._last_gpm_device = device
        return gpmSample

    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        # The real call computes the metric between sample1 and sample2; the fake reports the GPU's
        # scripted activity for the GPU whose sample was taken last.
        g = self._gpu(self._last_gpm_device, "nvmlGpmMetricsGet")
        assert metricsGet.version == _real.NVML_GPM_METRICS_GET_VERSION
        for i in range(metricsGet.numMetrics):
            metric = metricsGet.metrics[i]
            assert metric.metricId == _real.NVML_GPM_METRIC_SM_UTIL
            metric.value = g.sm_activity_percent
            metric.nvmlReturn = _real.NVML_SUCCESS
        return metricsGet

    # -- the doctor's inventory ------------------------------------------------------------------
    def nvmlSystemGetNVMLVersion(self) -> str:
        return "12.550.54.15"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 12040

    def nvmlDeviceGetPersistenceMode(self, handle: int) -> int:
        return self._gpu(handle, "nvmlDeviceGetPersistenceMode").persistence

    def nvmlDeviceGetPciInfo(self, handle: int) -> Any:
        return SimpleNamespace(busId=self._gpu(handle, "nvmlDeviceGetPciInfo").bus_id.encode())

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: int) -> int:
        return self._gpu(handle, "nvmlDeviceGetCurrPcieLinkGeneration").pcie_gen[0]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: int) -> int:
        return self._gpu(handle, "nvmlDeviceGetMaxPcieLinkGeneration").pcie_gen[1]

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: int) -> int:
        return self._gpu(handle, "nvmlDeviceGetCurrPcieLinkWidth").pcie_width[0]

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: int) -> int:
        return self._gpu(handle, "nvmlDeviceGetMaxPcieLinkWidth").pcie_width[1]

    def nvmlDeviceGetNvLinkState(self, device: int, link: int) -> int:
        g = self._gpu(device, "nvmlDeviceGetNvLinkState")
        if link >= len(g.nvlinks):
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT if g.nvlinks else _real.NVML_ERROR_NOT_SUPPORTED)
        return g.nvlinks[link]

    def nvmlDeviceGetP2PStatus(self, device1: int, device2: int, p2pIndex: int) -> int:
        assert isinstance(p2pIndex, int), "NVML takes the capability index as an integer"
        self._gpu(device1, "nvmlDeviceGetP2PStatus")
        return self.p2p.get((device1, device2), _real.NVML_P2P_STATUS_OK)

    # -- health ----------------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> FakeEventSet:
        if "nvmlEventSetCreate" in self.missing:
            raise _real.NVMLError(_real.NVML_ERROR_FUNCTION_NOT_FOUND)
        events = FakeEventSet()
        self.event_sets.append(events)
        return events

    def nvmlDeviceRegisterEvents(self, handle: int, eventTypes: int, eventSet: FakeEventSet) -> None:
        self._gpu(handle, "nvmlDeviceRegisterEvents")
        assert eventTypes == _real.nvmlEventTypeXidCriticalError
        eventSet.devices.add(handle)

    def nvmlEventSetWait_v2(self, eventSet: FakeEventSet, timeoutms: int) -> Any:
        if "nvmlEventSetWait_v2" in self.missing:
            raise _real.NVMLError(_real.NVML_ERROR_FUNCTION_NOT_FOUND)
        assert not eventSet.freed, "waiting on a freed event set"
        if eventSet.hang is not None:
            eventSet.hang.wait()
        if not eventSet.queue:
            raise _real.NVMLError(eventSet.failing if eventSet.failing is not None else _real.NVML_ERROR_TIMEOUT)
        gpu, xid = eventSet.queue.pop(0)
        return SimpleNamespace(device=gpu, eventType=_real.nvmlEventTypeXidCriticalError, eventData=xid,
                               gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)

    def nvmlEventSetFree(self, eventSet: FakeEventSet) -> None:
        eventSet.freed = True

    def nvmlDeviceGetTotalEccErrors(self, handle: int, errorType: int, counterType: int) -> int:
        g = self._gpu(handle, "nvmlDeviceGetTotalEccErrors")
        assert counterType == _real.NVML_VOLATILE_ECC
        return g.ecc[0 if errorType == _real.NVML_MEMORY_ERROR_TYPE_CORRECTED else 1]

    def nvmlDeviceGetRemappedRows(self, device: int) -> tuple[int, int, int, int]:
        return self._gpu(device, "nvmlDeviceGetRemappedRows").remapped_rows

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: int) -> int:
        return self._gpu(device, "nvmlDeviceGetRetiredPagesPendingStatus").retired_pages_pending

    def nvmlDeviceGetNvLinkErrorCounter(self, device: int, link: int, counter: int) -> int:
        g = self._gpu(device, "nvmlDeviceGetNvLinkErrorCounter")
        if link >= len(g.nvlinks):
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        return g.nvlink_errors.get((link, counter), 0)

    def nvmlDeviceGetPcieReplayCounter(self, handle: int) -> int:
        return self._gpu(handle, "nvmlDeviceGetPcieReplayCounter").pcie_replays

    def nvmlDeviceGetTopologyCommonAncestor(self, device1: int, device2: int) -> int:
        self._gpu(device1, "nvmlDeviceGetTopologyCommonAncestor")
        return self.topology.get((device1, device2), _real.NVML_TOPOLOGY_NODE)
