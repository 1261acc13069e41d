"""The judgement of two versions of the detectors side by side: every episode event (signature, severity,
GPUs, onset and time) of the accuracy corpus in both modes, of each perturbation of tests/traces/perturb.py, and
of the real logs in ../shared/realdata, as one version decides them; then the differences between two
such runs, times compared within one tick.

    python bench/differential.py --out after.jsonl [--per-class N] [--stretch]
    PYTHONPATH=/path/to/other/checkout python bench/differential.py --out before.jsonl
    python bench/differential.py --compare before.jsonl after.jsonl
    python bench/differential.py --against REV [--per-class N]

--stretch feeds each trace to the engine 512 ticks at a time (as a replay does) instead of one by one.
--against checks out REV (a git revision of this repository) in a temporary worktree, judges every case
with its detectors one tick at a time and with this checkout's a stretch at a time, and compares the two
(`make bench` runs it against 54db7e4, the last revision with the detectors before they became rules over
stretches).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accuracy import realdata_root  # noqa: E402

from tests.traces import perturb  # noqa: E402
from tests.traces.corpus import corpus, snapshots  # noqa: E402
from tests.traces.judge import START  # noqa: E402
from watchdog.config import Config  # noqa: E402
from watchdog.detect.engine import DetectorEngine  # noqa: E402
from watchdog.vocabulary.model import NodeSnapshot  # noqa: E402

TICK_SECONDS = 1.0  # times within one tick of each other are the same judgement


def cases(per_class: int) -> Iterator[tuple[str, str, tuple[str, ...], int]]:
    """(name, kind, perturbation, strength): corpus traces by name, real logs by path."""
    traces = corpus(per_class)
    for trace in traces:
        for live in (False, True):
            yield f"{trace.name}:{'live' if live else 'telemetry'}", "corpus", (), 0
    for name in [*perturb.PERTURBATIONS, "combined"]:
        names = perturb.COMBINED if name == "combined" else (name,)
        for trace in traces[::3]:
            yield f"{trace.name}:telemetry", "corpus", names, 2
    folder = realdata_root() / "telemetry"
    for path in sorted(folder.glob("**/*.csv")):
        yield str(path), "real", (), 0
        yield str(path), "real", perturb.COMBINED, 1


def stream(case: tuple[str, str, tuple[str, ...], int], per_class: int) -> list[NodeSnapshot]:
    name, kind, names, strength = case
    if kind == "real":
        from watchdog.sample.replay import open_trace

        with open_trace(name) as trace:
            snaps = list(trace.snapshots)
        seed = Path(name).name
    else:
        trace_name, mode = name.rsplit(":", 1)
        trace = next(t for t in corpus(per_class) if t.name == trace_name)
        snaps = list(snapshots(trace, START, live=mode == "live"))
        seed = f"{trace.seed}:{strength}"
    return list(perturb.apply(snaps, names, seed, strength)) if names else snaps


def judged(job: tuple[tuple[str, str, tuple[str, ...], int], int, bool]) -> dict:
    case, per_class, stretch = job
    snaps = stream(case, per_class)
    engine = DetectorEngine(Config())
    events = []
    if stretch:
        for start in range(0, len(snaps), 512):
            events += engine.observe(snaps[start:start + 512])
    else:
        for snapshot in snaps:
            events += engine.observe(snapshot)
    return {"case": [case[0], "+".join(case[2]), case[3]],
            "events": [[e.event.value, e.signature.value, e.severity.value, list(e.gpus), e.onset_seconds,
                        e.at_seconds] for e in events]}


def compare(before: Path, after: Path) -> int:
    old = {json.dumps(r["case"]): r["events"] for r in map(json.loads, before.read_text().splitlines())}
    new = {json.dumps(r["case"]): r["events"] for r in map(json.loads, after.read_text().splitlines())}
    differ = 0
    for case in sorted(old.keys() | new.keys()):
        a, b = old.get(case), new.get(case)
        same = a is not None and b is not None and len(a) == len(b) and all(
            x[:4] == y[:4] and abs(x[4] - y[4]) <= TICK_SECONDS + 1e-6 and abs(x[5] - y[5]) <= TICK_SECONDS + 1e-6
            for x, y in zip(a, b))
        if not same:
            differ += 1
            print(f"{case}:\n  before {a}\n  after  {b}")
    events = sum(len(e) for e in old.values())
    print(f"{len(old.keys() | new.keys())} cases, {events} events before and {sum(len(e) for e in new.values())} "
          f"after, {differ} differ (signature, severity, GPUs; onset and time within {TICK_SECONDS:.0f} s)")
    return 1 if differ else 0


def against(rev: str, per_class: int, jobs: int) -> int:
    """This checkout's judgement (a stretch at a time) against that of `rev` (a tick at a time)."""
    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "--quiet", "--detach", str(tree), rev], check=True)
        try:
            common = [sys.executable, __file__, "--per-class", str(per_class), "--jobs", str(jobs), "--out"]
            env = {**os.environ, "PYTHONPATH": str(tree)}
            subprocess.run([*common, f"{tmp}/before.jsonl"], env=env, check=True)
            subprocess.run([*common, f"{tmp}/after.jsonl", "--stretch"], check=True)
            print(f"{rev} (a tick at a time) against this checkout (a stretch at a time):")
            return compare(Path(tmp) / "before.jsonl", Path(tmp) / "after.jsonl")
        finally:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--per-class", type=int, default=6)
    parser.add_argument("--stretch", action="store_true")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--compare", type=Path, nargs=2)
    parser.add_argument("--against", metavar="REV")
    args = parser.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    if args.against:
        sys.exit(against(args.against, args.per_class, args.jobs))
    if args.out is None:
        parser.error("--out, --compare or --against is needed")
    jobs = [(case, args.per_class, args.stretch) for case in cases(args.per_class)]
    with ProcessPoolExecutor(args.jobs) as pool, args.out.open("w") as out:
        for result in pool.map(judged, jobs, chunksize=2):
            out.write(json.dumps(result) + "\n")
    print(f"{len(jobs)} cases judged into {args.out}")


if __name__ == "__main__":
    main()
