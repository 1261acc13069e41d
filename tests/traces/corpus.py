"""A labelled corpus of nvidia-smi logs, generated: healthy runs and hangs of many shapes, on many GPU
models, column sets and sampling intervals, with sensor noise. The accuracy benchmark (bench/accuracy.py)
replays it through the detectors; a few fixed traces of it are tests (tests/detect/test_corpus.py).

Every trace says what a person would call it: healthy, or a hang of a known kind that starts at a known
time (and, for an odd GPU, which one). The numbers are what real GPUs show where the real logs say so
(../shared/realdata: an H100 spinning in NCCL at 110-160 W of 700 W, a T4 at 41 W of 70 W, a checkpoint
writer at 0-7% util while the others spin); the rest are plausible ranges, drawn per trace, so that no
threshold is tuned to one value.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from tests.traces import perturb
from watchdog.vocabulary.model import GpuSample, NodeSnapshot

GiB = 2**30


@dataclass(frozen=True)
class Model:
    name: str
    limit: float  # enforced power limit, W
    idle: float  # no context (P8)
    held: float  # context and memory held, no kernel
    busy: float  # mean power of a training step
    spin: float  # one NCCL kernel spinning on a flag
    noise: float  # sensor noise, +- W (uniform)
    memory: int
    clock_max: float


MODELS = {
    "h100": Model("NVIDIA H100 80GB HBM3", 700, 70, 115, 560, 150, 3, 80 * GiB, 1980e6),
    "a100": Model("NVIDIA A100-SXM4-80GB", 400, 55, 85, 330, 95, 3, 80 * GiB, 1410e6),
    "h20": Model("NVIDIA H20", 500, 60, 100, 400, 135, 3, 96 * GiB, 1980e6),
    "l20": Model("NVIDIA L20", 350, 35, 75, 280, 150, 4, 48 * GiB, 2520e6),
    "a6000": Model("NVIDIA RTX A6000", 300, 25, 70, 260, 165, 4, 48 * GiB, 2100e6),
    "v100": Model("Tesla V100-SXM2-32GB", 300, 40, 55, 250, 72, 2, 32 * GiB, 1530e6),
    "t4": Model("Tesla T4", 70, 18, 27, 64, 41, 4, 15 * GiB, 1590e6),
}
LOW_RANGE = ("t4", "a6000", "l20")  # spin at 55-70% of busy power: power alone barely tells

COLUMNS = {
    "full": ("utilization_ratio", "memory_utilization_ratio", "power_watts", "power_limit_watts", "sm_clock_hertz",
             "sm_clock_max_hertz", "memory_used_bytes", "memory_total_bytes", "temperature_celsius",
             "clock_event_reasons"),
    "standard": ("utilization_ratio", "memory_utilization_ratio", "power_watts", "power_limit_watts",
                 "memory_used_bytes", "memory_total_bytes"),
    "minimal": ("utilization_ratio", "power_watts", "memory_used_bytes"),  # timestamp,index,util,power,mem.used
}

Reading = dict[str, float]
Behaviour = Callable[[random.Random, Model, float, dict[str, float]], Reading]


def _train(rng: random.Random, m: Model, t: float, p: dict[str, float]) -> Reading:
    if int(t) % int(p["dip_every"]) == 0 and rng.random() < 0.7:  # an input-pipeline dip
        return {"util": rng.uniform(0.3, 0.85), "power": m.busy * rng.uniform(0.45, 0.7), "mem_util": 0.1,
                "cpu": rng.uniform(0.5, 1.0)}
    if rng.random() < p["pinned"]:
        util = 1.0
    else:  # real training wanders between 80% and 99%, its power with it
        util = rng.uniform(0.80, 0.99) if rng.random() < p["wander"] else rng.uniform(0.93, 0.99)
    power = m.busy * p["level"] * rng.uniform(0.9, 1.1) * (0.75 + 0.25 * util)
    return {"util": util, "power": power, "mem_util": rng.uniform(0.2, 0.6), "cpu": rng.uniform(0.8, 1.0)}


def _tp_batch1(rng: random.Random, m: Model, t: float, p: dict[str, float]) -> Reading:
    return {"util": rng.choice((0.95, 0.96, 0.97, 0.98, 0.99)), "power": m.limit * rng.uniform(0.27, 0.35),
            "mem_util": rng.uniform(0.1, 0.3), "cpu": rng.uniform(0.6, 1.0)}


def _evaluate(rng: random.Random, m: Model, t: float, p: dict[str, float]) -> Reading:
    return {"util": rng.uniform(0.4, 0.92), "power": m.busy * rng.uniform(0.4, 0.7), "mem_util": rng.uniform(0.1, 0.4),
            "cpu": rng.uniform(0.5, 1.0)}


def _spin(rng: random.Random, m: Model, t: float, p: dict[str, float]) -> Reading:
    # The rank's host thread waits in a CUDA synchronize, which spins on a core by default.
    return {"util": 1.0, "power": m.spin * p["spin_level"] + p["offset"], "mem_util": 0.0,
            "cpu": rng.uniform(0.9, 1.0)}


def _zero(rng: random.Random, m: Model, t: float, p: dict[str, float]) -> Reading:
    """A hang with nothing moving: the GPU idle with memory held, the rank blocked on the host."""
    return {"util": 0.0, "power": m.held * p["held_level"], "mem_util": 0.0, "cpu": rng.uniform(0.0, 0.03)}


def _pause(rng: random.Random, m: Model, t: float, p: dict[str, float]) -> Reading:
    """A healthy pause on the GPU (every rank writes its shard of a checkpoint, loads data): busy on the host."""
    return {"util": 0.0, "power": m.held * p["held_level"], "mem_util": 0.0, "cpu": rng.uniform(0.2, 0.9),
            "io": rng.uniform(2e7, 8e8)}


def _writer(rng: random.Random, m: Model, t: float, p: dict[str, float]) -> Reading:
    return {"util": rng.choice((0.0, 0.0, 0.01, 0.04, 0.07)), "power": m.held * 1.15, "mem_util": rng.uniform(0, 0.04),
            "cpu": rng.uniform(0.3, 0.9), "io": rng.uniform(5e7, 1e9)}


def _startup(rng: random.Random, m: Model, t: float, p: dict[str, float]) -> Reading:
    return {"util": 0.0, "power": m.held, "mem_util": 0.0, "mem": min(p["mem"], 0.01 + t * p["load_rate"]),
            "cpu": rng.uniform(0.5, 1.0), "io": rng.uniform(1e7, 5e8)}


BEHAVIOURS: dict[str, Behaviour] = {"train": _train, "tp_batch1": _tp_batch1, "evaluate": _evaluate, "spin": _spin,
                                    "zero": _zero, "pause": _pause, "writer": _writer, "startup": _startup}


@dataclass
class Trace:
    name: str
    cls: str
    model: str
    columns: str
    interval: float
    duration: float
    seed: int
    gpus: int
    segments: list[tuple[float, tuple[int, ...] | None, str]] = field(default_factory=list)  # later ones win
    hang_at: float | None = None
    expect: str | None = None  # "spin" | "odd" | "zero" | None (healthy)
    culprits: tuple[int, ...] = ()
    power: dict[str, float] = field(default_factory=dict)  # the card's power levels as perturbed (Model fields)

    @property
    def healthy_seconds(self) -> float:
        return self.hang_at if self.hang_at is not None else self.duration


def snapshots(trace: Trace, start: float = 1.9e9, live: bool = False, messy: bool = True) -> Iterator[NodeSnapshot]:
    """The trace as nvidia-smi would have logged it: only its column set, noisy sensors, idle GPUs with
    sparse 1-4% blips; `messy` adds the mild mix of tests/traces/perturb.py (dropped samples and rows, [N/A],
    jitter). `live` adds the host progress the daemon reads for each GPU's processes (CPU and I/O)."""
    stream = _clean(trace, start, live)
    return perturb.apply(stream, DEFAULT_MESS, trace.seed, 0) if messy else stream


DEFAULT_MESS = ("drops", "rows", "na", "jitter")


def _clean(trace: Trace, start: float, live: bool) -> Iterator[NodeSnapshot]:
    rng = random.Random(trace.seed)
    m = replace(MODELS[trace.model], **trace.power)
    keep = set(COLUMNS[trace.columns])
    if live:
        keep |= {"host_cpu_ratio", "host_io_bytes_per_second"}
    gpu_params = [_gpu_params(rng) for _ in range(trace.gpus)]
    if trace.cls == "hang_spin_uneven":  # power differs by GPU by 10-20 W, as at start-up
        for n, p in enumerate(gpu_params):
            p["offset"] = (n % 3) * rng.uniform(5, 10)
    steps = int(trace.duration / trace.interval)
    for step in range(steps + 1):
        t = step * trace.interval
        gpus = []
        for index in range(trace.gpus):
            behaviour, since = _behaviour_at(trace, index, t)
            p = gpu_params[index]
            r = BEHAVIOURS[behaviour](rng, m, t - since, p)
            gpus.append(_sample(index, m, r, p, keep, rng))
        yield NodeSnapshot(start + t, tuple(gpus))


def _gpu_params(rng: random.Random) -> dict[str, float]:
    return {"level": rng.uniform(0.9, 1.05), "pinned": rng.uniform(0.3, 0.8), "dip_every": rng.choice((20, 30, 45)),
            "wander": rng.uniform(0.2, 0.8), "blip": rng.uniform(0.0, 0.06),
            "spin_level": rng.uniform(0.9, 1.1), "held_level": rng.uniform(0.95, 1.1), "offset": 0.0,
            "mem": rng.uniform(0.5, 0.9), "load_rate": rng.uniform(0.005, 0.02)}


def _behaviour_at(trace: Trace, gpu: int, t: float) -> tuple[str, float]:
    name, since = "train", 0.0
    for start, gpus, behaviour in trace.segments:
        if start <= t and (gpus is None or gpu in gpus):
            name, since = behaviour, start
    return name, since


def _sample(index: int, m: Model, r: Reading, p: dict[str, float], keep: set[str], rng: random.Random
            ) -> GpuSample:
    util = max(0.0, min(1.0, r["util"]))
    if util == 0.0 and rng.random() < p["blip"]:  # an idle GPU with a context reads 1-4% now and then
        util = rng.choice((0.01, 0.02, 0.03, 0.04))
    power = max(1.0, r["power"] + rng.uniform(-m.noise, m.noise))
    mem = r.get("mem", p["mem"])
    values: dict[str, object] = {
        "utilization_ratio": round(util, 2), "memory_utilization_ratio": round(r["mem_util"], 2),
        "power_watts": round(power, 2), "power_limit_watts": m.limit,
        "sm_clock_hertz": m.clock_max if util > 0 else 345e6, "sm_clock_max_hertz": m.clock_max,
        "memory_used_bytes": int(mem * m.memory), "memory_total_bytes": m.memory,
        "temperature_celsius": 35.0 + 40 * util, "clock_event_reasons": 0 if util > 0 else 1,
        "host_cpu_ratio": round(r["cpu"], 3), "host_io_bytes_per_second": round(r.get("io", rng.uniform(0, 2e4))),
    }
    return GpuSample(index=index, name=m.name, **{k: v for k, v in values.items() if k in keep})  # type: ignore[arg-type]


# -- the corpus ----------------------------------------------------------------------------------------
HEALTHY = ("healthy_train", "checkpoint_all_zero", "checkpoint_rank0", "checkpoint_sharded", "checkpoint_heavy",
           "evaluation", "startup_slow", "tp_batch1")
HANGS = ("hang_spin", "hang_spin_uneven", "hang_spin_startup", "hang_spin_low_range", "hang_odd", "hang_zero")


def _checkpoints(rng: random.Random, trace: Trace, shape: str, first: float, until: float) -> None:
    """Recurring pauses every 10-30 min from `first` (a fixed step count, so a steady rhythm with a little
    drift), each 30 s to 4 min long, until `until`."""
    every = rng.uniform(600, 1800)
    length = rng.uniform(30, 240)
    t = first + every * rng.uniform(0.97, 1.03)  # every N steps from the start of training
    half = tuple(range(trace.gpus // 2))
    while t + length < until:
        this = length * rng.uniform(0.8, 1.1)
        if shape == "all_zero":
            trace.segments.append((t, None, "pause"))
        elif shape == "rank0":
            trace.segments += [(t, None, "spin"), (t, (0,), "writer")]
        elif shape == "sharded":
            trace.segments += [(t, None, "spin"), (t, half, "writer")]
        elif shape == "evaluation":
            trace.segments.append((t, None, "evaluate"))
        trace.segments.append((t + this, None, "train"))
        t += every * rng.uniform(0.97, 1.03)


def _heavy(rng: random.Random, trace: Trace, first: float, until: float) -> None:
    """A checkpoint after roughly every other 2-7 minute stretch of training, evaluations between: each
    checkpoint of this job about as long as the others (20 s to 4 min across jobs), of one shape."""
    shape = rng.choice(("all_zero", "rank0", "sharded"))
    length = rng.uniform(20, 240)
    half = tuple(range(trace.gpus // 2))
    t = first
    while True:
        t += rng.uniform(120, 420)
        roll = rng.random()
        if roll < 0.5:
            this = length * rng.uniform(0.8, 1.2)
            if t + this >= until:
                return
            if shape == "all_zero":
                trace.segments.append((t, None, "pause"))
            elif shape == "rank0":
                trace.segments += [(t, None, "spin"), (t, (0,), "writer")]
            else:
                trace.segments += [(t, None, "spin"), (t, half, "writer")]
        elif roll < 0.75:
            this = rng.uniform(30, 120)
            if t + this >= until:
                return
            trace.segments.append((t, None, "evaluate"))
        else:
            continue
        trace.segments.append((t + this, None, "train"))
        t += this


def make(cls: str, seed: int) -> Trace:
    rng = random.Random(f"{cls}:{seed}")
    hang = cls in HANGS
    model = rng.choice(LOW_RANGE) if cls == "hang_spin_low_range" else rng.choice(
        [m for m in MODELS if m not in LOW_RANGE or cls not in ("hang_spin", "hang_spin_uneven")])
    columns = rng.choice(list(COLUMNS))
    interval = rng.choice((0.1, 1.0, 1.0, 2.0, 5.0, 10.0))
    long_run = interval >= 1.0
    gpus = rng.choice((4, 8, 8))
    duration = rng.uniform(3600, 3 * 3600) if long_run else rng.uniform(1500, 2400)
    if cls == "checkpoint_heavy" and long_run:
        duration = rng.uniform(2 * 3600, 5 * 3600)
    trace = Trace(f"{cls}-{seed}", cls, model, columns, interval, duration, rng.randrange(2**31), gpus)
    startup = rng.uniform(60, 150)
    if cls != "hang_spin_low_range":  # that one is logged from the middle of training: never seen idle
        trace.segments.append((0.0, None, "startup"))
    trace.segments.append((startup, None, "tp_batch1" if cls == "tp_batch1" else "train"))
    if cls == "startup_slow":
        trace.segments += [(startup, None, "pause"), (startup + rng.uniform(60, 180), None, "train")]
    if hang:
        trace.hang_at = startup + 20 if cls == "hang_spin_startup" else rng.uniform(0.4, 0.8) * duration
        trace.duration = trace.hang_at + 900
    shape = {"checkpoint_all_zero": "all_zero", "checkpoint_rank0": "rank0", "checkpoint_sharded": "sharded",
             "evaluation": "evaluation", "checkpoint_heavy": "heavy"}.get(cls) or rng.choice(
        ("all_zero", "rank0", "sharded", "heavy", "none"))
    if shape == "heavy" and cls not in ("tp_batch1", "hang_spin_startup", "startup_slow"):
        _heavy(rng, trace, startup, trace.hang_at or trace.duration)
    elif shape != "none" and cls not in ("tp_batch1", "hang_spin_startup", "startup_slow"):
        _checkpoints(rng, trace, shape, startup, trace.hang_at or trace.duration)
    if hang:
        at = trace.hang_at
        assert at is not None
        if cls in ("hang_spin", "hang_spin_uneven", "hang_spin_startup", "hang_spin_low_range"):
            trace.segments.append((at, None, "spin"))
            trace.expect = "spin"
        elif cls == "hang_odd":
            odd = rng.randrange(gpus)
            trace.segments += [(at, None, "spin"), (at, (odd,), "zero")]
            trace.expect, trace.culprits = "odd", (odd,)
        else:
            trace.segments.append((at, None, "zero"))
            trace.expect = "zero"
    return trace


def on_card(cls: str, seed: int, card: str, interval: float, columns: str, power: dict[str, float]) -> Trace:
    """A trace of `cls` on this card, sampled at this interval with these columns, its power levels perturbed
    (`power`: Model fields, e.g. the spin's watts): the spin matrix of bench/accuracy.py --spins."""
    trace = make(cls, seed)
    trace.name = f"{trace.name}-{card}-{interval:g}s-{columns}"
    trace.model, trace.interval, trace.columns, trace.power = card, interval, columns, power
    return trace


def corpus(per_class: int = 12, classes: tuple[str, ...] = HEALTHY + HANGS) -> list[Trace]:
    return [make(cls, seed) for cls in classes for seed in range(per_class)]
