"""Stragglers from telemetry: how soon a GPU whose SM clock is held down while its peers work is named, how
close the estimated slowdown comes to the true one, and how many stragglers healthy runs are given.

    python bench/straggler.py [--per-class N]

1. A simulated 8xH100 node training (bench's own shapes: watchdog/sample/sim.py), one GPU's clock held 10%,
   15%, 20% and 30% down from t=300 s (a hardware slowdown), its peers waiting on it: detection time from the
   onset and the estimated slowdown against 1 / (1 - deficit), the slowdown of a compute-bound step.
2. False stragglers: the accuracy corpus (tests/traces/corpus.py: its healthy classes and its hangs before they
   hang), each trace as generated and with the clocks made as uneven as power-capped GPUs are (a lasting
   offset of up to 6% per GPU and +-5% from sample to sample while it works), per class and per GPU-day.
   These are generated traces: the real logs in ../shared/realdata have no clock column.

3. False stragglers from the ranks' stack samples (detect/rank_waits.py fed the counts stacks/sampling.py
   writes): 8-rank jobs whose ranks all wait alike, 15-second records at stacks.sample_rate_hz, each record's
   wait share of each rank drawn around the job's (binomial), and again with every record's share moved by up
   to +-0.05 at random (steps are not coin flips: a slow batch, a GC pause). Counted: the times a rank is
   named that was not named at the record before (each is at most one warning). Generated counts: the live
   ranks are bench/straggler_live.py's.

Goals (issue 42): a GPU held 15% down named within 5 minutes; slowdown within 25% of the true one; no false
straggler on the corpus's healthy classes, at most 1 per 1,000 GPU-days.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.traces.corpus import HANGS, HEALTHY, Trace, corpus, snapshots  # noqa: E402
from tests.traces.judge import START  # noqa: E402
from watchdog.config import Config  # noqa: E402
from watchdog.detect.engine import DetectorEngine  # noqa: E402
from watchdog.detect.rank_waits import WaitLedger  # noqa: E402
from watchdog.sample import sim  # noqa: E402
from watchdog.vocabulary.model import EventKind, NodeSnapshot, Signature  # noqa: E402


def held_down(deficit: float) -> tuple[float | None, float | None]:
    """(seconds from the onset to the straggler warning, estimated slowdown) for one GPU held `deficit` down."""
    scenario = sim.SCENARIOS["straggler"]
    stream = list(sim.run(scenario))
    onset = 300
    engine = DetectorEngine(Config())
    base = stream[0].time_seconds
    for n, snapshot in enumerate(stream):
        if n >= onset:  # the scenario holds GPU 5 15% down: rescale it to this deficit
            gpus = tuple(g._replace(sm_clock_hertz=g.sm_clock_max_hertz * (1 - deficit))
                         if g.index == 5 and g.sm_clock_max_hertz and g.utilization_ratio else g for g in snapshot.gpus)
            snapshot = NodeSnapshot(snapshot.time_seconds, gpus)
        for event in engine.observe(snapshot):
            if event.signature is Signature.STRAGGLER and event.event is EventKind.FIRED:
                slowdown = _slowdown(engine)
                return event.at_seconds - base - onset, slowdown
    return None, None


def _slowdown(engine: DetectorEngine) -> float | None:
    for finding in engine.last_findings:
        if finding.signature is Signature.STRAGGLER:
            return float(finding.facts["slowdown"])
    return None


def uneven_clocks(stream: Iterator[NodeSnapshot], seed: int) -> Iterator[NodeSnapshot]:
    """Clocks as power-capped GPUs have them: each GPU a lasting offset of up to 6% below its maximum, and
    +-5% from sample to sample while it works."""
    rng = random.Random(seed)
    offsets: dict[int, float] = {}
    for snapshot in stream:
        gpus = []
        for g in snapshot.gpus:
            offset = offsets.setdefault(g.index, rng.uniform(0.0, 0.06))
            if g.sm_clock_hertz is not None and g.sm_clock_max_hertz and (g.utilization_ratio or 0) > 0:
                clock = g.sm_clock_max_hertz * min(1.0, (1 - offset) * rng.uniform(0.95, 1.05))
                g = g._replace(sm_clock_hertz=clock)
            gpus.append(g)
        yield NodeSnapshot(snapshot.time_seconds, tuple(gpus))


def stragglers(trace: Trace, uneven: bool) -> int:
    stream = snapshots(trace, START)
    if uneven:
        stream = uneven_clocks(stream, trace.seed)
    engine = DetectorEngine(Config())
    count = 0
    for snapshot in stream:
        if trace.hang_at is not None and snapshot.time_seconds - START >= trace.hang_at:
            break  # a hang is judged by the stall detectors; only its healthy stretch counts here
        count += sum(1 for e in engine.observe(snapshot)
                     if e.signature is Signature.STRAGGLER and e.event is EventKind.FIRED)
    return count


def alike(gpu_days: float, jitter: float, seed: int) -> int:
    """Rank-wait namings in `gpu_days` of 8-rank jobs whose ranks all wait alike (see 3. above)."""
    cfg = Config()
    rate, record = cfg.stacks.sample_rate_hz, cfg.stacks.sample_seconds
    rng = np.random.default_rng(seed)
    named = 0
    hours = gpu_days * 24 / 8
    n = int(rate * record)
    for _ in range(max(1, round(hours))):  # one job-hour each, learnt afresh
        ledger = WaitLedger(cfg.detectors.straggler)
        share = rng.uniform(0.1, 0.6)
        counts = {g: [7, g, 0, 0, 0, 0, 0] for g in range(8)}
        before: set[int] = set()
        t = 0.0
        while t < 3600:
            t += record
            drawn = rng.binomial(n, np.clip(share + rng.uniform(-jitter, jitter, 8), 0.01, 0.99)).tolist()
            for g, c in counts.items():
                waits = drawn[g]
                c[2:4] = [c[2] + n, c[3] + waits]
                if t <= cfg.stacks.sample_learn_seconds:
                    c[5:7] = [c[5] + n, c[6] + waits]
                ledger.observe(t, g, tuple(c))
            now = {e.gpu for e in ledger.judge(t)}
            named += len(now - before)
            before = now
    return named


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-class", type=int, default=6)
    parser.add_argument("--wait-days", type=float, default=400.0, help="GPU-days of rank samples in 3., a seed.")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42], help="seeds of 3. (each its own GPU-days)")
    args = parser.parse_args()
    print("one GPU of 8 held down (simulated 8xH100, the peers waiting on it), straggler warning after the onset:")
    print("| clock held down | named after | estimated slowdown | true slowdown | error |")
    print("|---|---|---|---|---|")
    for deficit in (0.10, 0.15, 0.20, 0.30):
        seconds, slowdown = held_down(deficit)
        true = 1 / (1 - deficit)
        named = "not named" if seconds is None else f"{seconds:.0f} s"
        estimate = "-" if slowdown is None else f"{slowdown:.2f}x"
        error = "-" if slowdown is None else f"{abs(slowdown - true) / (true - 1):.0%} of the slowdown"
        print(f"| {deficit:.0%} | {named} | {estimate} | {true:.2f}x | {error} |")
    traces = corpus(args.per_class, HEALTHY + HANGS)
    print(f"\nfalse stragglers, accuracy corpus ({args.per_class} traces per class; hangs up to their onset):")
    print("| class | traces | GPU-days | as generated | clocks uneven (power-capped) |")
    print("|---|---|---|---|---|")
    totals: Counter[str] = Counter()
    for cls in HEALTHY + HANGS:
        mine = [t for t in traces if t.cls == cls]
        days = sum((t.hang_at if t.hang_at is not None else t.duration) * t.gpus for t in mine) / 86400
        plain = sum(stragglers(t, False) for t in mine)
        uneven = sum(stragglers(t, True) for t in mine)
        totals.update(days=days, plain=plain, uneven=uneven)
        print(f"| {cls} | {len(mine)} | {days:.1f} | {plain} | {uneven} |")
    print(f"| all | {len(traces)} | {totals['days']:.1f} | {totals['plain']} | {totals['uneven']} |")
    rate = (totals["plain"] + totals["uneven"]) / (2 * totals["days"]) * 1000 if totals["days"] else 0.0
    print(f"false stragglers per 1,000 GPU-days: {rate:.1f} (goal: at most 1; generated traces only)")
    days = args.wait_days * len(args.seeds)
    print(f"\nfalse stragglers from stack samples, 8-rank jobs whose ranks wait alike ({args.wait_days:g} GPU-days "
          f"for each of the seeds {', '.join(map(str, args.seeds))}):")
    print("| shares | named (by seed) | per 1,000 GPU-days |")
    print("|---|---|---|")
    for jitter, what in ((0.0, "binomial"), (0.05, "moved +-0.05 per record")):
        counts = [alike(args.wait_days, jitter, seed) for seed in args.seeds]
        print(f"| {what} | {sum(counts)} ({', '.join(map(str, counts))}) | {sum(counts) / days * 1000:.1f} |")


if __name__ == "__main__":
    main()
