"""The live NVML source, against the faithful fake of pynvml in tests/fakes."""

from __future__ import annotations

import inspect
import threading
import time

import pynvml
import pytest

from tests.fakes.fake_pynvml import FakeGpu, FakeNvml
from watchdog.sample import nvml, nvml_readings
from watchdog.sample.nvml import FUNCTIONS, NvmlSource, NvmlUnavailable
from watchdog.vocabulary.model import GpuHealth


def opened(*gpus: FakeGpu, timeout: float = 0.5, **kwargs: object) -> tuple[NvmlSource, FakeNvml]:
    fake = FakeNvml(list(gpus), **kwargs)  # type: ignore[arg-type]
    source = NvmlSource(nvml=fake, call_timeout_seconds=timeout, clock=lambda: 1000.0)
    source.open()
    return source, fake


def test_fake_implements_the_port_with_pynvml_signatures() -> None:
    fake = FakeNvml([])
    for name in FUNCTIONS:
        real, ours = getattr(pynvml, name), getattr(fake, name)
        real_params = [p for p in inspect.signature(real).parameters.values()
                       if p.default is inspect.Parameter.empty]
        our_params = [p for p in inspect.signature(ours).parameters.values()
                      if p.default is inspect.Parameter.empty]
        assert [p.name for p in our_params] == [p.name for p in real_params], name


def test_readings_are_converted_to_base_units() -> None:
    source, _ = opened(FakeGpu(util_percent=100, memory_util_percent=3, power_mw=151_250, power_limit_mw=700_000,
                               sm_clock_mhz=1980, memory_used=40 * 2**30, temperature_c=41, energy_mj=5_000,
                               clock_event_reasons=0x40, pids=[4711, 4712], sm_activity_percent=2.5))
    first = source.sample()
    g = source.sample().gpus[0]
    assert first.time_seconds == 1000.0 and first.gpus[0].sm_activity_ratio is None  # GPM needs two samples
    assert g.utilization_ratio == 1.0 and g.memory_utilization_ratio == 0.03
    assert g.power_watts == 151.25 and g.power_limit_watts == 700.0
    assert g.sm_clock_hertz == 1.98e9 and g.sm_clock_max_hertz == 1.98e9
    assert g.memory_used_bytes == 40 * 2**30 and g.temperature_celsius == 41.0 and g.energy_joules == 5.0
    assert g.clock_event_reasons == 0x40 and g.pids == (4711, 4712)
    assert g.sm_activity_ratio == pytest.approx(0.025)
    assert (g.uuid, g.name, g.health) == ("GPU-00000000-0000-0000-0000-000000000000", "NVIDIA H100 80GB HBM3",
                                          GpuHealth.OK)
    source.close()


def test_not_supported_is_remembered_and_not_asked_again() -> None:
    gpu = FakeGpu(not_supported={"nvmlDeviceGetTotalEnergyConsumption"}, gpm=False)
    source, _ = opened(gpu)
    for _ in range(3):
        sample = source.sample().gpus[0]
        assert sample.energy_joules is None and sample.sm_activity_ratio is None and sample.errors == ()
    assert gpu.calls.count("nvmlDeviceGetTotalEnergyConsumption") == 1
    source.close()


def test_old_driver_falls_back_to_throttle_reasons() -> None:
    gpu = FakeGpu(clock_event_reasons=0x8)
    source, _ = opened(gpu, missing={"nvmlDeviceGetCurrentClocksEventReasons"})
    assert source.sample().gpus[0].clock_event_reasons == 0x8
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" in gpu.calls
    source.close()


def test_other_errors_are_kept_per_field_and_the_gpu_stays_ok() -> None:
    gpu = FakeGpu(errors={"nvmlDeviceGetPowerUsage": pynvml.NVML_ERROR_NO_PERMISSION})
    source, _ = opened(gpu)
    sample = source.sample().gpus[0]
    assert sample.health is GpuHealth.OK and sample.power_watts is None
    assert ("power_watts", "Insufficient Permissions") in sample.errors
    assert sample.utilization_ratio == 0.0
    source.close()


def test_gpu_lost_mid_run_is_a_typed_state_and_others_keep_reading() -> None:
    a, b = FakeGpu(util_percent=50), FakeGpu(util_percent=60, uuid="GPU-b")
    source, _ = opened(a, b)
    assert source.sample().gpus[1].health is GpuHealth.OK
    b.lost = True
    snap = source.sample()
    assert snap.gpus[0].utilization_ratio == 0.5 and snap.gpus[0].health is GpuHealth.OK
    assert snap.gpus[1].health is GpuHealth.LOST and snap.gpus[1].uuid == "GPU-b"
    assert snap.gpus[1].errors == (("nvml", "GPU is lost"),)
    source.close()


def test_unknown_error_counts_as_lost() -> None:
    gpu = FakeGpu(errors={"nvmlDeviceGetUtilizationRates": pynvml.NVML_ERROR_UNKNOWN})
    source, _ = opened(gpu)
    assert source.sample().gpus[0].health is GpuHealth.LOST
    source.close()


def test_a_hung_call_is_bounded_and_the_gpu_recovers() -> None:
    stuck, fine = FakeGpu(hang_in="nvmlDeviceGetPowerUsage"), FakeGpu(util_percent=70)
    source, _ = opened(stuck, fine, timeout=0.3)
    snap = source.sample()  # returns (the test would hang otherwise), the stuck GPU said as hung
    assert snap.gpus[0].health is GpuHealth.HUNG and snap.gpus[1].utilization_ratio == 0.7
    # The next tick does not queue behind the stuck call: it answers at once, without a deadline of its own.
    again = source.sample().gpus[0]
    assert again.health is GpuHealth.HUNG
    assert again.errors == (("nvml", "an earlier NVML call on this GPU has not returned"),), again.errors
    stuck.hang_in = None
    stuck.release.set()
    deadline = time.monotonic() + 60  # a wait, not a limit: it comes back on the tick after the call returns
    while source.sample().gpus[0].health is not GpuHealth.OK:
        assert time.monotonic() < deadline, "the GPU did not come back after the call returned"
        time.sleep(0.05)
    source.close()


def test_init_failure_says_what_to_check() -> None:
    fake = FakeNvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded.*nvidia-smi"):
        NvmlSource(nvml=fake).open()


def test_init_that_hangs_is_bounded() -> None:
    release = threading.Event()
    fake = FakeNvml([])
    fake.nvmlInit = lambda: release.wait()  # type: ignore[method-assign]
    source = NvmlSource(nvml=fake, init_timeout_seconds=0.2)
    with pytest.raises(NvmlUnavailable, match="wedged"):  # raised at its bound: the init never returns
        source.open()
    release.set()


def test_real_library_missing_is_a_clear_error() -> None:
    """On this machine there is no NVIDIA driver: the real pynvml must end in NvmlUnavailable."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present here")
    with pytest.raises(NvmlUnavailable, match="NVML could not start"):
        NvmlSource().open()


def test_close_never_shuts_nvml_down_under_a_running_call() -> None:
    stuck = FakeGpu(hang_in="nvmlDeviceGetPowerUsage")
    source, fake = opened(stuck, FakeGpu(), timeout=0.2)
    assert source.sample().gpus[0].health is GpuHealth.HUNG
    source.close(hung_wait_seconds=0.3)  # returns although the call never does
    assert fake.initialized, "nvmlShutdown ran while a call was still inside the driver"
    stuck.release.set()


def test_close_waits_briefly_for_a_call_that_returns_then_shuts_down() -> None:
    slow = FakeGpu(hang_in="nvmlDeviceGetPowerUsage")
    source, fake = opened(slow, timeout=0.1)
    assert source.sample().gpus[0].health is GpuHealth.HUNG
    threading.Timer(0.2, slow.release.set).start()
    source.close(hung_wait_seconds=2.0)
    assert not fake.initialized


def test_the_doctors_inventory_reads_through_the_open_source_with_a_bound() -> None:
    gpu = FakeGpu(hang_in="nvmlDeviceGetPciInfo")
    source, _ = opened(gpu, FakeGpu())
    with pytest.raises(NvmlUnavailable, match="inventory took over"):  # raised at its bound
        source.inventory(timeout_seconds=0.3)
    gpu.hang_in = None
    gpu.release.set()
    inventory = source.inventory()
    assert inventory.driver_version == "550.54.15" and len(inventory.gpus) == 2 and (0, 1) in inventory.p2p
    source.close()


def test_the_energy_counter_is_read_every_half_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvmlDeviceGetTotalEnergyConsumption takes milliseconds on an H100 (measured: 3 ms of a 4.4 ms
    tick): read every ENERGY_SECONDS, its last value kept in between, everything else every tick."""
    now = [100.0]
    monkeypatch.setattr(nvml.time, "monotonic", lambda: now[0])
    gpu = FakeGpu(energy_mj=5_000)
    source, _ = opened(gpu)
    readings = []
    for step in range(4):
        gpu.energy_mj = 5_000 + step * 1_000
        readings.append(source.sample().gpus[0].energy_joules)
        now[0] += 10.0
    assert readings == [5.0, 5.0, 5.0, 8.0]
    assert gpu.calls.count("nvmlDeviceGetTotalEnergyConsumption") == 2
    assert gpu.calls.count("nvmlDeviceGetPowerUsage") == 4
    source.close()


# -- health: Xid events and counters -------------------------------------------------------------------

def test_xid_events_reach_the_sample_of_their_gpu_once() -> None:
    source, fake = opened(FakeGpu(), FakeGpu(uuid="GPU-1"))
    assert [g.xids for g in source.sample().gpus] == [(), ()]
    fake.xid(1, 79)
    fake.xid(1, 45)
    fake.xid(0, 13)
    first, second = source.sample(), source.sample()
    assert [g.xids for g in first.gpus] == [(13,), (79, 45)]
    assert [g.xids for g in second.gpus] == [(), ()]
    source.close()
    assert all(events.freed for events in fake.event_sets)


def test_health_counters_are_read_every_health_seconds_and_repeat_between(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGpu(ecc=(12, 1), remapped_rows=(3, 1, 1, 0), nvlinks=(1, 1, 0), pcie_replays=7,
                  pcie_gen=(3, 5), pcie_width=(8, 16),
                  nvlink_errors={(0, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT): 5,
                                 (1, pynvml.NVML_NVLINK_ERROR_DL_REPLAY): 2,
                                 (2, pynvml.NVML_NVLINK_ERROR_DL_REPLAY): 100})  # link 2 is down: not counted
    source, _ = opened(gpu)
    g = source.sample().gpus[0]
    assert (g.ecc_corrected, g.ecc_uncorrected, g.memory_repair_pending, g.memory_repair_failed) == (12, 1, 1, 0)
    assert (g.nvlink_errors, g.pcie_replays) == (7, 7)
    assert (g.pcie_link_gen, g.pcie_link_gen_max, g.pcie_link_width, g.pcie_link_width_max) == (3, 5, 8, 16)
    gpu.ecc = (20, 2)
    assert source.sample().gpus[0].ecc_corrected == 12  # within HEALTH_SECONDS: the last values
    calls = gpu.calls.count("nvmlDeviceGetTotalEccErrors")
    monkeypatch.setattr(nvml_readings, "HEALTH_SECONDS", 0.0)
    assert source.sample().gpus[0][1:] != g[1:]
    assert (source.sample().gpus[0].ecc_corrected, gpu.calls.count("nvmlDeviceGetTotalEccErrors")) == (20, calls + 4)
    source.close()


def test_health_a_gpu_does_not_support_is_left_out_and_not_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer card: no ECC, no row remapping (page retirement answers instead), no NVLink."""
    monkeypatch.setattr(nvml_readings, "HEALTH_SECONDS", 0.0)
    gpu = FakeGpu(not_supported={"nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows"}, retired_pages_pending=1)
    source, _ = opened(gpu)
    for _ in range(3):
        g = source.sample().gpus[0]
        assert (g.ecc_corrected, g.ecc_uncorrected, g.nvlink_errors) == (None, None, None)
        assert (g.memory_repair_pending, g.memory_repair_failed, g.pcie_replays) == (1, None, 0)
        assert g.errors == () and g.health is GpuHealth.OK
    assert gpu.calls.count("nvmlDeviceGetTotalEccErrors") == 1 and gpu.calls.count("nvmlDeviceGetNvLinkState") == 1
    source.close()


def test_a_driver_without_xid_events_still_samples() -> None:
    source, fake = opened(FakeGpu(), missing={"nvmlEventSetCreate"})
    assert source.sample().gpus[0].xids == () and fake.event_sets == []
    source.close()
    source, fake = opened(FakeGpu(not_supported={"nvmlDeviceRegisterEvents"}))
    assert source.sample().gpus[0].utilization_ratio == 0.0 and fake.event_sets[0].freed
    source.close()


def test_an_event_wait_that_hangs_costs_the_xids_not_the_tick() -> None:
    source, fake = opened(FakeGpu(util_percent=100), timeout=0.3)
    events = fake.event_sets[0]
    events.hang = threading.Event()
    drains: list[float] = []
    drain = source._drain_xids
    source._drain_xids = lambda: (drains.append(time.monotonic()), drain())[1]  # type: ignore[method-assign]
    for _ in range(3):
        sample = source.sample().gpus[0]
        assert sample.utilization_ratio == 1.0 and sample.health is GpuHealth.OK
    assert len(drains) == 1  # one drain stuck in the driver, and no tick queued another behind it
    fake.xid(0, 48)
    events.hang.set()
    seen = [source.sample().gpus[0].xids for _ in range(2)]
    assert (48,) in seen
    source.close()
