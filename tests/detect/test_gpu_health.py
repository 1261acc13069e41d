"""gpu_health: a GPU's own fault reports (Xid events, ECC, memory repair, NVLink and PCIe) become a warning on
that GPU, and a hang's verdict names what its GPUs reported before it; the same whether the samples come one
tick at a time (the daemon, through the faithful fake of NVML) or as a replay's stretches."""

from __future__ import annotations

import io
import logging

import pynvml as nvml
import pytest

from tests.detect.test_stretches import assert_same
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml
from watchdog.config import Config, parse_config
from watchdog.detect.engine import DetectorEngine
from watchdog.detect.gpu_health import XIDS
from watchdog.sample import recording, sim
from watchdog.sample.nvml import NvmlSource
from watchdog.vocabulary.model import EpisodeEvent, EventKind, NodeSnapshot, Severity, Signature


def train_then(behaviour: str, seconds: int, gpus: int = 8, at: int = 300) -> list[NodeSnapshot]:
    timeline = ((0, None, "train"), (at, None, behaviour)) if behaviour != "train" else ((0, None, "train"),)
    return list(sim.run(sim.Scenario("health", "", "h100", gpus, seconds, timeline, gpm=True)))


def with_health(stream: list[NodeSnapshot], at: dict[int, dict[int, dict]]) -> list[NodeSnapshot]:
    """The stream with these fields set on GPU g of tick n ({n: {g: fields}}); counters hold from then on."""
    held: dict[int, dict] = {}
    out = []
    for n, snapshot in enumerate(stream):
        for gpu, fields in at.get(n, {}).items():
            held[gpu] = {**held.get(gpu, {}), **{k: v for k, v in fields.items() if k != "xids"}}
        gpus = tuple(s._replace(**held.get(s.index, {}), **{k: v for k, v in at.get(n, {}).get(s.index, {}).items()
                                                          if k == "xids"}) for s in snapshot.gpus)
        out.append(NodeSnapshot(snapshot.time_seconds, gpus))
    return out


def run(stream: list[NodeSnapshot], config: Config | None = None) -> list[EpisodeEvent]:
    engine = DetectorEngine(config or Config())
    return [e for snapshot in stream for e in engine.observe(snapshot)]


def health_events(events: list[EpisodeEvent]) -> list[EpisodeEvent]:
    return [e for e in events if e.signature is Signature.GPU_HEALTH]


def test_a_hardware_xid_warns_on_its_gpu_with_its_meaning_and_action_then_ends() -> None:
    stream = with_health(train_then("train", 1200), {100: {3: {"xids": (79,)}}})
    fired, resolved = health_events(run(stream))
    assert fired.event is EventKind.FIRED and fired.severity is Severity.WARNING and fired.gpus == (3,)
    assert fired.at_seconds - stream[100].time_seconds < 2
    assert "Xid 79 (the GPU has fallen off the bus)" in fired.summary
    assert "What to do on GPU 3: drain the node; check its power, cooling and PCIe slot, and reboot" in fired.summary
    assert resolved.event is EventKind.RESOLVED
    assert 600 <= resolved.at_seconds - stream[100].time_seconds <= 600 + 60 + 5  # held, then clear_seconds


def test_a_known_hardware_xid_is_quoted_first_and_repeats_are_counted_not_pushed_out() -> None:
    """Unknown Xids, and sixteen program faults after it, neither hide nor push out a fall off the bus; neither is
    quoted as the GPU's fault."""
    stream = with_health(train_then("train", 400), {100: {3: {"xids": (79, 500, 501, 502, 503)}},
                                                     101: {3: {"xids": (13,) * 16 + (79, 79)}}})
    fired = health_events(run(stream))[0]
    assert fired.headline.startswith("GPU FAULT (warning): GPU 3: Xid 79 (the GPU has fallen off the bus)")
    assert "Xid 500" not in fired.headline and "Xid 13" not in fired.headline  # neither is the GPU's fault
    assert "drain the node; check its power" in fired.summary
    late = with_health(train_then("train", 400), {100: {3: {"xids": (79,)}}, 101: {3: {"xids": (13,) * 16}},
                                                   102: {3: {"xids": (79, 79)}}})
    engine = DetectorEngine(Config())
    for snapshot in late[:103]:
        engine.observe(snapshot)
    ((signal, what, _),) = engine.health.problems(late[102].time_seconds, 3)
    assert signal == "xid" and what == "Xid 79 (the GPU has fallen off the bus) 3 times, the last just now"


def test_a_counter_logged_every_second_still_climbs_past_a_high_rise() -> None:
    config = parse_config({"detectors": {"gpu_health": {"corrected_ecc_rise": 1000}}})
    stream = with_health(train_then("train", 3000), {n: {0: {"ecc_corrected": n}} for n in range(3000)})
    (fired,) = health_events(run(stream, config))
    assert "corrected ECC errors in the last" in fired.summary or "corrected ECC errors in the last" in fired.headline


@pytest.mark.parametrize("fields", [
    {"pcie_link_width": 64, "pcie_link_width_max": 16}, {"pcie_link_width": 8, "pcie_link_width_max": 999},
    {"pcie_link_width": 0, "pcie_link_width_max": 16}, {"pcie_link_gen": 9, "pcie_link_gen_max": 5},
])
def test_pcie_readings_out_of_any_real_range_are_not_judged(fields: dict) -> None:
    assert health_events(run(with_health(train_then("train", 200), {50: {1: fields}}))) == []


def test_a_program_fault_xid_is_no_gpu_fault() -> None:
    stream = with_health(train_then("train", 400), {100: {2: {"xids": (13,)}}, 200: {2: {"xids": (31, 43)}}})
    assert health_events(run(stream)) == []


@pytest.mark.parametrize(("fields", "words"), [
    ({"ecc_uncorrected": 2}, "2 uncorrected ECC errors"),
    ({"memory_repair_pending": 1, "memory_repair_failed": 0}, "row remap is pending"),
    ({"memory_repair_pending": 0, "memory_repair_failed": 1}, "row remap failed"),
    ({"pcie_link_width": 8, "pcie_link_width_max": 16, "pcie_link_gen": 5, "pcie_link_gen_max": 5}, "x8 of x16"),
    ({"pcie_link_width": 16, "pcie_link_width_max": 16, "pcie_link_gen": 3, "pcie_link_gen_max": 5},
     "Gen3 of Gen5 while busy"),
])
def test_a_standing_fault_warns(fields: dict, words: str) -> None:
    stream = with_health(train_then("train", 300), {50: {1: fields}})
    (fired,) = health_events(run(stream))
    assert fired.gpus == (1,) and words in fired.summary


def test_a_link_that_trains_down_at_idle_is_not_a_fault() -> None:
    stream = with_health(train_then("idle", 600, at=100),
                         {0: {g: {"pcie_link_gen": 5, "pcie_link_gen_max": 5} for g in range(8)},
                          150: {g: {"pcie_link_gen": 1} for g in range(8)}})
    assert health_events(run(stream)) == []


def test_climbing_counters_warn_only_past_their_rise() -> None:
    base = {0: {0: {"ecc_corrected": 10, "nvlink_errors": 0, "pcie_replays": 0}}}
    slow = {**base, **{n: {0: {"ecc_corrected": 10 + n // 60}} for n in range(60, 1800, 60)}}  # +29 in 30 min
    assert health_events(run(with_health(train_then("train", 1800), slow))) == []
    fast = {**base, 600: {0: {"nvlink_errors": 40}}, 630: {0: {"nvlink_errors": 140}}}
    (fired,) = health_events(run(with_health(train_then("train", 900), fast)))
    assert "140 NVLink errors in the last" in fired.summary


def test_a_hang_names_the_xid_its_gpu_reported_before_it() -> None:
    stream = with_health(train_then("spin", 500, at=300), {260: {5: {"xids": (48,)}}})
    events = run(stream)
    (critical,) = [e for e in events if e.signature is Signature.BUSY_SPIN and e.severity is Severity.CRITICAL
                   and e.event is EventKind.FIRED]
    assert "GPU 5 reported Xid 48 (double-bit ECC error" in critical.summary
    assert [e.gpus for e in health_events(events) if e.event is EventKind.FIRED] == [(5,)]
    # without the Xid, the same hang says nothing of it
    assert "Xid" not in next(e for e in run(train_then("spin", 500, at=300)) if e.severity is Severity.CRITICAL).summary


def test_a_tick_at_a_time_and_stretches_agree_on_health() -> None:
    stream = with_health(train_then("spin", 1500, at=1300),
                         {0: {g: {"ecc_corrected": 0, "pcie_replays": 0, "pcie_link_gen": 5, "pcie_link_gen_max": 5,
                                  "pcie_link_width": 16, "pcie_link_width_max": 16} for g in range(8)},
                          200: {2: {"xids": (94,)}}, 400: {6: {"pcie_replays": 500}}, 900: {1: {"pcie_link_width": 8}},
                          1250: {4: {"xids": (79, 45)}}})
    assert_same(Config(), stream)


def test_disabled_it_stays_quiet_but_the_hang_still_names_the_xid() -> None:
    config = parse_config({"detectors": {"gpu_health": {"enabled": False}}})
    events = run(with_health(train_then("spin", 500, at=300), {280: {0: {"xids": (79,)}}}), config)
    assert health_events(events) == []
    assert any("Xid 79" in e.summary for e in events if e.severity is Severity.CRITICAL)


def test_health_readings_survive_a_recording() -> None:
    stream = with_health(train_then("train", 5), {2: {1: {"xids": (79, 48), "ecc_corrected": 3, "pcie_link_gen": 4}}})
    text = io.StringIO()
    recording.write(text, recording.header("test", "2026-11-27T00:00:00Z"), stream)
    back = list(recording.read(io.StringIO(text.getvalue()), "test.jsonl"))
    assert [s.gpus for s in back] == [s.gpus for s in stream]
    assert back[2].gpus[1].xids == (79, 48) and back[4].gpus[1].pcie_link_gen == 4


def two_gpus() -> tuple[list[FakeGpu], FakeNvml, NvmlSource]:
    """Two working GPUs behind the faithful fake of NVML, and the live source open on them (a clock from 1000 s)."""
    gpus = [FakeGpu(util_percent=95, power_mw=600_000, uuid=f"GPU-{n}") for n in range(2)]
    fake = FakeNvml(gpus)
    clock = iter(range(1000, 2000))
    source = NvmlSource(nvml=fake, call_timeout_seconds=1.0, clock=lambda: float(next(clock)))
    source.open()
    return gpus, fake, source


def test_an_xid_read_through_nvml_becomes_a_warning_on_its_gpu() -> None:
    """The faithful fake of NVML: the driver reports Xid 63 on GPU 1 and a pending row remap; the live source
    hands both to the engine as the daemon would."""
    gpus, fake, source = two_gpus()
    engine = DetectorEngine(Config())
    events = []
    try:
        for tick in range(40):
            if tick == 10:
                fake.xid(1, 63)
                gpus[1].remapped_rows = (0, 1, 1, 0)
            events += engine.observe(source.sample())
    finally:
        source.close()
    (fired,) = health_events(events)
    assert fired.gpus == (1,) and f"Xid 63 ({XIDS[63][0]})" in fired.summary
    assert fired.at_seconds == 1010.0


def test_the_built_in_scenario_names_the_xid_in_the_hang_it_comes_before() -> None:
    events = run(list(sim.run(sim.SCENARIOS["xid_then_spin"])))
    assert [e.gpus for e in health_events(events) if e.event is EventKind.FIRED] == [(3,)]
    (critical,) = [e for e in events if e.signature is Signature.BUSY_SPIN and e.event is EventKind.FIRED]
    assert "Before it: GPU 3 reported Xid 48 (double-bit ECC error" in critical.summary


def test_xids_drained_before_the_wait_fails_reach_the_verdict_and_the_failure_is_said_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """The driver queues Xid 48 and 79, then every wait fails (not a timeout): both Xids were dropped with the
    failure, and the failure logged an ERROR every tick."""
    gpus, fake, source = two_gpus()
    engine = DetectorEngine(Config())
    events = []
    try:
        fake.xid(1, 48)
        fake.xid(1, 79)
        for events_set in fake.event_sets:
            events_set.failing = nvml.NVML_ERROR_UNKNOWN
        with caplog.at_level(logging.INFO, logger="stall_watchdog"):
            for _ in range(20):
                events += engine.observe(source.sample())
            for events_set in fake.event_sets:
                events_set.failing = None
            events += engine.observe(source.sample())
    finally:
        source.close()
    (fired,) = health_events(events)
    assert fired.gpus == (1,) and "Xid 48" in fired.headline + fired.summary and "Xid 79" in fired.summary
    said = [r.getMessage() for r in caplog.records]
    assert sum("nvml_xid_read_failed" in line for line in said) == 1, said
    assert sum("nvml_xid_read_recovered" in line for line in said) == 1, said


def test_a_program_faulting_in_a_loop_is_one_log_line_not_thousands(caplog: pytest.LogCaptureFixture) -> None:
    gpus = [FakeGpu(util_percent=95, power_mw=600_000, uuid="GPU-0")]
    fake = FakeNvml(gpus)
    source = NvmlSource(nvml=fake, call_timeout_seconds=1.0)
    source.open()
    try:
        with caplog.at_level(logging.INFO, logger="stall_watchdog"):
            for _ in range(12):
                for _ in range(250):
                    fake.xid(0, 31)
                source.sample()
    finally:
        source.close()
    lines = [r.getMessage() for r in caplog.records if "gpu_xid" in r.getMessage()]
    assert len(lines) == 1 and "xid=31" in lines[0], lines


def test_a_counter_that_goes_back_counts_again_and_an_absurd_reading_counts_for_nothing() -> None:
    """A driver reload puts corrected ECC back at 0; a storm of 500 in the 50 minutes after is warned of (it
    never was: the rise was measured from the old, higher count). One absurd reading is no storm (it was said as
    '99999999994999 corrected ECC errors')."""
    ticks = 3600
    storm = {0: {0: {"ecc_corrected": 5000}}, 300: {0: {"ecc_corrected": 0}}}
    storm.update({300 + n: {0: {"ecc_corrected": n // 6}} for n in range(1, 3001)})  # 500 in 50 minutes
    (fired,) = health_events(run(with_health(train_then("train", ticks), storm)))[:1]
    assert "corrected ECC errors in the last" in fired.summary
    absurd = {0: {0: {"ecc_corrected": 5000}}, 100: {0: {"ecc_corrected": 99_999_999_999_999}},
              101: {0: {"ecc_corrected": 5001}}, 200: {0: {"ecc_corrected": 5003}}}
    assert health_events(run(with_health(train_then("train", 400), absurd))) == []


def test_an_xid_this_version_does_not_know_is_not_blamed_on_the_gpu() -> None:
    stream = with_health(train_then("spin", 500, at=300), {260: {5: {"xids": (109,)}}, 280: {5: {"xids": (777,)}}})
    events = run(stream)
    assert health_events(events) == []
    critical = next(e for e in events if e.signature is Signature.BUSY_SPIN and e.severity is Severity.CRITICAL)
    assert "GPU 5 reported Xid 777 (an Xid this version does not know)" in critical.summary
    assert "Xid 109 (a context switch timed out" in critical.summary


def lost_events(events: list[EpisodeEvent]) -> list[EpisodeEvent]:
    return [e for e in events if e.signature is Signature.GPU_LOST and e.event is not EventKind.SUSPECTED]


def test_one_slow_nvml_call_or_one_lost_cell_is_no_lost_gpu_and_a_lasting_one_is() -> None:
    """Driver lock contention holds one call for seconds: GPU LOST, drain the node, paged critical and resolved
    3 s later (before). A call hung for a minute, or a GPU that stays lost, still pages."""
    from watchdog.vocabulary.model import GpuHealth

    def health(at: int, until: int, state: GpuHealth, ticks: int = 400) -> list[EpisodeEvent]:
        return run(with_health(train_then("train", ticks), {at: {0: {"health": state}},
                                                            until: {0: {"health": GpuHealth.OK}}}))
    assert lost_events(health(100, 103, GpuHealth.HUNG)) == []
    assert lost_events(health(100, 101, GpuHealth.LOST)) == []  # one `[GPU is lost]` cell of a log
    (hung,) = [e for e in lost_events(health(100, 200, GpuHealth.HUNG)) if e.event is EventKind.FIRED]
    assert hung.severity is Severity.CRITICAL and 129 <= hung.at_seconds - train_then("train", 1)[0].time_seconds <= 131
    (lost,) = [e for e in lost_events(health(100, 200, GpuHealth.LOST)) if e.event is EventKind.FIRED]
    assert 109 <= lost.at_seconds - train_then("train", 1)[0].time_seconds <= 111
