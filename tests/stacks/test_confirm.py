"""The second look at a hang (stacks/confirm.py), with real py-spy on a real gloo job: a rank blocked in
its data loader at both looks confirms the hang; a rank that wrote between the looks, or ranks that are
elsewhere at the second look, do not."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from tests.conftest import gloo_job
from watchdog.config import StacksConfig
from watchdog.sample.ranks import Job, RankDiscovery, group_jobs
from watchdog.stacks.capture import StackCapturer
from watchdog.stacks.confirm import confirm
from watchdog.stacks.picture import StackPicture, capture_job

FIRST = StacksConfig(observe_seconds=0.0, flight_recorder=False, nccl_ras=False)
AGAIN = FIRST


def job_of(pids: list[int]) -> Job:
    discovery = RankDiscovery()
    ranks = [r for r in (discovery.describe(pid, (n,)) for n, pid in enumerate(pids)) if r is not None]
    (job,) = group_jobs(ranks)
    return job


def two_looks(pids: list[int], gap: float) -> tuple[StackPicture, StackPicture, float]:
    read_at = time.monotonic()
    job = job_of(pids)
    first = capture_job(job, StackCapturer(), RankDiscovery(), FIRST)
    time.sleep(gap)
    second = capture_job(job, StackCapturer(), RankDiscovery(), AGAIN, read_at=read_at)
    return first, second, time.monotonic() - read_at


def test_a_rank_blocked_at_both_looks_confirms_the_hang(tmp_path: Path) -> None:
    with gloo_job("dataloader", tmp_path, odd_rank=2) as processes:
        first, second, apart = two_looks([p.pid for p in processes], 1.0)
    assert first.verdict.kind == "hang" and not first.verdict.confirmed
    confirmed = confirm(first, second, apart)
    assert confirmed is not None and confirmed.confirmed and confirmed.kind == "hang"
    assert "rank 2" in confirmed.headline and "Queue.get" in confirmed.headline
    assert confirmed.sentence.endswith(f"The same at a second look {apart:.0f} s later, with no rank's I/O moving")
    assert second.observed_seconds >= 1.0  # the second look's host activity counts from the first's reading


def test_a_rank_that_wrote_between_the_looks_is_not_confirmed(tmp_path: Path) -> None:
    """Rank 0 saves a checkpoint slowly while the others wait. Were the first look to catch it between two
    writes (a hang, as far as that look could tell), the second, counting from the first look's reading,
    sees it write: not confirmed."""
    with gloo_job("checkpoint", tmp_path, odd_rank=0) as processes:
        first, second, apart = two_looks([p.pid for p in processes], 1.0)
    caught_idle = replace(first, verdict=replace(first.verdict, kind="hang"))
    assert second.verdict.kind == "waiting", second.verdict.sentence
    assert confirm(caught_idle, second, apart) is None
    # Even a second look that called it a hang is not confirmed: the writer's I/O moved between the looks.
    assert confirm(caught_idle, replace(second, verdict=caught_idle.verdict), apart) is None
    # With the same places at both looks and no I/O, the same pictures confirm it: it was the writes that did not.
    # (The places are the second look's at both: the writer may be caught at another frame at each look.)
    still = {member: replace(h, read_bytes=0, write_bytes=0) for member, h in second.host.items()}
    same = replace(caught_idle, analysis=second.analysis)
    assert confirm(same, replace(second, verdict=caught_idle.verdict, host=still), apart) is not None


def test_ranks_seen_elsewhere_at_the_second_look_are_not_confirmed(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with gloo_job("dataloader", tmp_path / "a", odd_rank=2) as stuck:
        first, _, _ = two_looks([p.pid for p in stuck], 0.0)
    with gloo_job("collective", tmp_path / "b", odd_rank=2) as other:
        _, second, apart = two_looks([p.pid for p in other], 0.0)
    assert first.verdict.kind == second.verdict.kind == "hang"
    assert confirm(first, second, apart) is None
    assert confirm(second, second, apart) is not None  # the same places: confirmed


def test_a_rank_not_captured_at_a_look_leaves_the_hang_unconfirmed(tmp_path: Path) -> None:
    """The rank py-spy could not read may be the one that moves: no confirmation without every rank."""
    with gloo_job("dataloader", tmp_path, odd_rank=2) as processes:
        first, second, apart = two_looks([p.pid for p in processes], 0.5)
    assert confirm(first, second, apart) is not None
    lost = replace(second.captures[1], result="timeout", dump=None)
    assert confirm(first, replace(second, captures=[second.captures[0], lost, *second.captures[2:]]), apart) is None
