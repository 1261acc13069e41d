"""Accuracy of the detectors on telemetry alone: the generated corpus (bench/corpus.py) and the real
nvidia-smi logs in ../shared/realdata, replayed as `stall-watchdog replay` would.

    python bench/accuracy.py [--per-class N] [--jobs N]

Per class it prints: traces, recall (the hang named as the class expects, at any time in the 15 minutes
after it starts), latency from the hang's start to the first alert and to critical (p50 / p95 / max),
false criticals (critical before a hang starts, or in a healthy run) and warnings per healthy hour (all,
and repeats: every warning of a run after its first). Goals (issue 10): spin critical p95 <= 60 s and max
<= 90 s; odd GPU named within 60 s; zero-util alerted within 60 s and critical within 10 min; 0 false
criticals; repeat warnings <= 0.5 per healthy hour.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpus import HANGS, HEALTHY, Trace, corpus, snapshots  # noqa: E402

from watchdog.config import Config  # noqa: E402
from watchdog.detect.engine import DetectorEngine  # noqa: E402
from watchdog.model import EpisodeEvent, EventKind, NodeSnapshot, Severity, Signature  # noqa: E402

START = 1.9e9
EXPECTED_SIGNATURE = {"spin": Signature.BUSY_SPIN, "odd": Signature.WAITING, "zero": Signature.ZERO_UTIL}


@dataclass
class Outcome:
    name: str
    cls: str
    healthy_hours: float
    found: bool = False
    alert_latency: float | None = None
    critical_latency: float | None = None
    false_criticals: int = 0
    warnings: int = 0
    repeat_warnings: int = 0
    wrong: str = ""  # what it said instead, for a miss


def alerts(events: list[EpisodeEvent]) -> list[EpisodeEvent]:
    return [e for e in events if e.event in (EventKind.FIRED, EventKind.ESCALATED)]


def judge(trace: Trace, events: list[EpisodeEvent]) -> Outcome:
    hang = START + trace.hang_at if trace.hang_at is not None else None
    out = Outcome(trace.name, trace.cls, trace.healthy_seconds / 3600)
    before = [e for e in alerts(events) if hang is None or e.at_seconds < hang]
    out.false_criticals = sum(e.severity is Severity.CRITICAL for e in before)
    warned = [e for e in before if e.event is EventKind.FIRED and e.severity is Severity.WARNING]
    out.warnings, out.repeat_warnings = len(warned), max(0, len(warned) - 1)
    if hang is None or trace.expect is None:
        return out
    wanted = EXPECTED_SIGNATURE[trace.expect]
    after = [e for e in alerts(events) if e.at_seconds >= hang and e.onset_seconds >= hang - 60]
    hits = [e for e in after if e.signature is wanted and (trace.expect != "odd" or e.culprit_gpus == trace.culprits)]
    if hits:
        out.found = True
        out.alert_latency = hits[0].at_seconds - hang
        critical = [e for e in hits if e.severity is Severity.CRITICAL]
        out.critical_latency = critical[0].at_seconds - hang if critical else None
    else:
        out.wrong = "; ".join(f"{e.signature.value}/{e.severity.value} culprits={list(e.culprit_gpus)}"
                              for e in after[:2]) or "nothing"
    return out


def replay(stream: list[NodeSnapshot] | object) -> list[EpisodeEvent]:
    engine = DetectorEngine(Config())
    events: list[EpisodeEvent] = []
    for snapshot in stream:  # type: ignore[attr-defined]
        events.extend(e for e in engine.observe(snapshot) if e.event.value != "suspected")
    return events


def run_trace(trace: Trace) -> Outcome:
    return judge(trace, replay(snapshots(trace, START)))


def real_logs() -> list[Outcome]:
    """The real logs are healthy runs (checkpoints, DDP training): criticals there are false."""
    from watchdog.sample.replay import open_trace

    root = Path(os.environ.get("STALL_WATCHDOG_REALDATA", Path(__file__).resolve().parents[2] / "shared" / "realdata"))
    folder = root / "telemetry" / "grantwilkins-training_profile"
    outcomes = []
    for path in sorted(folder.glob("*/*.csv")):
        with open_trace(str(path)) as trace:
            snaps = list(trace.snapshots)
        events = replay(snaps)
        hours = (snaps[-1].time_seconds - snaps[0].time_seconds) / 3600 if snaps else 0.0
        crit = sum(e.severity is Severity.CRITICAL for e in alerts(events))
        warned = sum(e.event is EventKind.FIRED and e.severity is Severity.WARNING for e in events)
        outcomes.append(Outcome(path.name, "real_logs", hours, false_criticals=crit, warnings=warned,
                                repeat_warnings=max(0, warned - 1)))
    return outcomes


def _pct(values: list[float], q: float) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))]:.0f}"


def report(outcomes: list[Outcome]) -> None:
    by_class: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        by_class[o.cls].append(o)
    head = (f"{'class':<22}{'traces':>7}{'recall':>8}{'alert p50/p95/max s':>22}{'crit p50/p95/max s':>21}"
            f"{'false crit':>11}{'warn/h':>8}{'repeat/h':>9}")
    print(head)
    print("-" * len(head))
    for cls in [*HEALTHY, *HANGS, "real_logs"]:
        rows = by_class.get(cls)
        if not rows:
            continue
        hours = sum(o.healthy_hours for o in rows) or 1e-9
        hang = cls in HANGS
        recall = f"{sum(o.found for o in rows) / len(rows):.0%}" if hang else "-"
        alert = [o.alert_latency for o in rows if o.alert_latency is not None]
        crit = [o.critical_latency for o in rows if o.critical_latency is not None]
        print(f"{cls:<22}{len(rows):>7}{recall:>8}"
              f"{(_pct(alert, .5) + '/' + _pct(alert, .95) + '/' + _pct(alert, 1)) if hang else '-':>22}"
              f"{(_pct(crit, .5) + '/' + _pct(crit, .95) + '/' + _pct(crit, 1)) if hang else '-':>21}"
              f"{sum(o.false_criticals for o in rows):>11}{sum(o.warnings for o in rows) / hours:>8.2f}"
              f"{sum(o.repeat_warnings for o in rows) / hours:>9.2f}")
    healthy_hours = sum(o.healthy_hours for o in outcomes)
    print("-" * len(head))
    print(f"healthy hours {healthy_hours:.1f}; false criticals {sum(o.false_criticals for o in outcomes)}; "
          f"warnings/h {sum(o.warnings for o in outcomes) / healthy_hours:.2f}; repeat warnings/h "
          f"{sum(o.repeat_warnings for o in outcomes) / healthy_hours:.2f}")
    misses = [o for o in outcomes if o.cls in HANGS and not o.found]
    for o in misses[:12]:
        print(f"  missed {o.name}: {o.wrong}")
    for o in [o for o in outcomes if o.false_criticals][:12]:
        print(f"  false critical in {o.name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-class", type=int, default=12, help="traces per class (default 12)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes (default: every core)")
    args = parser.parse_args()
    traces = corpus(args.per_class)
    with ProcessPoolExecutor(args.jobs) as pool:
        outcomes = list(pool.map(run_trace, traces, chunksize=2))
    outcomes += real_logs()
    report(outcomes)
    alert = [o.alert_latency for o in outcomes if o.alert_latency is not None]
    if alert:
        print(f"all hangs: median first alert {statistics.median(alert):.0f} s")


if __name__ == "__main__":
    main()
