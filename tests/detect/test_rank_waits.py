"""Stragglers from the ranks' stack samples (detect/rank_waits.py): the rank that waits least while its peers wait
is named with the slowdown it costs; a difference it had from its first look, or one spent saving a checkpoint,
is uneven work and never a warning; ranks of other jobs are not compared; counts that are not the sampler's
are ignored."""

from __future__ import annotations

import dataclasses
import random
import re

import pytest

from watchdog.config import Config, parse_config
from watchdog.detect.engine import DetectorEngine
from watchdog.detect.rank_waits import Spread, WaitLedger, gap
from watchdog.detect.summary import summarize
from watchdog.sample import sim
from watchdog.vocabulary.model import (
    CLOCK_EVENT_HW_SLOWDOWN,
    EpisodeEvent,
    EventKind,
    NodeSnapshot,
    Severity,
    Signature,
)

RECORD = 15  # seconds of one py-spy record: the counts move once per record
RATE = round(Config().stacks.sample_rate_hz)  # samples a second, as the sampler takes them by default


def stream(wait: dict[int, float], seconds: int = 900, onset: int = 300, after: dict[int, float] | None = None,
           planned: dict[int, float] | None = None, jobs: dict[int, int] | None = None, seed: int = 1,
           gpus: int = 8, learn: int = 120) -> list[NodeSnapshot]:
    """8xH100 training, each GPU's rank waiting wait[g] of its samples (0.3 where not given), after[g] from
    `onset`; planned[g] of its samples in a checkpoint; counts as the sampler writes them (each record's)."""
    rng = random.Random(seed)
    counts = {g: [jobs.get(g, 7) if jobs else 7, g, 0, 0, 0, 0, 0] for g in range(gpus)}
    scenario = dataclasses.replace(sim.SCENARIOS["healthy"], gpus=gpus, duration_seconds=seconds)
    out = []
    for t, snapshot in enumerate(sim.run(scenario)):
        if t and t % RECORD == 0:
            for g, c in counts.items():
                share = (after or {}).get(g, wait.get(g, 0.3)) if t > onset else wait.get(g, 0.3)
                n = RECORD * RATE
                waits = sum(rng.random() < share for _ in range(n))
                plan = sum(rng.random() < (planned or {}).get(g, 0.0) for _ in range(n - waits))
                c[2:5] = [c[2] + n, c[3] + waits, c[4] + plan]
                if t <= learn:
                    c[5:7] = [c[5] + n, c[6] + waits]
        out.append(NodeSnapshot(snapshot.time_seconds,
                                tuple(g._replace(rank_waits=tuple(counts[g.index])) for g in snapshot.gpus)))
    return out


def run(snapshots: list[NodeSnapshot], config: Config | None = None) -> tuple[list[EpisodeEvent], DetectorEngine]:
    engine = DetectorEngine(config or Config())
    events = [e for s in snapshots for e in engine.observe(s) if e.signature is Signature.STRAGGLER]
    return events, engine


def slowed(gpu: int, extra: float, gpus: int = 8, comm: float = 0.3) -> dict[int, float]:
    """The wait shares once `gpu`'s rank computes `extra` more (0.2: 20%) in a job whose ranks all waited `comm`
    of each step (the communication): it waits the communication only, its peers that and its extra work."""
    step = 1 + (1 - comm) * extra
    return {g: comm / step if g == gpu else (comm + (1 - comm) * extra) / step for g in range(gpus)}


def test_a_rank_that_comes_to_wait_least_is_named_with_the_slowdown_it_costs() -> None:
    # A rank 25% slower: the job's step is 1 + 0.7 x 0.25 = 1.175 times as long.
    events, engine = run(stream({}, after=slowed(5, 0.25)))
    fired = [e for e in events if e.event is EventKind.FIRED]
    assert [(e.gpus, e.severity) for e in fired] == [((5,), Severity.WARNING)]
    assert fired[0].at_seconds - fired[0].onset_seconds >= 60  # its for_seconds
    delay = fired[0].at_seconds - sim.run(sim.SCENARIOS["healthy"]).__next__().time_seconds - 300
    assert delay <= 180
    facts = next(f for f in engine.last_findings if f.signature is Signature.STRAGGLER).facts
    assert facts["rank"] == 5 and facts["slowdown"] == pytest.approx(1.175, rel=0.05)
    assert "rank 5 (GPU 5) is the straggler" in fired[0].headline
    assert re.search(r"Rank 5's peers wait 1\d% of each step for it: in \d+ stack samples", fired[0].summary)
    assert engine.waits.uneven == {}


def test_a_gap_that_leaves_the_job_hardly_slower_is_not_named() -> None:
    """Every rank waited 30% at its first look; then rank 5 waits 12% while its peers wait 31%, hardly more than
    before: by their own time the job runs about 1.01x slower for it, under wait_gap_ratio (5%). That is the shape
    of the false stragglers chance draws among ranks that wait alike (bench/straggler.py part 3: each one found
    there came with an estimate of 1.01-1.05x), so nobody is named. Where the peers come to wait 37%, the job runs
    1.1x slower for rank 5: it is named."""
    first = [{g: (120, 36) for g in range(8)} for _ in range(8)]
    hardly = [{**{g: (120, 37) for g in range(8)}, 5: (120, 14)} for _ in range(6)]
    ledger = ledger_of(first + hardly)
    assert ledger.judge(RECORD * 14) == [] and ledger.shares[5] < 0.15
    slower = [{**{g: (120, 44) for g in range(8)}, 5: (120, 14)} for _ in range(6)]
    found = ledger_of(first + slower).judge(RECORD * 14)
    assert [e.gpu for e in found] == [5] and found[0].facts["slowdown"] == pytest.approx(0.7 / (1 - 44 / 120), rel=0.01)


def test_a_rank_slow_since_its_first_look_is_uneven_work_not_a_straggler() -> None:
    events, engine = run(stream({0: 0.15}))
    assert events == []
    assert list(engine.waits.uneven) == [0] and engine.waits.uneven[0].why == "from_start"
    assert "uneven work: rank 0 (GPU 0)" in engine.waits.uneven[0].sentence()
    # ... until it becomes slower still: a gap twice the one it had is a straggler again.
    events, _ = run(stream({0: 0.25}, after={0: 0.0}))
    assert [e.gpus for e in events if e.event is EventKind.FIRED] == [(0,)]


def test_a_rank_saving_a_checkpoint_is_uneven_work() -> None:
    events, engine = run(stream({}, after={0: 0.05}, planned={0: 0.8}))
    assert events == []
    assert engine.waits.uneven[0].why == "planned"


def test_ranks_of_another_job_are_not_its_peers() -> None:
    # GPUs 0-3 run a job that waits little by nature, 4-7 one that waits much: nobody is anyone's straggler.
    waits = {g: 0.1 if g < 4 else 0.5 for g in range(8)}
    events, engine = run(stream(waits, after={g: 0.1 if g < 4 else 0.5 for g in range(8)},
                                jobs={g: 1 if g < 4 else 2 for g in range(8)}))
    assert events == [] and engine.waits.uneven == {}
    # The same shares as one job: GPUs 0-3 are uneven work (from the first look), not stragglers.
    events, engine = run(stream(waits))
    assert events == [] and sorted(engine.waits.uneven) == [0, 1, 2, 3]


@pytest.mark.parametrize("seed", range(12))
def test_ranks_that_wait_alike_are_not_named(seed: int) -> None:
    events, engine = run(stream({}, seconds=1800, seed=seed))
    assert events == [] and engine.waits.uneven == {}


def test_its_settings_move_it() -> None:
    snapshots = stream({}, after={5: 0.2})
    off = parse_config({"detectors": {"straggler": {"enabled": False}}})
    assert run(snapshots, off)[0] == []
    strict = parse_config({"detectors": {"straggler": {"wait_gap_ratio": 0.25}}})
    assert run(snapshots, strict)[0] == []
    assert run(snapshots)[0]


def test_both_legs_make_one_episode() -> None:
    """A GPU the clocks and the stacks both name is one straggler episode carrying both."""
    snapshots = stream({}, after=slowed(5, 0.25))
    held = [NodeSnapshot(s.time_seconds, tuple(
        g._replace(sm_clock_hertz=g.sm_clock_max_hertz * 0.8, clock_event_reasons=CLOCK_EVENT_HW_SLOWDOWN)
        if g.index == 5 and n >= 300 and g.sm_clock_max_hertz and g.utilization_ratio else g for g in s.gpus))
        for n, s in enumerate(snapshots)]
    events, engine = run(held)
    assert [e.gpus for e in events if e.event is EventKind.FIRED] == [(5,)]
    finding = next(f for f in engine.last_findings if f.signature is Signature.STRAGGLER)
    assert {"clock_below_peers", "waits_least"} <= set(finding.legs)
    _, text = summarize(finding, 300, Severity.WARNING)
    assert "Rank 5's peers wait" in text and "SM clock" in text


@pytest.mark.parametrize("bad", [(1, 2, 3), (7, 5, 10, 11, 0, 0, 0), (7, 5, 10, 5, 6, 0, 0)])
def test_counts_the_sampler_does_not_write_are_ignored(bad: tuple[int, ...]) -> None:
    snapshots = [NodeSnapshot(s.time_seconds, tuple(g._replace(rank_waits=bad) if g.index == 5 else g for g in s.gpus))
                 for s in stream({}, seconds=400)]
    events, engine = run(snapshots)
    assert events == [] and 5 not in engine.waits.shares and len(engine.waits.shares) == 7


def test_a_new_process_on_the_gpu_starts_its_counts_afresh() -> None:
    snapshots = stream({}, after=slowed(5, 0.25), seconds=600)
    # At 450 s the rank on GPU 5 is replaced: its counts start from 0 again (the job restarted on it).
    restarted = [NodeSnapshot(s.time_seconds, tuple(
        g._replace(rank_waits=(7, 5, *(v - w for v, w in zip(g.rank_waits[2:], snapshots[450].gpus[5].rank_waits[2:]))))
        if g.index == 5 and n > 450 else g for g in s.gpus)) for n, s in enumerate(snapshots)]
    events, engine = run(restarted)
    assert engine.waits.history[5][0][1][2] < snapshots[450].gpus[5].rank_waits[2]


def test_shares_that_move_more_than_coin_flips_need_a_larger_gap() -> None:
    """The peers' records: each rank's share moving +-0.1 from one record to the next (a slow batch, a pause)
    makes a gap of 0.15 over 360 samples chance, which coin flips alone would not; a job that slows at a
    moment (every share steps up once) is not noise."""
    steady = [[(120, 36), (120, 36), (120, 36)] for _ in range(7)]
    moving = [[(120, 24), (120, 48), (120, 24)] for _ in range(7)]
    stepping = [[(120, 2), (120, 2), (120, 2), (120, 20), (120, 20), (120, 20)] for _ in range(7)]
    peers = [(108, 360)] * 7
    assert Spread.of(steady) == Spread(0.0, 120)
    spread = Spread.of(moving)
    assert spread is not None and spread.variance == pytest.approx((0.2 / 0.5149) ** 2 / 2, rel=1e-3)
    assert gap(54, 360, peers, 0.05, 5, Spread.of(steady)).beyond_chance
    assert not gap(54, 360, peers, 0.05, 5, spread).beyond_chance
    assert Spread.of(stepping) == Spread(0.0, 120)
    assert Spread.of([[(120, 36)], [(120, 30), (120, 40)]]) is None  # too few records to go on


def ledger_of(records: list[dict[int, tuple[int, int]]], learn: int = 8) -> WaitLedger:
    """A ledger fed 15 s records ({gpu: (samples, waits)} each) of one job, its first `learn` records the first
    look, as the sampler counts them."""
    ledger = WaitLedger(Config().detectors.straggler)
    counts: dict[int, list[int]] = {}
    for n, record in enumerate(records, start=1):
        for g, (samples, waits) in record.items():
            c = counts.setdefault(g, [7, g, 0, 0, 0, 0, 0])
            c[2:4] = [c[2] + samples, c[3] + waits]
            if n <= learn:
                c[5:7] = [c[5] + samples, c[6] + waits]
            ledger.observe(RECORD * n, g, tuple(c))
    return ledger


def test_nothing_is_named_while_the_first_look_lasts() -> None:
    """Two records into a job, one rank waiting more than its peers in the first and far less in the second:
    there is no before to tell a rank that became slow from the way the job's work is (uneven work at most)."""
    records = [{**{g: (120, 36) for g in range(8)}, 5: (120, 60)}, {**{g: (120, 36) for g in range(8)}, 5: (120, 6)}]
    ledger = ledger_of(records)
    assert ledger.judge(RECORD * 2) == []
    assert ledger.uneven[5].why == "from_start"
    ledger = ledger_of(records, learn=1)  # the same records once the first look is over: named
    assert [e.gpu for e in ledger.judge(RECORD * 2)] == [5]


def test_a_rank_named_just_after_it_slowed_is_sized_by_the_windows_newest_part() -> None:
    """Every rank waited 30% at its first look; half a minute ago rank 5 came to wait 5% while its peers wait 40%.
    The minute's window is named (half of it from before), but its figures would say the job runs 1.08x slower;
    its newest half, where the gap is larger by far more than chance, says what it is now: 0.7 / 0.6 = 1.17x."""
    first = [{g: (240, 72) for g in range(8)} for _ in range(10)]
    slowed = [{**{g: (240, 96) for g in range(8)}, 5: (240, 12)} for _ in range(2)]
    found = ledger_of(first + slowed).judge(RECORD * 12)
    assert [e.gpu for e in found] == [5]
    assert found[0].facts["slowdown"] == pytest.approx(0.7 / 0.6, rel=0.01)
    assert found[0].facts["wait_ratio"] == 0.05 and found[0].facts["wait_samples"] == 480
    steady = ledger_of(first + slowed * 3).judge(RECORD * 16)  # a minute on, the whole window says the same
    assert steady[0].facts["slowdown"] == pytest.approx(0.7 / 0.6, rel=0.01) and steady[0].facts["wait_samples"] == 960


def test_a_spread_seen_over_the_last_half_hour_holds_when_the_last_minutes_look_steady() -> None:
    """Twenty minutes of shares moving +-0.15 from record to record, then a steady four minutes: a gap of 0.15 in
    the last minute is within what this job's shares do (the longer window's records alone would say it is not)."""
    rng = random.Random(4)
    moving = [{g: (120, round(120 * (0.4 + rng.uniform(-0.15, 0.15)))) for g in range(8)} for _ in range(80)]
    steady = [{g: (120, 48) for g in range(8)} for _ in range(16)]
    last = [{**{g: (120, 48) for g in range(8)}, 5: (120, 30)} for _ in range(4)]
    assert [e.gpu for e in ledger_of(steady + steady + last).judge(RECORD * 36)] == [5]
    assert ledger_of(moving + steady + last).judge(RECORD * 100) == []


def timed(share: dict[int, float], seconds: int = 900, onset: int = 300, after: dict[int, float] | None = None,
          jitter: float = 0.03, seed: int = 3, learn: int = 120) -> list[NodeSnapshot]:
    """The same job as NCCL Inspector logs tell it (GpuSample.nccl_waits): each record adds 15,000 wall
    milliseconds and the rank's milliseconds inside collectives, share[g] of them (0.3 where not given) moved
    by `jitter` from one record to the next."""
    rng = random.Random(seed)
    counts = {g: [7, g, 0, 0, 0, 0, 0] for g in range(8)}
    out = []
    for t, snapshot in enumerate(sim.run(dataclasses.replace(sim.SCENARIOS["healthy"], duration_seconds=seconds))):
        if t and t % RECORD == 0:
            for g, c in counts.items():
                mean = (after or {}).get(g, share.get(g, 0.3)) if t > onset else share.get(g, 0.3)
                busy = round(min(max(rng.gauss(mean, jitter), 0.0), 1.0) * RECORD * 1000)
                c[2:4] = [c[2] + RECORD * 1000, c[3] + busy]
                if t <= learn:
                    c[5:7] = [c[5] + RECORD * 1000, c[6] + busy]
        out.append(NodeSnapshot(snapshot.time_seconds,
                                tuple(g._replace(nccl_waits=tuple(counts[g.index])) for g in snapshot.gpus)))
    return out


def test_nccls_own_timings_name_the_rank_whose_collectives_take_least() -> None:
    events, engine = run(timed({}, after=slowed(2, 0.2)))
    fired = [e for e in events if e.event is EventKind.FIRED]
    assert [e.gpus for e in fired] == [(2,)]
    finding = next(f for f in engine.last_findings if f.signature is Signature.STRAGGLER)
    assert finding.legs == ("nccl_least",) and finding.facts["slowdown"] == pytest.approx(1.14, rel=0.1)
    assert re.search(r"NCCL says so \(its Inspector log\): over [\d,]+ s, rank 2's collectives ran \d+% of the "
                     r"time, its peers' \d+%", fired[0].summary)
    assert engine.waits.history == {}  # the stack ledger heard nothing


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_timed_ranks_alike_or_uneven_from_the_start_are_not_named(seed: int) -> None:
    assert run(timed({}, jitter=0.08, seed=seed))[0] == []  # milliseconds moving a lot: the spread, not chance
    events, engine = run(timed({4: 0.1}, seed=seed))
    assert events == [] and engine.uneven[4].why == "from_start"


def test_timed_counts_need_the_records_spread_before_anything_is_named() -> None:
    assert not gap(1000, 15_000, [(4500, 15_000)] * 7, 0.05, 5, None, counted=False).beyond_chance
    assert gap(1000, 15_000, [(4500, 15_000)] * 7, 0.05, 5, None).beyond_chance  # as coin flips it would be


def test_the_stacks_and_nccl_name_one_episode_together() -> None:
    both = [NodeSnapshot(a.time_seconds, tuple(g._replace(nccl_waits=h.nccl_waits) for g, h in zip(a.gpus, b.gpus)))
            for a, b in zip(stream({}, after=slowed(5, 0.25)), timed({}, after=slowed(5, 0.25)))]
    events, engine = run(both)
    assert [e.gpus for e in events if e.event is EventKind.FIRED] == [(5,)]
    finding = next(f for f in engine.last_findings if f.signature is Signature.STRAGGLER)
    assert set(finding.legs) == {"waits_least", "nccl_least"}
    summary = summarize(finding, 120, Severity.WARNING)[1]
    assert "stack samples" in summary and "NCCL agrees" in summary


def test_counts_that_go_back_or_claim_more_time_than_passed_start_afresh() -> None:
    """Replayed counts are a file's word: waits that go back while samples grow, a time before the last, or
    (timed) more wall milliseconds than passed restart the GPU's history; nothing is judged from them."""
    from watchdog.config import StragglerConfig
    from watchdog.detect.rank_waits import WaitLedger
    ledger = WaitLedger(StragglerConfig(), timed=True)
    ledger.observe(15.0, 0, (7, 0, 15_000, 4_000, 0, 15_000, 4_000))
    ledger.observe(30.0, 0, (7, 0, 30_000, 8_000, 0, 15_000, 4_000))
    assert len(ledger.history[0]) == 2
    ledger.observe(45.0, 0, (7, 0, 45_000, 1_000, 0, 15_000, 4_000))  # waits went back
    assert [c for _, c in ledger.history[0]] == [(7, 0, 45_000, 1_000, 0, 15_000, 4_000)]
    ledger.observe(60.0, 0, (7, 0, 10**13, 2_000, 0, 15_000, 4_000))  # 10^13 ms in 15 s
    assert len(ledger.history[0]) == 1
    ledger.observe(50.0, 0, (7, 0, 10**13 + 1, 2_000, 0, 15_000, 4_000))  # before the last
    assert [t for t, _ in ledger.history[0]] == [50.0]
    ledger.observe(65.0, 1, (7, 1, 15_000, 4_000, 0, 16_000, 4_000))  # a first look larger than all its samples
    assert 1 not in ledger.history


def test_a_replay_whose_waits_go_back_names_no_straggler() -> None:
    """Every other record of GPU 3's rank says fewer milliseconds waited than the one before (a rank that
    would read as never waiting, were the counts believed): its history never holds two records in a row."""
    snapshots = timed({}, seconds=600)
    back = [NodeSnapshot(s.time_seconds, tuple(
        g._replace(nccl_waits=(*g.nccl_waits[:3], max(0, g.nccl_waits[3] - 6_000 * (n // RECORD % 2)),
                               *g.nccl_waits[4:]))
        if g.index == 3 and g.nccl_waits else g for g in s.gpus)) for n, s in enumerate(snapshots)]
    events, engine = run(back)
    assert events == []
    assert all(0 <= share <= 1 for share in engine.nccl_waits.shares.values())
