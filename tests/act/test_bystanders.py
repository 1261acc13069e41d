"""The real daemon in act mode over a hung GPU shared with processes that are not the hung job's ranks, each
a real process of another user: nothing that is not proven a rank of the hung job is touched, and a job
with a sign of life is left alone, whatever its neighbours look like."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.act.test_actions_policy import summaries, watch
from tests.fakes.daemon import Receiver
from tests.users import ALICE, BOB, shared_folder, user_process


@pytest.fixture
def folder() -> Iterator[Path]:
    with shared_folder() as made:
        yield made


def test_processes_of_two_users_that_are_no_ranks_are_left_alone_and_the_alert_says_why(folder: Path,
                                                                                         tmp_path: Path) -> None:
    receiver = Receiver()
    with user_process(folder, ALICE, ["queue"]) as server, user_process(folder, BOB, ["queue"]) as kernel:
        daemon = watch(tmp_path, server.pid, receiver, mode="act", extra_pids=[kernel.pid])
        assert server.alive() and kernel.alive()
    receiver.close()
    said = [s for s in summaries(receiver) if s.startswith("NOT ACTED (no_target)")]
    assert len(said) == 1, summaries(receiver)
    assert f"pid {server.pid}: not a rank of a launched job" in said[0] and f"pid {kernel.pid}" in said[0]
    assert daemon.counters.snapshot()["actions_total"] == {}


def test_a_checkpointing_rank_beside_an_idle_neighbour_is_left_alone(folder: Path, tmp_path: Path) -> None:
    receiver = Receiver()
    rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "saving"}
    # The proven job's picture leads the episode (it may stay a warning: the rank is busy on the host); where
    # the episode turns critical all the same, the rank's own I/O vetoes the action.
    with user_process(folder, BOB, ["queue"]) as idle, \
            user_process(folder, ALICE, [str(folder)], rank, script="checkpoint_writer.py") as saving:
        daemon = watch(tmp_path, saving.pid, receiver, mode="act", extra_pids=[idle.pid], critical=False)
        assert saving.alive() and idle.alive()
    receiver.close()
    assert daemon.counters.snapshot()["actions_total"] == {}
    states = [*daemon.incidents.open.values(), *(s for _, s in daemon.incidents.resolved)]
    decided = [d for state in states for key, d in state.decisions.items() if key]
    assert all(d.name == "alive" and "moved" in d.reason for d in decided), decided
    assert not any(s.startswith("ACTED") for s in summaries(receiver))


def test_a_claimed_run_id_gets_no_process_killed(folder: Path, tmp_path: Path) -> None:
    """ALICE's idle process claims the run id of BOB's hung rank on the same GPU, each under a launcher of its
    own user: the name says nothing about which of them hangs, so neither is ended and the alert says why."""
    receiver = Receiver()
    claim = {"LOCAL_RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "victimrun"}
    with user_process(folder, ALICE, ["queue"], {**claim, "RANK": "0"}) as claimant, \
            user_process(folder, BOB, ["queue"], {**claim, "RANK": "1"}) as victim:
        daemon = watch(tmp_path, claimant.pid, receiver, mode="act", extra_pids=[victim.pid])
        assert victim.alive() and claimant.alive(), "a process was ended on a claimed name"
    receiver.close()
    [state] = [*daemon.incidents.open.values(), *(s for _, s in daemon.incidents.resolved)]
    assert sorted(d.name for d in state.decisions.values()) == ["conflict", "conflict"], state.decisions
    said = [s for s in summaries(receiver) if s.startswith("NOT ACTED (conflict)")]
    assert said and "2 proven jobs on these GPUs claim the name run:victimrun" in said[0], summaries(receiver)
    assert daemon.counters.snapshot()["actions_total"] == {}


def test_one_episode_over_two_hung_jobs_is_two_decisions(folder: Path, tmp_path: Path) -> None:
    """Two users' jobs hung on one GPU: each is proven, decided and ended on its own; the alert says both."""
    receiver = Receiver()
    with user_process(folder, ALICE, ["queue"], {"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "a"}) as one, \
            user_process(folder, BOB, ["queue"], {"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "b"}) as two:
        daemon = watch(tmp_path, one.pid, receiver, mode="act", extra_pids=[two.pid])
        assert not one.alive() and not two.alive()
    receiver.close()
    [acted] = [s for s in summaries(receiver) if s.startswith("ACTED")]
    assert "of job run:a (" in acted and " / ACTED: terminated rank 0 of job run:b (" in acted, acted
    assert daemon.counters.get("actions_total", "terminate_ranks", "done") == 2
