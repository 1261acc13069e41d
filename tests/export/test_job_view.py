"""The node's job view (export/job_view.py): one row a proven job, its stall state and culprit, and its
ranks' stack counts as counters that only grow, rendered by the real collector."""

from __future__ import annotations

import re

import pytest

from watchdog.export.metrics import EpisodeView, Published, WatchdogCollector, new_counters
from watchdog.sample import sim
from watchdog.sample.rank_labels import RankRow
from watchdog.vocabulary.model import NodeSnapshot, Severity, Signature, Workload


def _snapshot(waits: dict[int, tuple[int, ...]], at: float = 1.9e9) -> NodeSnapshot:
    snapshots = sim.run(sim.Scenario("jobs", "", "h100", 4, 600, ((0, None, "train"),)))
    gpus = [next(snapshots) for _ in range(5)][-1].gpus
    return NodeSnapshot(at, tuple(g._replace(rank_waits=waits.get(g.index, ())) for g in gpus))


# GPUs 0-1: run-a, proven (Slurm job 7); GPU 2: run-b, proven, in a pod; GPU 3: a claim of run-a, not proven.
RANKS = (RankRow(0, 100, 0, "run-a", Workload(slurm_job_id="7"), "slurm", "1000"),
         RankRow(1, 101, 1, "run-a", Workload(slurm_job_id="7"), "slurm", "1000"),
         RankRow(2, 200, 0, "run-b", Workload("ml", "b-0"), "pod", "2000"),
         RankRow(3, 300, 2, "run-a", Workload()))


def _rows(text: str, name: str) -> dict[str, float]:
    return {labels: float(value) for labels, value in
            re.findall(rf"^stall_watchdog_{name}\{{(.*)\}} (\S+)$", text, re.M)}


# Labels sorted by name; an empty one is written as such (Prometheus drops it, as on rank_info). The wait
# series leave the pod out.
A = 'namespace="",pod="",slurm_job_id="7",training_job="run-a",uid="1000"'
B = 'namespace="ml",pod="b-0",slurm_job_id="",training_job="run-b",uid="2000"'
A_WAITS = 'namespace="",slurm_job_id="7",training_job="run-a",uid="1000"'


def test_each_proven_job_has_its_state_and_culprit() -> None:
    """run-a's GPU 1 waits (critical) on its GPU 0, run-b's GPU 2 is suspect of a spin; the unproven claim on
    GPU 3 (critical on its own) is no job: run-a's state is that of its own GPUs."""
    episodes = (EpisodeView(Signature.WAITING, Severity.CRITICAL, (1,), (0,), 1.0),
                EpisodeView(Signature.BUSY_SPIN, None, (2,), (), 1.0),
                EpisodeView(Signature.BUSY_SPIN, Severity.CRITICAL, (3,), (), 1.0),
                EpisodeView(Signature.THROTTLE, Severity.CRITICAL, (0,), (), 1.0))
    state = Published(_snapshot({}), episodes, RANKS)
    text = WatchdogCollector(lambda: state, new_counters()).exposition().decode()
    assert _rows(text, "job_state") == {A: 3.0, B: 1.0}
    assert _rows(text, "job_culprit") == {A: 1.0}
    healthy = Published(_snapshot({}), (), RANKS)
    text = WatchdogCollector(lambda: healthy, new_counters()).exposition().decode()
    assert _rows(text, "job_state") == {A: 0.0, B: 0.0} and _rows(text, "job_culprit") == {}


def _counts(rank: int, samples: int, waits: int, first: tuple[int, int] = (0, 0)) -> tuple[int, ...]:
    return (1, rank, samples, waits, 0, *first)


def test_the_wait_share_is_the_jobs_last_five_minutes_through_restarts() -> None:
    """run-a's two ranks, scraped every minute: 30% waits for 5 minutes, then 10%; GPU 1's rank restarts at
    minute 3 (its counts begin again) and GPU 0's leaves at minute 8: the share is over the last 5 minutes
    of what the job's ranks counted, never thrown by a count that starts again, and the first look is summed."""
    now: list[Published] = []
    collector = WatchdogCollector(lambda: now[-1], new_counters())
    ranks = list(RANKS)
    restarted = ranks[1]._replace(pid=111)
    seen = []
    a, b = [0, 0], [0, 0]  # each rank's samples and waits since it started: 480 samples a minute (8 a second)
    for minute in range(12):
        waits = 144 if minute < 6 else 48  # 30% of 480, then 10%
        if minute == 3:
            b = [0, 0]  # GPU 1's rank restarted: its counts begin again
        its_ranks = [ranks[0], ranks[1] if minute < 3 else restarted, *ranks[2:]]
        counts = {}
        if minute < 8:
            a = [a[0] + 480, a[1] + waits]
            counts[0] = _counts(0, *a, first=(480, 144))
        else:
            its_ranks = its_ranks[1:]  # GPU 0's rank left
        b = [b[0] + 480, b[1] + waits]
        counts[1] = _counts(1, *b, first=(480, 144) if minute < 3 else (0, 0))
        now.append(Published(_snapshot(counts, 1.9e9 + 60 * minute), (), tuple(its_ranks)))
        text = collector.exposition().decode()
        seen.append((_rows(text, "job_wait_ratio").get(A_WAITS), _rows(text, "job_wait_samples").get(A_WAITS),
                     _rows(text, "job_first_wait_ratio").get(A_WAITS)))
    assert seen[0] == (None, None, 0.3)  # one point: no window yet
    assert seen[1] == (0.3, 960.0, 0.3) and seen[5] == (0.3, 4800.0, 0.3)  # the restart at 3 took nothing back
    assert seen[3][2] == 0.3 and seen[4][2] == 0.3  # the restarted rank has no first look: GPU 0's alone
    # minutes 4-8: GPU 0's rank counted 4 of them (2 at 30%, 2 at 10%), GPU 1's all 5 (2 and 3)
    assert seen[8] == (pytest.approx((4 * 144 + 5 * 48) / 4320), 4320.0, None)
    # minutes 7-11: GPU 0's rank left after 7 (nothing taken back, nothing more added), GPU 1's counted all 5
    assert seen[11] == (pytest.approx(0.1), 480 * 6, None)
    assert all(seen[m][0] > seen[m + 1][0] for m in range(5, 10))  # the window moves past the change
    assert _rows(text, "job_wait_ratio").keys() == {A_WAITS}  # run-b's rank has no stack samples
