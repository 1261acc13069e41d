"""Accuracy of the verdict: the generated corpus (tests/traces/corpus.py, messy by default) and the real
nvidia-smi logs in ../shared/realdata, replayed as the daemon would decide them, in two modes:

    telemetry  the GPU readings alone, as `stall-watchdog replay` has them from an nvidia-smi log
    live       the same with the host progress the daemon reads for each GPU's processes (CPU, I/O):
               ranks computing, writing a checkpoint, or blocked

    python bench/accuracy.py [--per-class N] [--jobs N] [--mode telemetry|live|both]
    python bench/accuracy.py --perturb [--per-class N] [--strength 0|1|2 ...]
    python bench/accuracy.py --spins [--per-class N]

Per class it prints: traces, recall (the hang named as the class expects, at any time in the 15 minutes
after it starts), latency from the hang's start to the first alert (p50 / p95 / max of the hangs that came
when no pause was due; `held`: how many came when the job's rhythm expected one, and their longest wait
for an alert) and to critical (p50 / p95 / max),
episodes per hang (distinct alerted episodes from the hang's start to the end of the trace: mean and
max; one is the goal) and critical episodes per hang, false criticals (critical before a hang starts, or
in a healthy run) and warnings per healthy hour (all, and repeats: every warning of a run after its
first), and the actions the policy (act/policy.py) would take in act mode with its defaults: `acts`, on
the evidence a replay has (telemetry and host progress, never stacks: so none, unless
actions.on_telemetry_only is on), and `false acts`, what it would take with on_telemetry_only on
before a hang or in a healthy run (goal: 0). `--perturb` replays every trace again through each
perturbation of tests/traces/perturb.py, alone and combined, at each strength, and prints the same figures per
perturbation and class group.

`--spins` prints the spin matrix (issue 58): all-GPU spins (hang_spin, hang_spin_low_range) on every card of the
corpus, sampled every 1, 2, 5 and 10 s, logged with the standard and the minimal column sets, the card's spin
drawing what the corpus says, 15% less, 10% more, or a quarter of its limit: time to critical per card and per
sampling (p50 / p95 / max; a spin never critical is a miss), and the false criticals of healthy runs on the same
cards and samplings with their work drawing 10% less or more.

Goals (issue 23): live, every zero-util hang critical within 60 s, one critical episode per hang, the odd
blocked rank critical within 45 s; on telemetry alone every hang alerted within 60 s p95 (a pause the
job's rhythm expects may wait until it outlasts the job's pauses) and critical within 10 minutes, every
all-GPU spin critical within 45 s p95 and 60 s max; 0 false criticals; under 0.5 warnings per healthy
hour.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.traces import perturb  # noqa: E402
from tests.traces.corpus import HANGS, HEALTHY, MODELS, corpus, on_card  # noqa: E402
from tests.traces.judge import ACT, ACT_ON_TELEMETRY, Job, Outcome, alerts, replay, run_job, would_act  # noqa: E402
from watchdog.vocabulary.model import EventKind, NodeSnapshot, Severity  # noqa: E402

MODES = ("telemetry", "live")
GROUPS = {"healthy": HEALTHY, "spin": ("hang_spin", "hang_spin_uneven", "hang_spin_startup", "hang_spin_low_range"),
          "odd": ("hang_odd",), "zero": ("hang_zero",), "real_logs": ("real_logs",)}


def realdata_root() -> Path:
    return Path(os.environ.get("STALL_WATCHDOG_REALDATA", Path(__file__).resolve().parents[2] / "shared" / "realdata"))


def real_logs_folder() -> Path:
    return realdata_root() / "telemetry" / "grantwilkins-training_profile"


def real_logs(names: tuple[str, ...] = (), strength: int = 0) -> list[Outcome]:
    """The real logs are healthy runs (checkpoints, DDP training): criticals there are false."""
    from watchdog.sample.replay import open_trace

    folder = real_logs_folder()
    outcomes = []
    for path in sorted(folder.glob("*/*.csv")):
        with open_trace(str(path)) as trace:
            snaps: Iterable[NodeSnapshot] = list(trace.snapshots)
        if names:
            snaps = list(perturb.apply(snaps, names, path.name, strength))
        snaps = list(snaps)
        events = replay(snaps)
        hours = (snaps[-1].time_seconds - snaps[0].time_seconds) / 3600 if snaps else 0.0
        crit = sum(e.severity is Severity.CRITICAL for e in alerts(events))
        warned = sum(e.event is EventKind.FIRED and e.severity is Severity.WARNING for e in events)
        outcomes.append(Outcome(path.name, "real_logs", hours, false_criticals=crit, warnings=warned,
                                repeat_warnings=max(0, warned - 1), acts=would_act(events, ACT, None),
                                false_acts=would_act(events, ACT_ON_TELEMETRY, None)))
    return outcomes


def _pct(values: list[float], q: float) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))]:.0f}"


HEAD = (f"{'class':<22}{'traces':>7}{'recall':>8}{'alert p50/p95/max s':>22}{'held':>10}{'crit p50/p95/max s':>21}"
        f"{'eps/hang':>10}{'crit eps':>9}{'false crit':>11}{'warn/h':>8}{'repeat/h':>9}{'acts':>6}{'false acts':>11}")


def row(label: str, rows: list[Outcome], hang: bool) -> str:
    hours = sum(o.healthy_hours for o in rows) or 1e-9
    recall = f"{sum(o.found for o in rows) / len(rows):.0%}" if hang else "-"
    alert = [o.alert_latency for o in rows if o.alert_latency is not None and not o.held]
    held = [o.alert_latency for o in rows if o.alert_latency is not None and o.held]
    crit = [o.critical_latency for o in rows if o.critical_latency is not None]
    missing_crit = sum(o.critical_latency is None for o in rows) if hang else 0
    crit_text = (_pct(crit, .5) + "/" + _pct(crit, .95) + "/" + _pct(crit, 1)) if hang else "-"
    if missing_crit:
        crit_text += f" ({missing_crit} none)"
    eps = (f"{statistics.mean(o.episodes for o in rows):.2f}/{max(o.episodes for o in rows)}" if hang else "-")
    crit_eps = f"{max(o.critical_episodes for o in rows)}" if hang else "-"
    held_text = f"{len(held)}, <={_pct(held, 1)}" if held else ("0" if hang else "-")
    return (f"{label:<22}{len(rows):>7}{recall:>8}"
            f"{(_pct(alert, .5) + '/' + _pct(alert, .95) + '/' + _pct(alert, 1)) if hang else '-':>22}"
            f"{held_text:>10}{crit_text:>21}{eps:>10}{crit_eps:>9}"
            f"{sum(o.false_criticals for o in rows):>11}{sum(o.warnings for o in rows) / hours:>8.2f}"
            f"{sum(o.repeat_warnings for o in rows) / hours:>9.2f}{sum(o.acts for o in rows):>6}"
            f"{sum(o.false_acts for o in rows):>11}")


def report(outcomes: list[Outcome], title: str) -> None:
    by_class: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        by_class[o.cls].append(o)
    print(f"\n== {title}")
    print(HEAD)
    print("-" * len(HEAD))
    for cls in [*HEALTHY, *HANGS, "real_logs"]:
        if by_class.get(cls):
            print(row(cls, by_class[cls], cls in HANGS))
    healthy_hours = sum(o.healthy_hours for o in outcomes)
    alert = [o.alert_latency for o in outcomes if o.alert_latency is not None]
    print("-" * len(HEAD))
    print(f"healthy hours {healthy_hours:.1f}; false criticals {sum(o.false_criticals for o in outcomes)}; "
          f"warnings/h {sum(o.warnings for o in outcomes) / healthy_hours:.2f}; repeat warnings/h "
          f"{sum(o.repeat_warnings for o in outcomes) / healthy_hours:.2f}; actions in act mode "
          f"{sum(o.acts for o in outcomes)} (with on_telemetry_only: false {sum(o.false_acts for o in outcomes)})"
          + (f"; median first alert {statistics.median(alert):.0f} s" if alert else ""))
    for o in [o for o in outcomes if o.cls in HANGS and not o.found][:12]:
        print(f"  missed {o.name}: {o.wrong}")
    for o in [o for o in outcomes if o.false_criticals][:12]:
        print(f"  false critical in {o.name}")
    for o in [o for o in outcomes if o.cls in HANGS and o.episodes > 1][:12]:
        print(f"  {o.episodes} episodes in {o.name}")


def report_groups(results: dict[tuple[str, str], list[Outcome]]) -> None:
    """One row per perturbation and class group."""
    head = f"{'perturbation':<24}{'mode':<10}" + HEAD.replace(f"{'class':<22}", f"{'group':<12}", 1)
    print(head)
    print("-" * len(head))
    for (label, mode), outcomes in results.items():
        for group, classes in GROUPS.items():
            rows = [o for o in outcomes if o.cls in classes]
            if rows:
                print(f"{label:<24}{mode:<10}" + row(group, rows, group not in ("healthy", "real_logs"))
                      .replace(f"{group:<22}", f"{group:<12}", 1))
    for (label, mode), outcomes in results.items():  # what a row's figures hide: which traces, and what instead
        for o in outcomes:
            if o.cls in HANGS and not o.found:
                print(f"  {label} {mode}: missed {o.name}: {o.wrong}")
            elif o.cls in HANGS and o.critical_latency is None:
                print(f"  {label} {mode}: never critical {o.name}")
            if o.false_criticals:
                print(f"  {label} {mode}: false critical in {o.name}")


SPIN_POWER = {"as the corpus": lambda m: {}, "spin -15%": lambda m: {"spin": 0.85 * m.spin},
              "spin +10%": lambda m: {"spin": 1.1 * m.spin}, "spin 25% of limit": lambda m: {"spin": 0.25 * m.limit}}
WORK_POWER = {"work -10%": lambda m: {"busy": 0.9 * m.busy}, "work +10%": lambda m: {"busy": 1.1 * m.busy}}
SAMPLING = (1.0, 2.0, 5.0, 10.0)


def spin_matrix(pool: ProcessPoolExecutor, per_class: int) -> None:
    """The spin matrix (--spins): every card x sampling x column set x spin power, and healthy runs beside it."""
    cells = list(itertools.product(MODELS, SAMPLING, ("standard", "minimal")))
    hangs = [Job(on_card(cls, seed, card, interval, columns, power(MODELS[card])), False)
             for card, interval, columns in cells for power in SPIN_POWER.values()
             for cls in ("hang_spin", "hang_spin_low_range") for seed in range(per_class)]
    healthy = [Job(on_card(cls, seed, card, interval, columns, power(MODELS[card])), False)
               for card, interval, columns in cells for power in WORK_POWER.values()
               for cls in ("healthy_train", "checkpoint_rank0") for seed in range(max(1, per_class // 2))]
    found = list(pool.map(run_job, hangs, chunksize=4))
    calm = list(pool.map(run_job, healthy, chunksize=2))
    # By position: a trace's name does not say its spin power, so the four powers of a cell share one name.
    latency = [out.critical_latency for out in found]

    def spread(spins: list[int]) -> tuple[float, float, float, int]:
        """p50, p95, max of these spins' times to critical (a miss: infinite), and the misses."""
        values = sorted(math.inf if latency[n] is None else latency[n] for n in spins)  # type: ignore[misc]
        return (values[len(values) // 2], values[min(len(values) - 1, int(0.95 * len(values)))], values[-1],
                sum(1 for v in values if v == math.inf))

    def figures(spins: list[int]) -> str:
        *shown, missed = spread(spins)
        said = "/".join(f"{v:.0f}" if v != math.inf else "miss" for v in shown)
        return f"{len(spins):>4} spins  critical p50/p95/max {said:<14} misses {missed}"

    print("== spins: critical after an all-GPU spin begins (s), telemetry alone")
    for card in MODELS:
        print(f"{card:<8}", figures([n for n, j in enumerate(hangs) if j.trace.model == card]))
    for interval in SAMPLING:
        print(f"{interval:>4g} s   ", figures([n for n, j in enumerate(hangs) if j.trace.interval == interval]))
    for label, power in SPIN_POWER.items():
        chosen = [n for n, j in enumerate(hangs) if j.trace.power == power(MODELS[j.trace.model])]
        print(f"{label:<18}", figures(chosen))
    every = list(range(len(hangs)))
    _, p95, worst, _ = spread(every)
    print(f"all     {figures(every)}  (goal: p95 <= 45 s {'met' if p95 <= 45 else 'NOT met'}, "
          f"max <= 60 s {'met' if worst <= 60 else 'NOT met'})")
    for job, out in zip(hangs, found):
        if out.critical_latency is None or out.critical_latency > 60:
            late = "never" if out.critical_latency is None else f"after {out.critical_latency:.0f} s"
            print(f"  critical {late}: {job.trace.name} (spin at {job.trace.power or 'as generated'})")
    falses = sum(out.false_criticals for out in calm)
    hours = sum(out.healthy_hours for out in calm)
    print(f"healthy runs on the same cards and samplings, work power -10% / +10%: {len(calm)} runs, {hours:.1f} h, "
          f"false criticals {falses} (goal 0), warnings/h {sum(o.warnings for o in calm) / max(hours, 1e-9):.2f}")
    for job, out in zip(healthy, calm):
        if out.false_criticals:
            print(f"  false critical: {job.trace.name} ({job.trace.cls}, work at {job.trace.power})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-class", type=int, default=None, help="traces per class (default 12; 3 with --perturb)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes (default: every core)")
    parser.add_argument("--mode", choices=(*MODES, "both"), default="both", help="what the daemon sees (default both)")
    parser.add_argument("--perturb", action="store_true", help="each perturbation alone and combined, per group")
    parser.add_argument("--strength", type=int, nargs="+", choices=(0, 1, 2), default=[1, 2],
                        help="perturbation strengths with --perturb (default 1 2)")
    parser.add_argument("--only", nargs="+", choices=(*perturb.PERTURBATIONS, "combined"),
                        help="with --perturb: these perturbations alone (default: each, then combined)")
    parser.add_argument("--spins", action="store_true", help="the spin matrix: cards x sampling x power levels")
    args = parser.parse_args()
    if args.spins:
        with ProcessPoolExecutor(args.jobs) as pool:
            spin_matrix(pool, args.per_class or 3)
        return
    modes = MODES if args.mode == "both" else (args.mode,)
    has_real = any(real_logs_folder().glob("*/*.csv"))
    if not has_real:
        print(f"note: no real logs at {real_logs_folder()} (../shared/realdata beside the checkout, or "
              "STALL_WATCHDOG_REALDATA): every figure below is of the generated corpus alone")
    traces = corpus(args.per_class or (3 if args.perturb else 12))
    with ProcessPoolExecutor(args.jobs) as pool:
        if not args.perturb:
            for mode in modes:
                outcomes = list(pool.map(run_job, [Job(t, mode == "live") for t in traces], chunksize=2))
                if mode == "telemetry":  # the real logs carry no host progress: telemetry alone
                    outcomes += real_logs()
                named = " and the real logs" if mode == "telemetry" and has_real else ""
                report(outcomes, f"{mode}: the corpus{named}")
            return
        results: dict[tuple[str, str], list[Outcome]] = {}
        chosen = args.only or [*perturb.PERTURBATIONS, "combined"]
        variants = [((name,) if name != "combined" else perturb.COMBINED, s)
                    for name, s in itertools.product(chosen, args.strength)]
        for names, strength in variants:
            label = f"{'+'.join(names) if len(names) == 1 else 'combined'}@{strength}"
            for mode in modes:
                jobs = [Job(t, mode == "live", names, strength) for t in traces]
                outcomes = list(pool.map(run_job, jobs, chunksize=2))
                if mode == "telemetry":
                    outcomes += real_logs(names, strength)
                results[(label, mode)] = outcomes
                print(f"... {label} {mode}", file=sys.stderr, flush=True)
        report_groups(results)


if __name__ == "__main__":
    main()
