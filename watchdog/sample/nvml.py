"""The live source: every GPU's readings through NVML. The only module that imports pynvml.

Each reading ends as a value, "not supported" (remembered per GPU and field: never asked again, left
out of the snapshot) or an error (kept in GpuSample.errors). GPU-is-lost and unknown errors make the
GPU `lost`. An NVML call can hang inside a wedged driver, so each GPU is read on its own worker thread
and a read that outlives `call_timeout_seconds` marks that GPU `hung`; the next tick does not queue
behind it, and the GPU comes back by itself once the call returns.
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import importlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, TypeVar

from watchdog import logfmt
from watchdog.model import GpuHealth, GpuSample, NodeSnapshot
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
)


class NvmlUnavailable(Exception):
    """NVML cannot be used on this machine (no driver, no library, init failed or hung)."""


ENERGY_SECONDS = 30.0  # the energy counter is read this often (see _readers: it is a slow call)


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
        if nv is not None and not busy:
            for dev in self._devices:
                for gpm in dev.gpm_samples:
                    with contextlib.suppress(nv.NVMLError):
                        nv.nvmlGpmSampleFree(gpm)
        self._devices = []
        if nv is None or not self._open:
            return
        if busy:
            logfmt.event("nvml_shutdown_skipped", level=logfmt.WARNING, gpus=",".join(map(str, busy)),
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
        gpus = []
        for dev, future in submitted:
            gpus.append(self._collect(dev, future, deadline))
        return NodeSnapshot(now, tuple(gpus))

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
        ]


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
