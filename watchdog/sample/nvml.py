"""The live source: every GPU's readings through NVML. The only module that imports pynvml.

Each reading ends as a value, "not supported" (remembered per GPU and field: never asked again, left
out of the snapshot) or an error (kept in GpuSample.errors). GPU-is-lost and unknown errors make the
GPU `lost`. An NVML call can hang inside a wedged driver, so each GPU is read on its own worker thread
and a read that outlives `call_timeout_seconds` marks that GPU `hung`; the next tick does not queue
behind it, and the GPU comes back by itself once the call returns.

Health: the Xid events of every GPU are drained from one NVML event set each tick (on a thread of their own,
within the same deadline), and each GPU's health counters (ECC, memory repair, NVLink errors, PCIe replays and
link) are read every HEALTH_SECONDS; detect/gpu_health.py judges them.
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import ctypes
import importlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, TypeVar

from watchdog import logfmt
from watchdog.model import HEALTH_COUNTERS, GpuHealth, GpuSample, NodeSnapshot
from watchdog.sample.nvml_inventory import Inventory, read_inventory, text_of

T = TypeVar("T")

# The narrow port: every pynvml function this module calls. tests/fakes implements exactly these.
FUNCTIONS = (
    "nvmlInit", "nvmlShutdown", "nvmlSystemGetDriverVersion", "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetMaxClockInfo",
    "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetClockInfo", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetTemperature",
    "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetComputeRunningProcesses",
    "nvmlGpmQueryDeviceSupport", "nvmlGpmSampleAlloc", "nvmlGpmSampleGet", "nvmlGpmMetricsGet",
    "nvmlGpmSampleFree",
    # the doctor's inventory
    "nvmlSystemGetNVMLVersion", "nvmlSystemGetCudaDriverVersion", "nvmlDeviceGetPersistenceMode",
    "nvmlDeviceGetPciInfo", "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkGeneration",
    "nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetMaxPcieLinkWidth", "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetP2PStatus", "nvmlDeviceGetTopologyCommonAncestor",
    # health: Xid events and counters
    "nvmlEventSetCreate", "nvmlDeviceRegisterEvents", "nvmlEventSetWait_v2", "nvmlEventSetFree",
    "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows", "nvmlDeviceGetRetiredPagesPendingStatus",
    "nvmlDeviceGetNvLinkErrorCounter", "nvmlDeviceGetPcieReplayCounter",
)


class NvmlUnavailable(Exception):
    """NVML cannot be used on this machine (no driver, no library, init failed or hung)."""


ENERGY_SECONDS = 30.0  # the energy counter is read this often (see _readers: it is a slow call)
HEALTH_SECONDS = 30.0  # the health counters are read this often: they move slowly, and NVLink takes a call a link
_XIDS_PER_TICK = 256  # Xid events drained at most in one tick (the rest wait for the next)


@dataclass
class _Device:
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


class NvmlSource:
    def __init__(self, nvml: ModuleType | Any | None = None, call_timeout_seconds: float = 2.0,
                 clock: Callable[[], float] = time.time, init_timeout_seconds: float = 10.0):
        self._nvml = nvml
        self._timeout = call_timeout_seconds
        self._init_timeout = init_timeout_seconds
        self._clock = clock
        self._devices: list[_Device] = []
        self.driver_version: str | None = None
        self._lost_classes: tuple[type[BaseException], ...] = ()
        self._reader_table: list[tuple[tuple[str, ...], Callable[[_Device], Any]]] = []
        self._open = False
        self._events: Any = None  # the NVML event set the GPUs' Xid events arrive in
        self._event_gpus: dict[Any, int] = {}  # device handle (as _handle_key has it) -> GPU index
        self._xid_executor: futures.ThreadPoolExecutor | None = None
        self._xid_pending: futures.Future[dict[int, list[int]]] | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def open(self) -> None:
        if self._nvml is None:
            try:
                self._nvml = importlib.import_module("pynvml")
            except ImportError as exc:
                raise NvmlUnavailable(f"the nvidia-ml-py package is not installed ({exc})") from None
        nv = self._nvml
        self._lost_classes = (nv.NVMLError_GpuIsLost, nv.NVMLError_Unknown)
        self._reader_table = self._readers()
        try:
            _bounded(nv.nvmlInit, self._init_timeout, "nvml-init")
        except futures.TimeoutError:
            raise NvmlUnavailable("nvmlInit did not return: the NVIDIA driver looks wedged") from None
        except nv.NVMLError as exc:
            raise NvmlUnavailable(f"NVML could not start: {exc} (is the NVIDIA driver installed and "
                                  "loaded? `nvidia-smi` should work)") from None
        self._open = True
        try:
            self.driver_version = text_of(nv.nvmlSystemGetDriverVersion())
        except nv.NVMLError:
            self.driver_version = None
        for index in range(nv.nvmlDeviceGetCount()):
            self._devices.append(self._open_device(index))
        self._watch_xids()

    def _watch_xids(self) -> None:
        """Register every GPU for Xid events in one event set; a GPU or driver without them is read without."""
        nv = self._nvml
        assert nv is not None
        try:
            events = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            logfmt.event("nvml_no_xid_events", reason=str(exc))
            return
        for dev in self._devices:
            if dev.handle is None:
                continue
            try:
                nv.nvmlDeviceRegisterEvents(dev.handle, nv.nvmlEventTypeXidCriticalError, events)
            except nv.NVMLError as exc:
                logfmt.event("nvml_no_xid_events", gpu=dev.index, reason=str(exc))
                continue
            self._event_gpus[_handle_key(dev.handle)] = dev.index
        if not self._event_gpus:
            with contextlib.suppress(nv.NVMLError):
                nv.nvmlEventSetFree(events)
            return
        self._events = events
        self._xid_executor = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvml-xid")

    def _open_device(self, index: int) -> _Device:
        nv = self._nvml
        assert nv is not None
        dev = _Device(index, handle=None)
        try:
            dev.handle = nv.nvmlDeviceGetHandleByIndex(index)
        except nv.NVMLError as exc:
            logfmt.event("nvml_no_handle", level=logfmt.WARNING, gpu=index, error=str(exc))
            return dev
        for attr, call in (("uuid", nv.nvmlDeviceGetUUID), ("name", nv.nvmlDeviceGetName)):
            with contextlib.suppress(nv.NVMLError):
                setattr(dev, attr, text_of(call(dev.handle)))
        with contextlib.suppress(nv.NVMLError):  # nvmlDeviceGetMaxClockInfo(SM), MHz; clocks.max.sm
            dev.sm_clock_max_hertz = nv.nvmlDeviceGetMaxClockInfo(dev.handle, nv.NVML_CLOCK_SM) * 1e6
        try:  # GPM (Hopper and later): SM activity that a spinning kernel cannot fake
            if nv.nvmlGpmQueryDeviceSupport(dev.handle).isSupportedDevice:
                dev.gpm_samples = [nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()]
        except nv.NVMLError:
            dev.unsupported.add("sm_activity_ratio")
        if not dev.gpm_samples:
            dev.unsupported.add("sm_activity_ratio")
        dev.executor = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"nvml-gpu{index}")
        return dev

    def close(self, hung_wait_seconds: float = 1.0) -> None:
        """Free the GPM samples and shut NVML down, but never under a call that is still running: a call
        hung in the driver gets `hung_wait_seconds` to return, and if it does not, NVML is left open
        (the process is exiting; freeing it under the call could crash it)."""
        nv = self._nvml
        deadline = time.monotonic() + hung_wait_seconds
        busy = []
        for dev in self._devices:
            if dev.pending is not None and not dev.pending.done():
                with contextlib.suppress(futures.TimeoutError):
                    dev.pending.result(timeout=max(0.0, deadline - time.monotonic()))
            if dev.pending is not None and not dev.pending.done():
                busy.append(dev.index)
            if dev.executor is not None:
                dev.executor.shutdown(wait=False, cancel_futures=True)
        if self._xid_pending is not None and not self._xid_pending.done():
            with contextlib.suppress(futures.TimeoutError):
                self._xid_pending.result(timeout=max(0.0, deadline - time.monotonic()))
            if not self._xid_pending.done():
                busy.append(-1)
        if self._xid_executor is not None:
            self._xid_executor.shutdown(wait=False, cancel_futures=True)
        if nv is not None and not busy:
            for dev in self._devices:
                for gpm in dev.gpm_samples:
                    with contextlib.suppress(nv.NVMLError):
                        nv.nvmlGpmSampleFree(gpm)
            if self._events is not None:
                with contextlib.suppress(nv.NVMLError):
                    nv.nvmlEventSetFree(self._events)
        self._events, self._event_gpus, self._xid_executor, self._xid_pending = None, {}, None, None
        self._devices = []
        if nv is None or not self._open:
            return
        if busy:
            logfmt.event("nvml_shutdown_skipped", level=logfmt.WARNING,
                         gpus=",".join("xid events" if gpu < 0 else str(gpu) for gpu in busy),
                         reason="an NVML call is still running")
            return
        self._open = False
        with contextlib.suppress(Exception):  # shutting down: nothing left to protect
            nv.nvmlShutdown()

    def inventory(self, timeout_seconds: float = 10.0) -> Inventory:
        """The doctor's NVML facts, read through this open source within `timeout_seconds`."""
        nv = self._nvml
        if nv is None or not self._open:
            raise NvmlUnavailable("NVML is not open")
        handles = [d.handle for d in self._devices]
        try:
            return _bounded(lambda: read_inventory(nv, handles), timeout_seconds, "nvml-inventory")
        except futures.TimeoutError:
            raise NvmlUnavailable(f"reading the NVML inventory took over {timeout_seconds:g} s") from None

    @property
    def watches_xids(self) -> bool:
        """Whether Xid events are watched (some GPU registered for them)."""
        return self._xid_executor is not None

    @property
    def gpu_count(self) -> int:
        return len(self._devices)

    # -- sampling --------------------------------------------------------------------------------
    def sample(self) -> NodeSnapshot:
        now = self._clock()
        deadline = time.monotonic() + self._timeout
        submitted: list[tuple[_Device, futures.Future[GpuSample] | None]] = []
        for dev in self._devices:
            if dev.handle is None or dev.executor is None:
                submitted.append((dev, None))
                continue
            if dev.pending is not None and not dev.pending.done():
                submitted.append((dev, None))  # still stuck in the previous call: do not queue behind it
                continue
            dev.pending = dev.executor.submit(self._read, dev)
            submitted.append((dev, dev.pending))
        xids = self._xids(deadline)
        gpus = []
        for dev, future in submitted:
            sample = self._collect(dev, future, deadline)
            gpus.append(sample._replace(xids=tuple(xids[dev.index])) if dev.index in xids else sample)
        return NodeSnapshot(now, tuple(gpus))

    def _xids(self, deadline: float) -> dict[int, list[int]]:
        """The Xid events that arrived since the last tick, by GPU. A drain still stuck in the driver is not
        queued behind: its events come with the tick on which it returns."""
        if self._xid_executor is None:
            return {}
        if self._xid_pending is None:
            self._xid_pending = self._xid_executor.submit(self._drain_xids)
        try:
            found = self._xid_pending.result(timeout=max(0.0, deadline - time.monotonic()))
        except futures.TimeoutError:
            return {}
        except Exception as exc:  # a bug or an NVML error: this tick's events are lost, never the loop
            logfmt.event("nvml_xid_read_failed", level=logfmt.ERROR, error=f"{type(exc).__name__}: {exc}")
            found = {}
        self._xid_pending = None
        for gpu, numbers in found.items():
            for xid in numbers:
                logfmt.event("gpu_xid", level=logfmt.WARNING, gpu=gpu, xid=xid)
        return found

    def _drain_xids(self) -> dict[int, list[int]]:
        """Runs on the Xid thread: every waiting event, without waiting for more."""
        nv = self._nvml
        assert nv is not None
        found: dict[int, list[int]] = {}
        for _ in range(_XIDS_PER_TICK):
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError_Timeout:
                break
            if not data.eventType & nv.nvmlEventTypeXidCriticalError:
                continue
            gpu = self._event_gpus.get(_handle_key(data.device))
            if gpu is not None:
                found.setdefault(gpu, []).append(int(data.eventData))
        return found

    @staticmethod
    def _unread(dev: _Device, health: GpuHealth, field: str, message: str) -> GpuSample:
        return GpuSample(index=dev.index, uuid=dev.uuid, name=dev.name, health=health, errors=((field, message),))

    def _collect(self, dev: _Device, future: futures.Future[GpuSample] | None, deadline: float) -> GpuSample:
        if dev.handle is None:
            return self._unread(dev, GpuHealth.LOST, "handle", "no NVML handle")
        if future is None:
            return self._unread(dev, GpuHealth.HUNG, "nvml", "an earlier NVML call on this GPU has not returned")
        try:
            sample = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except futures.TimeoutError:
            return self._unread(dev, GpuHealth.HUNG, "nvml", f"NVML call did not return within {self._timeout:g} s")
        except Exception as exc:  # a bug in a reader must not stop the loop; report it on this GPU
            logfmt.event("nvml_read_failed", level=logfmt.ERROR, gpu=dev.index, error=f"{type(exc).__name__}: {exc}")
            return self._unread(dev, GpuHealth.OK, "nvml", f"{type(exc).__name__}: {exc}")
        dev.pending = None
        return sample

    def _read(self, dev: _Device) -> GpuSample:
        """Runs on the GPU's worker thread."""
        nv = self._nvml
        assert nv is not None
        values: dict[str, Any] = {}
        errors: list[tuple[str, str]] = []
        try:
            for names, reader in self._reader_table:
                if names[0] in dev.unsupported:
                    continue
                try:
                    result = reader(dev)
                except nv.NVMLError_NotSupported:
                    dev.unsupported.update(names)
                    continue
                except nv.NVMLError_FunctionNotFound:
                    logfmt.event("nvml_function_missing", gpu=dev.index, reading=names[0], action="not asking again")
                    dev.unsupported.update(names)
                    continue
                except self._lost_classes:
                    raise
                except nv.NVMLError as exc:
                    errors.extend((name, str(exc)) for name in names)
                    continue
                if result is None:
                    continue
                if len(names) == 1:
                    values[names[0]] = result
                else:
                    values.update(zip(names, result))
        except self._lost_classes as exc:
            return GpuSample(index=dev.index, uuid=dev.uuid, name=dev.name, health=GpuHealth.LOST,
                             errors=(("nvml", str(exc)),))
        pids = values.pop("pids", ())
        return GpuSample(index=dev.index, uuid=dev.uuid, name=dev.name, sm_clock_max_hertz=dev.sm_clock_max_hertz,
                         pids=tuple(pids), errors=tuple(errors), **values)

    def _readers(self) -> list[tuple[tuple[str, ...], Callable[[_Device], Any]]]:
        nv = self._nvml
        assert nv is not None

        def utilization(d: _Device) -> tuple[float, float]:
            # nvmlDeviceGetUtilizationRates: percent of the last sample period a kernel ran / memory was
            # read or written; nvidia-smi utilization.gpu, utilization.memory
            rates = nv.nvmlDeviceGetUtilizationRates(d.handle)
            return rates.gpu / 100.0, rates.memory / 100.0

        def power(d: _Device) -> float:  # nvmlDeviceGetPowerUsage, mW; nvidia-smi power.draw
            return nv.nvmlDeviceGetPowerUsage(d.handle) / 1000.0

        def power_limit(d: _Device) -> float:  # nvmlDeviceGetEnforcedPowerLimit, mW; enforced.power.limit
            return nv.nvmlDeviceGetEnforcedPowerLimit(d.handle) / 1000.0

        def sm_clock(d: _Device) -> float:  # nvmlDeviceGetClockInfo(SM), MHz; nvidia-smi clocks.sm
            return nv.nvmlDeviceGetClockInfo(d.handle, nv.NVML_CLOCK_SM) * 1e6

        def memory(d: _Device) -> tuple[int, int]:  # nvmlDeviceGetMemoryInfo, bytes; memory.used/.total
            info = nv.nvmlDeviceGetMemoryInfo(d.handle)
            return int(info.used), int(info.total)

        def temperature(d: _Device) -> float:  # nvmlDeviceGetTemperature(GPU), C; temperature.gpu
            return float(nv.nvmlDeviceGetTemperature(d.handle, nv.NVML_TEMPERATURE_GPU))

        def clock_events(d: _Device) -> int:
            # nvmlDeviceGetCurrentClocksEventReasons, bit mask; clocks_event_reasons.active. Drivers
            # before r535 only have the deprecated throttle-reasons call.
            try:
                return int(nv.nvmlDeviceGetCurrentClocksEventReasons(d.handle))
            except (nv.NVMLError_FunctionNotFound, AttributeError):
                return int(nv.nvmlDeviceGetCurrentClocksThrottleReasons(d.handle))

        def energy(d: _Device) -> float:
            # nvmlDeviceGetTotalEnergyConsumption, mJ since driver load. It costs milliseconds of driver
            # time on some GPUs (3 ms on an H100 with r580: most of a tick's NVML time) and only feeds a
            # counter: read every ENERGY_SECONDS, its last value in between.
            now = time.monotonic()
            if d.energy is None or now - d.energy[0] >= ENERGY_SECONDS:
                d.energy = (now, nv.nvmlDeviceGetTotalEnergyConsumption(d.handle) / 1000.0)
            return d.energy[1]

        def sm_activity(d: _Device) -> float | None:
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

        def health(d: _Device) -> tuple[int | None, ...]:
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
                except self._lost_classes:
                    raise
                except nv.NVMLError:
                    continue
            counters = tuple(values.get(name) for name in HEALTH_COUNTERS)
            d.health = (now, counters)
            return counters

        def ecc(d: _Device) -> tuple[int, int]:  # nvmlDeviceGetTotalEccErrors(volatile); ecc.errors.*.volatile.total
            return (int(nv.nvmlDeviceGetTotalEccErrors(d.handle, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                                       nv.NVML_VOLATILE_ECC)),
                    int(nv.nvmlDeviceGetTotalEccErrors(d.handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                       nv.NVML_VOLATILE_ECC)))

        def memory_repair(d: _Device) -> tuple[int, int | None]:
            # nvmlDeviceGetRemappedRows (Ampere and later): pending, failed; remapped_rows.pending/.failure.
            # Before Ampere, page retirement: nvmlDeviceGetRetiredPagesPendingStatus; retired_pages.pending.
            try:
                _, _, pending, failed = nv.nvmlDeviceGetRemappedRows(d.handle)
                return int(bool(pending)), int(bool(failed))
            except nv.NVMLError_NotSupported:
                status = nv.nvmlDeviceGetRetiredPagesPendingStatus(d.handle)
                return int(status == nv.NVML_FEATURE_ENABLED), None

        def nvlink(d: _Device) -> tuple[int]:
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

        def pcie_replays(d: _Device) -> tuple[int]:  # nvmlDeviceGetPcieReplayCounter; pcie.link... replay count
            return (int(nv.nvmlDeviceGetPcieReplayCounter(d.handle)),)

        def pcie_link(d: _Device) -> tuple[int, int, int, int]:
            # pcie.link.gen.current/.max, pcie.link.width.current/.max (a link trains down at idle to save
            # power: detect/gpu_health.py judges the generation only while the GPU works)
            h = d.handle
            return (int(nv.nvmlDeviceGetCurrPcieLinkGeneration(h)), int(nv.nvmlDeviceGetMaxPcieLinkGeneration(h)),
                    int(nv.nvmlDeviceGetCurrPcieLinkWidth(h)), int(nv.nvmlDeviceGetMaxPcieLinkWidth(h)))

        health_parts: list[tuple[tuple[str, ...], Callable[[_Device], tuple[int | None, ...]]]] = [
            (("ecc_corrected", "ecc_uncorrected"), ecc),
            (("memory_repair_pending", "memory_repair_failed"), memory_repair),
            (("nvlink_errors",), nvlink),
            (("pcie_replays",), pcie_replays),
            (("pcie_link_gen", "pcie_link_gen_max", "pcie_link_width", "pcie_link_width_max"), pcie_link),
        ]

        def processes(d: _Device) -> list[int]:  # nvmlDeviceGetComputeRunningProcesses, host pids
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


def _handle_key(handle: Any) -> Any:
    """A device handle as a dictionary key: an event names its GPU by a handle object of its own, which
    compares equal to the one the GPU was opened with only by the address it points at."""
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle


def _bounded(call: Callable[[], T], timeout: float, name: str) -> T:
    """Run `call` on a daemon thread and wait at most `timeout` (futures.TimeoutError); a call that hangs
    in the driver is left behind rather than hanging the caller."""
    result: futures.Future[T] = futures.Future()

    def run() -> None:
        try:
            result.set_result(call())
        except BaseException as exc:  # handed to the caller
            result.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return result.result(timeout=timeout)
