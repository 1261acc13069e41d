"""The live source: every GPU's readings through NVML. The only module that imports pynvml.

Each reading ends as a value, "not supported" (remembered per GPU and field: never asked again, left
out of the snapshot) or an error (kept in GpuSample.errors). GPU-is-lost and unknown errors make the
GPU `lost`. An NVML call can hang inside a wedged driver, so each GPU is read on its own worker thread
and a read that outlives `call_timeout_seconds` marks that GPU `hung`; the next tick does not queue
behind it, and the GPU comes back by itself once the call returns.

Health: the Xid events of every GPU are drained from one NVML event set each tick (on a thread of their own,
within the same deadline), and each GPU's health counters (ECC, memory repair, NVLink errors, PCIe replays and
link) are read every HEALTH_SECONDS; detect/gpu_health.py judges them. What each reading asks NVML, and how
often, is in nvml_readings.py.
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import ctypes
import importlib
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

from watchdog.plumbing import logfmt
from watchdog.sample.nvml_inventory import Inventory, read_inventory, text_of
from watchdog.sample.nvml_readings import Device, Reader, readers
from watchdog.vocabulary.model import GpuHealth, GpuSample, NodeSnapshot

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


_XIDS_PER_TICK = 256  # Xid events drained at most in one tick (the rest wait for the next)
_XID_SAID_EVERY_SECONDS = 60.0  # an Xid that keeps coming on a GPU is logged once a minute, with its count


class NvmlSource:
    def __init__(self, nvml: ModuleType | Any | None = None, call_timeout_seconds: float = 2.0,
                 clock: Callable[[], float] = time.time, init_timeout_seconds: float = 10.0):
        self._nvml = nvml
        self._timeout = call_timeout_seconds
        self._init_timeout = init_timeout_seconds
        self._clock = clock
        self._devices: list[Device] = []
        self.driver_version: str | None = None
        self._lost_classes: tuple[type[BaseException], ...] = ()
        self._reader_table: list[Reader] = []
        self._open = False
        self._events: Any = None  # the NVML event set the GPUs' Xid events arrive in
        self._event_gpus: dict[Any, int] = {}  # device handle (as _handle_key has it) -> GPU index
        self._xid_executor: futures.ThreadPoolExecutor | None = None
        self._xid_pending: futures.Future[tuple[dict[int, list[int]], str | None]] | None = None
        self._xid_failing: str | None = None  # why the event wait fails, while it does (logged when it starts)
        self._xid_said: dict[tuple[int, int], tuple[float, int]] = {}  # (gpu, xid) -> (when logged, since then)

    # -- lifecycle -------------------------------------------------------------------------------
    def open(self) -> None:
        if self._nvml is None:
            try:
                self._nvml = importlib.import_module("pynvml")
            except ImportError as exc:
                raise NvmlUnavailable(f"the nvidia-ml-py package is not installed ({exc})") from None
        nv = self._nvml
        self._lost_classes = (nv.NVMLError_GpuIsLost, nv.NVMLError_Unknown)
        self._reader_table = readers(nv, self._lost_classes)
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

    def _open_device(self, index: int) -> Device:
        nv = self._nvml
        assert nv is not None
        dev = Device(index, handle=None)
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
        submitted: list[tuple[Device, futures.Future[GpuSample] | None]] = []
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
        queued behind: its events come with the tick on which it returns. Events drained before the wait failed
        are kept; a wait that keeps failing is logged when it starts and when it stops, not every tick."""
        if self._xid_executor is None:
            return {}
        if self._xid_pending is None:
            self._xid_pending = self._xid_executor.submit(self._drain_xids)
        try:
            found, failed = self._xid_pending.result(timeout=max(0.0, deadline - time.monotonic()))
        except futures.TimeoutError:
            return {}
        except Exception as exc:  # a bug: this tick's events are lost, never the loop
            found, failed = {}, f"{type(exc).__name__}: {exc}"
        self._xid_pending = None
        if failed is not None and self._xid_failing is None:
            logfmt.event("nvml_xid_read_failed", level=logfmt.ERROR, error=failed,
                         action="said once; the wait is tried again every tick")
        elif failed is None and self._xid_failing is not None:
            logfmt.event("nvml_xid_read_recovered", error=self._xid_failing)
        self._xid_failing = failed
        self._say_xids(found)
        return found

    def _say_xids(self, found: dict[int, list[int]]) -> None:
        """A log line for each Xid on each GPU when it first comes, then at most once a minute with how many came
        meanwhile: a program faulting in a loop sends thousands, and each is already counted in the samples."""
        now = time.monotonic()
        for gpu, numbers in found.items():
            for xid, count in Counter(numbers).items():
                said, since = self._xid_said.get((gpu, xid), (-math.inf, 0))
                if now - said >= _XID_SAID_EVERY_SECONDS:
                    logfmt.event("gpu_xid", level=logfmt.WARNING, gpu=gpu, xid=xid, count=since + count)
                    self._xid_said[(gpu, xid)] = (now, 0)
                else:
                    self._xid_said[(gpu, xid)] = (said, since + count)
        while len(self._xid_said) > 1024:  # distinct (GPU, Xid) pairs are few; a flood of new ones is bounded
            self._xid_said.pop(next(iter(self._xid_said)))

    def _drain_xids(self) -> tuple[dict[int, list[int]], str | None]:
        """Runs on the Xid thread: every waiting event, without waiting for more; and why the wait failed, if
        it did (the events drained before that are kept)."""
        nv = self._nvml
        assert nv is not None
        found: dict[int, list[int]] = {}
        for _ in range(_XIDS_PER_TICK):
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError_Timeout:
                break
            except nv.NVMLError as exc:
                return found, f"nvmlEventSetWait: {exc}"
            if not data.eventType & nv.nvmlEventTypeXidCriticalError:
                continue
            gpu = self._event_gpus.get(_handle_key(data.device))
            if gpu is not None:
                found.setdefault(gpu, []).append(int(data.eventData))
        return found, None

    @staticmethod
    def _unread(dev: Device, health: GpuHealth, field: str, message: str) -> GpuSample:
        return GpuSample(index=dev.index, uuid=dev.uuid, name=dev.name, health=health, errors=((field, message),))

    def _collect(self, dev: Device, future: futures.Future[GpuSample] | None, deadline: float) -> GpuSample:
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

    def _read(self, dev: Device) -> GpuSample:
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
