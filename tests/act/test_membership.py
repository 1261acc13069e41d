"""Who an action may touch (act/membership.py), over real processes of other users: a job is proven by what
a process cannot choose (its launcher, slurmstepd's cgroup confirmed by Slurm, the kubelet's allocation
with its own pod cgroup), never by the variables it sets."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.users import ALICE, BOB, shared_folder, user_process
from watchdog.act import membership
from watchdog.sample.ranks import Parent, RankDiscovery, RankInfo
from watchdog.vocabulary.model import Workload

LAUNCHED = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    with shared_folder() as made:
        yield made


def confirms_nothing(job: str, uid: int) -> str | None:
    return "no Slurm here"


def describe(*pids: int) -> list[RankInfo]:
    discovery = RankDiscovery()
    found = [discovery.describe(pid, (0,)) for pid in pids]
    assert all(r is not None for r in found)
    return [r for r in found if r is not None]


def test_processes_that_no_launcher_started_as_ranks_are_never_targets(folder: Path) -> None:
    """An idle inference server and a notebook kernel of two users, no launcher variables: left alone."""
    with user_process(folder, ALICE, ["queue"]) as server, user_process(folder, BOB, ["queue"]) as kernel:
        jobs, left = membership.prove(describe(server.pid, kernel.pid), time.time(), confirms_nothing)
    assert jobs == []
    assert {a.rank.pid for a in left} == {server.pid, kernel.pid}
    assert all("not a rank of a launched job" in a.why for a in left)


def test_a_claimed_run_id_does_not_join_another_users_job(folder: Path) -> None:
    """ALICE's process claims BOB's TORCHELASTIC_RUN_ID: two jobs, proven by two launchers."""
    claim = {**LAUNCHED, "TORCHELASTIC_RUN_ID": "victimrun"}
    with user_process(folder, BOB, ["queue"], {**claim, "RANK": "1"}) as victim, \
            user_process(folder, ALICE, ["queue"], claim) as attacker:
        ranks = describe(victim.pid, attacker.pid)
        assert {r.job_key for r in ranks} == {"run:victimrun"}  # the claim alone would make them one job
        jobs, left = membership.prove(ranks, time.time(), confirms_nothing)
    assert left == [] and len(jobs) == 2
    assert sorted([r.pid for r in job.ranks] for job in jobs) == sorted([[victim.pid], [attacker.pid]])
    assert {job.durable.rsplit(":", 1)[0] for job in jobs} == {f"command:{BOB}", f"command:{ALICE}"}
    assert all(job.name().startswith("run:victimrun (started by pid ") for job in jobs)


def test_a_process_whose_parent_is_another_user_or_started_after_the_hang_is_left_alone(folder: Path) -> None:
    with user_process(folder, ALICE, ["queue"], LAUNCHED, launched=False) as adopted:
        [rank] = describe(adopted.pid)
        assert rank.parent is not None and rank.parent.uid == 0 and rank.uid == ALICE
        jobs, left = membership.prove([rank], time.time(), confirms_nothing)
        assert jobs == [] and "runs as another user" in left[0].why
    with user_process(folder, ALICE, ["queue"], LAUNCHED) as late:
        [rank] = describe(late.pid)
        jobs, left = membership.prove([rank], rank.create_time - 5, confirms_nothing)
        assert jobs == [] and left[0].why == "started after the hang began"
        jobs, left = membership.prove([rank], rank.create_time + 5, confirms_nothing)
        assert [j.ranks for j in jobs] == [(rank,)] and jobs[0].workload == Workload()


@pytest.mark.parametrize(("cgroup", "uid", "job"), [
    ("6:freezer:/slurm_vm/uid_0/job_1/step_batch\n", 0, "1"),  # cgroup v1, as tests/slurm.py's Slurm makes it
    ("4:memory:/slurm/uid_1001/job_4242/step_0/task_0\n", 1001, "4242"),
    ("0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0\n", 1001, "4242"),  # cgroup v2
    ("4:memory:/slurm/uid_1001/job_4242/step_0\n", 1002, None),  # another user's uid in the path
    ("0::/user.slice/user-1001.slice/user@1001.service/app.slice/job_4242.slice\n", 1001, None),  # delegated
    ("0::/user.slice/user-1001.slice/user@1001.service/app.slice/job_4242.scope\n", 1001, None),
    ("0::/docker/job_5.scope\n", 0, None),
    ("0::/system.slice/slurmstepd.scope/job_04242/step_0\n", 1001, None),  # leading zeros name no job
    ("0::/mine/system.slice/slurmstepd.scope/job_4242/step_0\n", 1001, None),  # not at the root
    ("4:memory:/user.slice/slurm/uid_1001/job_4242/step_0\n", 1001, None),
])
def test_only_slurmstepds_own_hierarchy_names_a_slurm_job(cgroup: str, uid: int, job: str | None) -> None:
    assert membership.slurm_cgroup(cgroup, uid) == job


def rank_in(cgroup: str, workload: Workload, uid: int = ALICE) -> RankInfo:
    """A described rank as RankDiscovery makes it (the kernel's and the kubelet's fields set by hand)."""
    return RankInfo(4242, 1.0, ("python", "train.py"), (0,), LAUNCHED, None, workload=workload, uid=uid,
                    parent=Parent(4000, 0.5, uid), cgroup=cgroup)


def test_a_slurm_job_is_proven_only_when_slurm_confirms_it() -> None:
    cgroup = "0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0\n"
    asked: list[tuple[str, int]] = []

    def slurm(job: str, uid: int) -> str | None:
        asked.append((job, uid))
        return None if uid == ALICE else f"Slurm says job {job} runs as bob(1002), not as uid {uid}"

    [job], _ = membership.prove([rank_in(cgroup, Workload(slurm_job_id="4242"))], 2.0, slurm)
    assert job.key == "slurm:4242" and job.durable == "slurm:4242" and job.workload.slurm_job_id == "4242"
    [job], _ = membership.prove([rank_in(cgroup, Workload(slurm_job_id="4242"), uid=BOB)], 2.0, slurm)
    assert job.key.startswith("launcher:") and job.workload.slurm_job_id is None  # its launcher, not the job
    assert asked == [("4242", ALICE), ("4242", BOB)]


def test_a_pod_is_proven_by_the_kubelet_and_the_process_own_pod_cgroup() -> None:
    uid = "0f8a3c2e-1b2d-4e5f-8a9b-0c1d2e3f4a5b"
    held = Workload(namespace="ml", pod="trainer-0", container="main")  # the kubelet's answer for GPU 0
    inside = f"0::/kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice/cri-containerd-abc.scope\n"
    [job], _ = membership.prove([rank_in(inside, held)], 2.0, confirms_nothing)
    assert job.key == f"pod:{uid}" and job.pod_uid == uid and job.workload.pod == "trainer-0"
    assert job.durable.startswith(f"pod:ml:{ALICE}:")
    # A process of another pod (another user, another command) on the same GPU: another job, with a ledger key
    # of its own, so acting on it never holds the first pod's job in its cooldown.
    elsewhere = dataclasses.replace(rank_in(inside.replace("0f8a3c2e", "1f8a3c2e"), held, uid=BOB), pid=4243,
                                    cmdline=("python", "serve.py"))
    jobs, _ = membership.prove([rank_in(inside, held), elsewhere], 2.0, confirms_nothing)
    assert len(jobs) == 2 and {j.pod_uid for j in jobs} == {uid, "1" + uid[1:]}
    assert len({j.durable for j in jobs}) == 2
    # A process outside any pod on a GPU the kubelet gave to a pod: not that pod's; its launcher's at most.
    [job], _ = membership.prove([rank_in("0::/user.slice/user-1001.slice/session-3.scope\n", held)], 2.0,
                                confirms_nothing)
    assert job.key.startswith("launcher:") and job.workload.pod is None and job.pod_uid is None
    # A pod the rank's own HOSTNAME claims is no pod at all.
    claimed = Workload(namespace="ml", pod="trainer-0", claimed=("namespace", "pod"))
    [job], _ = membership.prove([rank_in(inside, claimed)], 2.0, confirms_nothing)
    assert job.workload.pod is None


def test_a_relaunch_under_a_new_run_id_is_the_same_job_for_the_ledger() -> None:
    """The ledger keys on what survives a relaunch (the user and the command line), not the claimed run id:
    a job that comes back under a new TORCHELASTIC_RUN_ID is still deterministic."""
    first = dataclasses.replace(rank_in("0::/user.slice\n", Workload()),
                                env={**LAUNCHED, "TORCHELASTIC_RUN_ID": "llm-1"})
    again = dataclasses.replace(first, pid=5000, parent=Parent(4900, 9.0, ALICE),
                                env={**LAUNCHED, "TORCHELASTIC_RUN_ID": "llm-2"})
    other = dataclasses.replace(again, uid=BOB, parent=Parent(4900, 9.0, BOB))
    [[before], [after], [bob]] = [membership.prove([r], 20.0, confirms_nothing)[0] for r in (first, again, other)]
    assert before.key != after.key and before.durable == after.durable != bob.durable


def test_a_relaunch_with_new_arguments_is_the_same_program_for_the_ledger() -> None:
    """A scheduler that relaunches a job with a new run id in its arguments (an output folder, --run-id) runs
    the same program: the ledger knows it by the user and the script or module, not the arguments; another
    script or another user is another job. A Slurm job is also known by its program, so a new sbatch of it
    (a new job id) is held by an action on the old one."""
    def launched(*argv: str, uid: int = ALICE) -> str:
        rank = dataclasses.replace(rank_in("0::/user.slice\n", Workload(), uid=uid), cmdline=argv)
        [job], _ = membership.prove([rank], 20.0, confirms_nothing)
        return job.durable

    first = launched("/usr/bin/python3", "-u", "train.py", "--out", "runs/r1", "--run-id", "r1")
    assert launched("/opt/venv/bin/python3.11", "-u", "train.py", "--out", "runs/r2") == first
    assert launched("python", "-W", "ignore", "train.py", "runs/r3") == first  # an option's argument is no script
    assert launched("python", "-m", "pkg.train", "a") == launched("python", "-mpkg.train", "b")
    assert len({first, launched("python", "eval.py", "--out", "runs/r1"), launched("python", "-m", "pkg.train"),
                launched("python", "train.py", uid=BOB)}) == 4
    assert launched("/opt/bin/trainer", "--seed", "1") == launched("/opt/bin/trainer", "--seed", "2")
    slurm = "0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0\n"
    [job], _ = membership.prove([rank_in(slurm, Workload(slurm_job_id="4242"))], 2.0, lambda job, uid: None)
    [again], _ = membership.prove([rank_in(slurm.replace("4242", "4300"), Workload(slurm_job_id="4300"))], 2.0,
                                  lambda job, uid: None)
    assert job.ledger_keys[0] == "slurm:4242" and again.ledger_keys[0] == "slurm:4300"
    assert job.ledger_keys[1:] == again.ledger_keys[1:] == (launched("python", "train.py"),)
    assert launched("python", "./train.py") == launched("python", "train.py")
    # A job of 300 ranks each running its own script is still two keys: one action never floods the ledger.
    many = [dataclasses.replace(rank_in(slurm, Workload(slurm_job_id="4242")), pid=5000 + n,
                                env={**LAUNCHED, "RANK": str(n)}, cmdline=("python", f"/tmp/x/s{n}.py"))
            for n in range(300)]
    [big], _ = membership.prove(many, 2.0, lambda job, uid: None)
    assert len(big.ranks) == 300 and len(big.ledger_keys) == 2
    # Two pods of one namespace and user, one script with their own arguments: two jobs to the ledger.
    inside = "0::/kubepods.slice/kubepods-pod0f8a3c2e_1b2d_4e5f_8a9b_0c1d2e3f4a5b.slice/cri-containerd-abc.scope\n"
    held = Workload(namespace="ml", pod="trainer-0", container="main")
    pods = [membership.prove([dataclasses.replace(rank_in(inside, held), cmdline=("python", "train.py", "--cfg", cfg))],
                             2.0, confirms_nothing)[0][0] for cfg in ("a", "b")]
    assert pods[0].key.startswith("pod:") and pods[0].durable != pods[1].durable


def test_the_launchers_restarts_are_read_and_only_from_the_ranks_it_restarted() -> None:
    rank = rank_in("0::/user.slice\n", Workload())
    [job], _ = membership.prove([rank], 20.0, confirms_nothing)
    assert job.restarted() is None
    restarted = dataclasses.replace(rank, create_time=7.0, env={**LAUNCHED, "TORCHELASTIC_RESTART_COUNT": "2"})
    first = dataclasses.replace(rank, pid=4243, env={**LAUNCHED, "TORCHELASTIC_RESTART_COUNT": "0"})
    [job], _ = membership.prove([restarted, first], 20.0, confirms_nothing)
    assert job.restarted() == (2, 1.0)  # the ranks here started at 1.0 at the earliest
    requeued = dataclasses.replace(rank, env={**LAUNCHED, "SLURM_RESTART_COUNT": "1"})
    [job], _ = membership.prove([requeued], 20.0, confirms_nothing)
    assert job.restarted() == (1, 1.0)
    for junk in ("-1", "x", "\u00b2"):
        [job], _ = membership.prove([dataclasses.replace(rank, env={**LAUNCHED, "TORCHELASTIC_RESTART_COUNT": junk})],
                                    20.0, confirms_nothing)
        assert job.restarted() is None, junk


def test_two_proven_jobs_that_claim_one_name_are_a_conflict() -> None:
    claim = {**LAUNCHED, "TORCHELASTIC_RUN_ID": "victimrun"}
    alice = dataclasses.replace(rank_in("0::/user.slice\n", Workload()), env=claim)
    bob = dataclasses.replace(alice, pid=5000, uid=BOB, parent=Parent(4900, 0.7, BOB))
    other = dataclasses.replace(bob, pid=5001, parent=Parent(4950, 0.8, BOB),
                                env={**LAUNCHED, "TORCHELASTIC_RUN_ID": "b"})
    jobs, _ = membership.prove([alice, bob, other], 20.0, confirms_nothing)
    found = membership.conflicts(jobs)
    assert len(jobs) == 3 and len(found) == 2, found
    assert all("2 proven jobs on these GPUs claim the name run:victimrun" in why for why in found.values())
    # The same claim from another GPU, or from the same user (two launchers of one run, a pod per GPU), holds
    # nobody's action.
    elsewhere = dataclasses.replace(bob, gpus=(5,))
    jobs, _ = membership.prove([alice, elsewhere], 20.0, confirms_nothing)
    assert len(jobs) == 2 and membership.conflicts(jobs) == {}
    own = dataclasses.replace(bob, uid=ALICE, parent=Parent(4900, 0.7, ALICE))
    jobs, _ = membership.prove([alice, own], 20.0, confirms_nothing)
    assert len(jobs) == 2 and membership.conflicts(jobs) == {}
    bare = {"RANK": "0", "WORLD_SIZE": "1"}  # no job name claimed at all: nothing to conflict over
    jobs, _ = membership.prove([dataclasses.replace(alice, env=bare), dataclasses.replace(bob, env=bare)], 20.0,
                               confirms_nothing)
    assert len(jobs) == 2 and membership.conflicts(jobs) == {}
