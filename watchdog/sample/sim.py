"""Scripted scenarios: a simulated node whose GPUs follow a timeline of behaviours.

For tests and the demo. The numbers are what real GPUs show (see ../shared/realdata): an H100 spinning
in NCCL draws 110-160 W of 700 W, a V100 65-78 W of 300 W, a T4 41 W of 70 W; a checkpoint writer on
GPU 0 sits near 0-7% util while the other ranks spin (the real ckpt1.csv log).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from watchdog.vocabulary.model import (
    CLOCK_EVENT_HW_SLOWDOWN,
    CLOCK_EVENT_HW_THERMAL,
    GpuHealth,
    GpuSample,
    NodeSnapshot,
)

GiB = 2**30


@dataclass(frozen=True)
class GpuModel:
    name: str
    power_limit_watts: float
    idle_watts: float  # no job (P8)
    held_idle_watts: float  # a context and memory held, no kernel (P0)
    busy_watts: float  # training step, mean
    spin_watts: float  # one NCCL kernel spinning
    memory_total_bytes: int
    sm_clock_max_hertz: float


MODELS: dict[str, GpuModel] = {
    "h100": GpuModel("NVIDIA H100 80GB HBM3", 700, 72, 120, 560, 150, 80 * GiB, 1980e6),
    "v100": GpuModel("Tesla V100-SXM2-32GB", 300, 40, 55, 250, 70, 32 * GiB, 1530e6),
    "t4": GpuModel("Tesla T4", 70, 20, 27, 66, 41, 15 * GiB, 1590e6),
    "a100-pcie": GpuModel("NVIDIA A100-PCIE-40GB", 250, 35, 50, 220, 60, 40 * GiB, 1410e6),
}

# A behaviour draws one sample: (rng, model, seconds into this behaviour) -> reading fields
Behaviour = Callable[[random.Random, GpuModel, float], dict[str, object]]


def _train(rng: random.Random, m: GpuModel, t: float) -> dict[str, object]:
    # Steps with a short input-pipeline dip every ~30 s.
    if int(t) % 30 == 29:
        return {"util": rng.uniform(0.5, 0.8), "power": m.busy_watts * 0.55, "mem_util": 0.1, "mem": 0.7}
    return {"util": rng.choice((0.97, 0.98, 0.99, 1.0)), "power": m.busy_watts * rng.uniform(0.92, 1.08),
            "mem_util": rng.uniform(0.3, 0.6), "mem": 0.7}


def _tp_small_batch(rng: random.Random, m: GpuModel, t: float) -> dict[str, object]:
    # Tensor parallel at batch 1 (libai-528: 97-99% util at 73-86 W of 250 W): looks like a spin on
    # power alone, but moves memory and never pins at 100%.
    return {"util": rng.choice((0.95, 0.96, 0.97, 0.98, 0.99)), "power": rng.uniform(70, 90),
            "mem_util": rng.uniform(0.12, 0.3), "mem": 0.3}


def _spin(rng: random.Random, m: GpuModel, t: float) -> dict[str, object]:
    return {"util": 1.0, "power": m.spin_watts + rng.uniform(-2, 2), "mem_util": 0.0, "mem": 0.7,
            "sm_activity": 0.01}


def _zero(rng: random.Random, m: GpuModel, t: float) -> dict[str, object]:
    return {"util": 0.0, "power": m.held_idle_watts + rng.uniform(-2, 2), "mem_util": 0.0, "mem": 0.7}


def _checkpoint_writer(rng: random.Random, m: GpuModel, t: float) -> dict[str, object]:
    return {"util": rng.choice((0.0, 0.01, 0.04, 0.07)), "power": m.held_idle_watts * 1.15,
            "mem_util": rng.uniform(0.0, 0.05), "mem": 0.7}


def _startup(rng: random.Random, m: GpuModel, t: float) -> dict[str, object]:
    # Context created, then the model loads: memory grows, util ~0.
    return {"util": 0.0, "power": m.held_idle_watts, "mem_util": 0.0, "mem": min(0.7, 0.006 + t * 0.02)}


def _idle(rng: random.Random, m: GpuModel, t: float) -> dict[str, object]:
    return {"util": 0.0, "power": m.idle_watts + rng.uniform(-1, 1), "mem_util": 0.0, "mem": 0.0}


def _underuse(rng: random.Random, m: GpuModel, t: float) -> dict[str, object]:
    return {"util": rng.uniform(0.3, 0.4), "power": m.busy_watts * 0.45 * rng.uniform(0.9, 1.1),
            "mem_util": rng.uniform(0.05, 0.15), "mem": 0.7}


def _throttle(rng: random.Random, m: GpuModel, t: float) -> dict[str, object]:
    sample = _train(rng, m, t)
    sample.update(clock=0.6, reasons=CLOCK_EVENT_HW_THERMAL, temp=92.0)
    return sample


def _slow(rng: random.Random, m: GpuModel, t: float) -> dict[str, object]:
    # Training with its SM clock held 15% down by a hardware slowdown: every step of the job waits for it.
    sample = _train(rng, m, t)
    power = float(sample["power"])  # type: ignore[arg-type]
    sample.update(clock=0.85, reasons=CLOCK_EVENT_HW_SLOWDOWN, power=power * 0.9)
    return sample


def _waiting_on_slow(rng: random.Random, m: GpuModel, t: float) -> dict[str, object]:
    # The slow GPU's peers: they finish each step early and wait in the collective for it (fewer SMs busy).
    sample = _train(rng, m, t)
    power, util = float(sample["power"]), float(sample["util"])  # type: ignore[arg-type]
    sample.update(power=power * 0.9, sm_activity=util * 0.8 * 0.85)
    return sample


def _double_bit_ecc(rng: random.Random, m: GpuModel, t: float) -> dict[str, object]:
    # Training on, after the driver reports Xid 48 (a double-bit ECC error) once; the error count stays.
    sample = _train(rng, m, t)
    sample.update(xids=(48,) if t < 1 else (), ecc_uncorrected=1)
    return sample


def _lost(rng: random.Random, m: GpuModel, t: float) -> dict[str, object]:
    return {"lost": True}


BEHAVIOURS: dict[str, Behaviour] = {
    "idle": _idle, "startup": _startup, "train": _train, "tp_small_batch": _tp_small_batch, "spin": _spin,
    "zero": _zero, "checkpoint_writer": _checkpoint_writer, "underuse": _underuse, "throttle": _throttle,
    "slow": _slow, "waiting_on_slow": _waiting_on_slow, "double_bit_ecc": _double_bit_ecc, "lost": _lost,
}


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    model: str
    gpus: int
    duration_seconds: int
    # (start second, GPUs or None for all, behaviour); later entries override earlier ones
    timeline: tuple[tuple[int, tuple[int, ...] | None, str], ...]
    expect: str = ""  # what the detectors should say, for the docs and tests
    gpm: bool = field(default=False)  # the model exposes GPM SM activity (Hopper)


def _h100(name: str, description: str, duration: int, timeline: tuple[tuple[int, tuple[int, ...] | None, str], ...],
          expect: str) -> Scenario:
    return Scenario(name, description, "h100", 8, duration, timeline, expect, gpm=True)


_WARMUP: tuple[tuple[int, tuple[int, ...] | None, str], ...] = ((0, None, "startup"), (40, None, "train"))

SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    _h100("healthy", "8xH100 training with input-pipeline dips", 1200, _WARMUP, "no episode"),
    _h100("checkpoint", "rank 0 saves for 150 s while the others wait; later every rank pauses 30 s", 1200,
          _WARMUP + ((300, (0,), "checkpoint_writer"), (300, tuple(range(1, 8)), "spin"), (450, None, "train"),
                     (700, None, "zero"), (730, None, "train")),
          "one waiting warning naming GPU 0, resolved; no critical"),
    _h100("spin_hang", "all 8 GPUs spin in a collective from t=300 s", 900,
          _WARMUP + ((300, None, "spin"),), "busy_spin critical within a minute of t=300 s"),
    _h100("startup_spin", "hangs before its first step at 100% util (no busy level yet)", 600,
          ((0, None, "startup"), (40, None, "spin")), "busy_spin critical within a minute of t=40 s"),
    _h100("zero_util_hang", "all 8 GPUs idle with memory held from t=300 s", 1200,
          _WARMUP + ((300, None, "zero"),),
          "zero_util warning within a minute of t=300 s; critical by t=900 s on telemetry alone, within a "
          "minute when the ranks are seen still"),
    _h100("odd_rank", "rank 4 stuck in its data loader from t=300 s while the other 7 spin", 1500,
          _WARMUP + ((300, (4,), "zero"), (300, (0, 1, 2, 3, 5, 6, 7), "spin")),
          "waiting warning naming GPU 4 within a minute, critical after 900 s of unbroken wait"),
    Scenario("underuse", "8xA100 fine-tune at 30-40% util for 3 hours", "a100-pcie", 8, 3 * 3600,
             ((0, None, "startup"), (40, None, "underuse")), "underuse warnings after 30 min"),
    _h100("throttle", "GPU 2 thermally throttled from t=300 s for 5 min", 900,
          _WARMUP + ((300, (2,), "throttle"), (600, (2,), "train")),
          "one straggler warning on GPU 2 (throttled below its working peers), resolved"),
    _h100("straggler", "GPU 5's SM clock held 15% down by a hardware slowdown from t=300 s; every step waits for it",
          900, _WARMUP + ((300, (5,), "slow"), (300, (0, 1, 2, 3, 4, 6, 7), "waiting_on_slow")),
          "one straggler warning on GPU 5, the job about 1.18x slower"),
    _h100("xid_then_spin", "GPU 3 reports Xid 48 (double-bit ECC) at t=240 s; every GPU spins from t=300 s", 600,
          _WARMUP + ((240, (3,), "double_bit_ecc"), (300, None, "spin")),
          "gpu_health warning on GPU 3 at once; the busy_spin hang's verdict names the Xid 60 s before it"),
    _h100("gpu_lost", "GPU 5 falls off the bus at t=300 s; the others then spin on a collective it cannot join", 900,
          _WARMUP + ((300, (5,), "lost"), (300, (0, 1, 2, 3, 4, 6, 7), "spin")),
          "gpu_lost critical on GPU 5 at once; busy_spin critical on the others, naming GPU 5 lost"),
    Scenario("tp_small_batch", "8xA100 tensor-parallel at batch 1: high util at ~30% of the power cap",
             "a100-pcie", 8, 1200, ((0, None, "startup"), (40, None, "tp_small_batch")), "no episode"),
    Scenario("t4_spin", "4xT4 stuck at the start of training at 41 W of 70 W", "t4", 4, 600,
             ((0, None, "idle"), (60, None, "startup"), (100, None, "spin")),
             "busy_spin critical within a minute of t=100 s"),
)}


def _behaviour_at(s: Scenario, gpu: int, t: float) -> tuple[str, float]:
    name, since = "idle", 0.0
    for start, gpus, behaviour in s.timeline:
        if start <= t and (gpus is None or gpu in gpus) and start >= since:
            name, since = behaviour, float(start)
    return name, since


def snapshot_at(scenario: Scenario, t: float, rng: random.Random, stamp: float,
                pids: Mapping[int, Sequence[int]] | None = None) -> NodeSnapshot:
    """The node `t` seconds into the scenario (its last behaviours hold past its end), stamped `stamp`."""
    m = MODELS[scenario.model]
    gpus = []
    for index in range(scenario.gpus):
        name, since = _behaviour_at(scenario, index, t)
        own = tuple(pids.get(index, ())) if pids is not None else None
        gpus.append(_sample(index, m, BEHAVIOURS[name](rng, m, t - since), scenario.gpm, own))
    return NodeSnapshot(stamp, tuple(gpus))


def run(scenario: Scenario, start_seconds: float = 1_767_225_600.0, interval_seconds: float = 1.0,
        seed: int = 0) -> Iterator[NodeSnapshot]:
    """Snapshots every interval_seconds of simulated time, deterministic for a seed."""
    rng = random.Random(seed)
    steps = int(scenario.duration_seconds / interval_seconds)
    for step in range(steps + 1):
        t = step * interval_seconds
        yield snapshot_at(scenario, t, rng, start_seconds + t)


class SimSource:
    """A scenario played in real time, for `run` without GPUs: each sample() is the scenario's next
    interval, stamped with the wall clock. `pids` puts real processes on simulated GPUs."""

    driver_version: str | None = "simulated"

    def __init__(self, scenario: Scenario, interval_seconds: float = 1.0, start_offset_seconds: float = 0.0,
                 pids: Mapping[int, Sequence[int]] | None = None, clock: Callable[[], float] = time.time,
                 seed: int = 0):
        self.scenario = scenario
        self.interval = interval_seconds
        self.t = start_offset_seconds
        self.pids = pids if pids is not None else {}  # live: no made-up pids that could name a real process
        self.clock = clock
        self.rng = random.Random(seed)

    @property
    def gpu_count(self) -> int:
        return self.scenario.gpus

    def open(self) -> None:
        return None

    def close(self) -> None:
        return None

    def sample(self) -> NodeSnapshot:
        snapshot = snapshot_at(self.scenario, self.t, self.rng, self.clock(), self.pids)
        self.t += self.interval
        return snapshot


def _sample(index: int, m: GpuModel, r: dict[str, object], gpm: bool, pids: tuple[int, ...] | None) -> GpuSample:
    uuid = f"GPU-{index:08x}-5157-4a1e-9d7c-000000000000"
    if r.get("lost"):
        return GpuSample(index=index, uuid=uuid, name=m.name, health=GpuHealth.LOST,
                         errors=(("utilization_ratio", "GPU is lost"),))
    mem_fraction = float(r["mem"])  # type: ignore[arg-type]
    used = int(mem_fraction * m.memory_total_bytes)
    clock_ratio = float(r.get("clock", 1.0))  # type: ignore[arg-type]
    util = float(r["util"])  # type: ignore[arg-type]
    return GpuSample(
        index=index, uuid=uuid, name=m.name,
        utilization_ratio=round(util, 2),
        memory_utilization_ratio=round(float(r["mem_util"]), 2),  # type: ignore[arg-type]
        power_watts=round(float(r["power"]), 2),  # type: ignore[arg-type]
        power_limit_watts=m.power_limit_watts,
        sm_clock_hertz=(m.sm_clock_max_hertz * clock_ratio) if util > 0 else 345e6,
        sm_clock_max_hertz=m.sm_clock_max_hertz,
        memory_used_bytes=used, memory_total_bytes=m.memory_total_bytes,
        temperature_celsius=float(r.get("temp", 40.0 + 30 * util)),  # type: ignore[arg-type]
        clock_event_reasons=int(r.get("reasons", 0)),  # type: ignore[call-overload]
        sm_activity_ratio=(float(r.get("sm_activity", util * 0.8)) if gpm else None),  # type: ignore[arg-type]
        pids=pids if pids is not None else ((1000 + index,) if used else ()),
        # Health counters as a datacenter GPU reports them: nothing wrong, the PCIe link trained down at idle.
        xids=r.get("xids", ()),  # type: ignore[arg-type]
        ecc_corrected=0, ecc_uncorrected=int(r.get("ecc_uncorrected", 0)),  # type: ignore[call-overload]
        memory_repair_pending=0, memory_repair_failed=0, nvlink_errors=0, pcie_replays=0,
        pcie_link_gen=4 if util > 0 else 1, pcie_link_gen_max=4, pcie_link_width=16, pcie_link_width_max=16,
    )
