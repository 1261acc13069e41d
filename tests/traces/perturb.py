"""Perturbations of a labelled trace that do not change what a person would call it: the mess of real
nvidia-smi logs (../shared/realdata and the logs users send). Each takes a stream of snapshots, a seeded
random source and a strength (0 mild, 1 medium, 2 strong) and yields the stream as a messier log would
have shown it. bench/accuracy.py --perturb replays the corpus and the real logs through each of them,
alone and combined; tests/traces/corpus.py applies a mild mix by default.

    blips        an idle GPU (0%) reads 1-4% on a few percent of its samples, each GPU on its own
    drops        whole samples missing (nvidia-smi stalled, the logger was slow)
    rows         one GPU's row missing from a sample
    na           a reading is [N/A] (utilization, power or memory)
    jitter       each sample's time off by a fraction of the interval (per-row timestamps, a busy host)
    power_noise  +- a few watts on every power reading
    wander       training utilization wandering between 80% and 99% (a sample of real work, not pinned)
    slow         sampled every 5 s or 10 s instead (nvidia-smi -l 5, -l 10)
    levels       each GPU draws 8-25% more or less power than its model does, the whole trace through (units of
                 one model differ by silicon, cooling and firmware): its idle, work and spin all move together
    cap          a power cap below what the work draws (nvidia-smi -pl at 70-90% of the trace's highest reading):
                 readings above it sit just under it, the limit reads the cap and the software power cap is
                 set; a spin's draw becomes a larger share of the work's and of the limit
    dst          the wall clock jumps an hour forward at a random sample (spring DST on a local-time log)
    ntp          the wall clock steps forward 2-15 minutes at one or more random samples (NTP, a resumed VM)
    day_off      a few single samples stamped a day ahead or behind
    writers      a second writer appends the same samples a few seconds behind (two nvidia-smi on one file)
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator

from watchdog.vocabulary.model import GpuSample, NodeSnapshot

Perturbation = Callable[[Iterable[NodeSnapshot], random.Random, int], Iterator[NodeSnapshot]]


def _per_gpu(stream: Iterable[NodeSnapshot], change: Callable[[GpuSample], GpuSample]) -> Iterator[NodeSnapshot]:
    for snap in stream:
        yield NodeSnapshot(snap.time_seconds, tuple(change(g) for g in snap.gpus))


def blips(stream: Iterable[NodeSnapshot], rng: random.Random, strength: int) -> Iterator[NodeSnapshot]:
    rate = (0.03, 0.06, 0.12)[strength]

    def change(g: GpuSample) -> GpuSample:
        if g.utilization_ratio == 0.0 and rng.random() < rate:
            return g._replace(utilization_ratio=rng.choice((0.01, 0.02, 0.03, 0.04)))
        return g
    return _per_gpu(stream, change)


def drops(stream: Iterable[NodeSnapshot], rng: random.Random, strength: int) -> Iterator[NodeSnapshot]:
    rate = (0.01, 0.05, 0.15)[strength]
    return (snap for snap in stream if rng.random() >= rate)


def rows(stream: Iterable[NodeSnapshot], rng: random.Random, strength: int) -> Iterator[NodeSnapshot]:
    rate = (0.005, 0.02, 0.06)[strength]
    for snap in stream:
        if len(snap.gpus) > 1 and rng.random() < rate:
            gone = rng.randrange(len(snap.gpus))
            snap = NodeSnapshot(snap.time_seconds, tuple(g for n, g in enumerate(snap.gpus) if n != gone))
        yield snap


def na(stream: Iterable[NodeSnapshot], rng: random.Random, strength: int) -> Iterator[NodeSnapshot]:
    rate = (0.003, 0.01, 0.04)[strength]
    fields = ("utilization_ratio", "power_watts", "memory_used_bytes")

    def change(g: GpuSample) -> GpuSample:
        if rng.random() < rate:
            return g._replace(**{rng.choice(fields): None})
        return g
    return _per_gpu(stream, change)


def jitter(stream: Iterable[NodeSnapshot], rng: random.Random, strength: int) -> Iterator[NodeSnapshot]:
    share = (0.05, 0.2, 0.4)[strength]
    last: float | None = None
    for snap in stream:
        if last is not None:
            step = snap.time_seconds - last
            last = snap.time_seconds
            snap = NodeSnapshot(snap.time_seconds + rng.uniform(-share, share) * step, snap.gpus)
        else:
            last = snap.time_seconds
        yield snap


def power_noise(stream: Iterable[NodeSnapshot], rng: random.Random, strength: int) -> Iterator[NodeSnapshot]:
    watts = (3.0, 5.0, 8.0)[strength]

    def change(g: GpuSample) -> GpuSample:
        if g.power_watts is None:
            return g
        return g._replace(power_watts=round(max(1.0, g.power_watts + rng.uniform(-watts, watts)), 2))
    return _per_gpu(stream, change)


def wander(stream: Iterable[NodeSnapshot], rng: random.Random, strength: int) -> Iterator[NodeSnapshot]:
    """Utilization of real work (not pinned at 100%, at 90% or more) redrawn between 80% and 99%."""
    low = (0.9, 0.85, 0.8)[strength]

    def change(g: GpuSample) -> GpuSample:
        u = g.utilization_ratio
        if u is not None and 0.9 <= u < 0.995:
            return g._replace(utilization_ratio=round(rng.uniform(low, 0.99), 2))
        return g
    return _per_gpu(stream, change)


def slow(stream: Iterable[NodeSnapshot], rng: random.Random, strength: int) -> Iterator[NodeSnapshot]:
    every = (5.0, 10.0, 10.0)[strength]
    due: float | None = None
    for snap in stream:
        if due is None or snap.time_seconds >= due:
            due = snap.time_seconds + 0.9 * every  # a jittered sample of a log already this slow is kept
            yield snap


def levels(stream: Iterable[NodeSnapshot], rng: random.Random, strength: int) -> Iterator[NodeSnapshot]:
    spread = (0.08, 0.15, 0.25)[strength]
    factors: dict[int, float] = {}

    def change(g: GpuSample) -> GpuSample:
        if g.power_watts is None:
            return g
        factor = factors.setdefault(g.index, 1.0 + rng.uniform(-spread, spread))
        return g._replace(power_watts=round(g.power_watts * factor, 2))
    return _per_gpu(stream, change)


_SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap


def cap(stream: Iterable[NodeSnapshot], rng: random.Random, strength: int) -> Iterator[NodeSnapshot]:
    snaps = list(stream)
    top = max((g.power_watts for s in snaps for g in s.gpus if g.power_watts is not None), default=None)
    if top is None:
        return iter(snaps)
    limit = round((0.9, 0.8, 0.7)[strength] * top, 2)

    def change(g: GpuSample) -> GpuSample:
        if g.power_watts is None:
            return g
        if g.power_limit_watts is not None:
            g = g._replace(power_limit_watts=limit)
        if g.power_watts <= limit:
            return g
        reasons = None if g.clock_event_reasons is None else int(g.clock_event_reasons) | _SW_POWER_CAP
        return g._replace(power_watts=round(limit * rng.uniform(0.985, 1.0), 2), clock_event_reasons=reasons)
    return _per_gpu(snaps, change)


def _shifted_after(stream: Iterable[NodeSnapshot], shifts: dict[int, float]) -> Iterator[NodeSnapshot]:
    """The stream with every sample from index `n` on moved by `shifts[n]` (added up)."""
    moved = 0.0
    for n, snap in enumerate(stream):
        moved += shifts.get(n, 0.0)
        yield NodeSnapshot(snap.time_seconds + moved, snap.gpus) if moved else snap


def dst(stream: Iterable[NodeSnapshot], rng: random.Random, strength: int) -> Iterator[NodeSnapshot]:
    snaps = list(stream)
    return _shifted_after(snaps, {rng.randrange(1, max(2, len(snaps))): 3600.0})


def ntp(stream: Iterable[NodeSnapshot], rng: random.Random, strength: int) -> Iterator[NodeSnapshot]:
    snaps = list(stream)
    count = (1, 2, 4)[strength]
    return _shifted_after(snaps, {rng.randrange(1, max(2, len(snaps))): rng.uniform(120, 900) for _ in range(count)})


def day_off(stream: Iterable[NodeSnapshot], rng: random.Random, strength: int) -> Iterator[NodeSnapshot]:
    snaps = list(stream)
    odd = {rng.randrange(len(snaps)): rng.choice((86400.0, -86400.0)) for _ in range((1, 2, 4)[strength])}
    return (NodeSnapshot(s.time_seconds + odd[n], s.gpus) if n in odd else s for n, s in enumerate(snaps))


def writers(stream: Iterable[NodeSnapshot], rng: random.Random, strength: int) -> Iterator[NodeSnapshot]:
    behind = rng.uniform(*((1.5, 3.0), (3.0, 6.0), (6.0, 20.0))[strength])
    for snap in stream:
        yield snap
        yield NodeSnapshot(snap.time_seconds - behind, snap.gpus)


PERTURBATIONS: dict[str, Perturbation] = {
    "blips": blips, "drops": drops, "rows": rows, "na": na, "jitter": jitter, "power_noise": power_noise,
    "wander": wander, "slow": slow, "levels": levels, "cap": cap, "dst": dst, "ntp": ntp, "day_off": day_off,
    "writers": writers,
}
COMBINED = ("blips", "drops", "rows", "na", "jitter", "power_noise", "wander")


def apply(stream: Iterable[NodeSnapshot], names: Iterable[str], seed: int | str, strength: int
          ) -> Iterator[NodeSnapshot]:
    """The stream through each named perturbation in turn, each with its own seeded source."""
    out: Iterable[NodeSnapshot] = stream
    for name in names:
        out = PERTURBATIONS[name](out, random.Random(f"{seed}:{name}"), strength)
    return iter(out)
