"""Which pod or Slurm job a rank is: from real processes started with Slurm's variables, and from the
cgroup paths Slurm and the kubelet write (cgroup v1 and v2, cgroupfs and systemd drivers)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from tests.users import asleep
from watchdog.sample import workload
from watchdog.sample.ranks import RankDiscovery
from watchdog.vocabulary.model import Workload

POD = "0f3c1e2a-7b5d-4c9e-8a1f-2b3c4d5e6f70"
CID = "a" * 64


@pytest.fixture
def slurm_rank() -> Iterator[subprocess.Popen[bytes]]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    env.update({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_JOB_USER": "alice", "SLURM_PROCID": "3",
                "WORLD_SIZE": "16", "LOCAL_RANK": "3"})
    with asleep(env) as process:
        yield process


def test_a_real_process_started_by_slurm_is_named_by_its_job(slurm_rank: subprocess.Popen[bytes]) -> None:
    info = RankDiscovery().describe(slurm_rank.pid)
    assert info is not None
    assert info.workload.slurm_job_id == "4242" and info.workload.slurm_step == "0"
    assert info.workload.slurm_user == "alice"
    assert info.rank == 3 and info.job_key == "slurm:4242"
    assert "Slurm job 4242 step 0 (user alice)" in info.workload.describe()
    assert RankDiscovery().scan() and any(r.pid == slurm_rank.pid and r.workload.slurm_job_id == "4242"
                                          for r in RankDiscovery().scan())


@pytest.mark.parametrize(("cgroup", "expected"), [
    ("12:devices:/slurm/uid_1000/job_4242/step_0/task_3\n", Workload(slurm_job_id="4242", slurm_step="0",
                                                                     slurm_user="uid 1000")),
    ("0::/system.slice/slurmstepd.scope/job_99/step_batch/user/task_0\n", Workload(slurm_job_id="99",
                                                                                 slurm_step="batch")),
    ("0::/system.slice/slurmstepd.scope/job_99/step_extern/slurm_processes\n",
     Workload(slurm_job_id="99", slurm_step="extern")),
    ("0::/system.slice/slurmstepd.scope/job_7\n", Workload(slurm_job_id="7")),
    ("0::/user.slice/user-1000.slice/session-3.scope\n", Workload()),
    # a cgroup a user made (a delegated subtree, a container's scope) or a spelling slurmstepd never uses
    ("0::/user.slice/user-1001.slice/user@1001.service/app.slice/job_4242.slice\n", Workload()),
    ("0::/user.slice/user-1001.slice/user@1001.service/app.slice/job_4242.scope\n", Workload()),
    ("0::/docker/job_5.scope\n", Workload()),
    ("0::/system.slice/slurmstepd.scope/job_04242/step_0\n", Workload()),
    ("0::/\n", Workload()),
    ("", Workload()),
])
def test_slurm_from_the_cgroup_path(cgroup: str, expected: Workload) -> None:
    assert workload.slurm({}, cgroup) == expected


def test_the_cgroup_wins_over_what_the_environment_claims() -> None:
    """A rank may set SLURM_JOB_ID to another job's id: the kernel's cgroup says which job it is in."""
    lying = workload.slurm({"SLURM_JOB_ID": "5", "SLURM_JOB_USER": "bob"}, "0::/slurmstepd.scope/job_6/step_1\n")
    assert lying == Workload(slurm_job_id="6", slurm_step="1") and lying.claimed == ()
    agreeing = workload.slurm({"SLURM_JOB_ID": "6", "SLURM_JOB_USER": "bob"}, "0::/slurmstepd.scope/job_6/step_1\n")
    assert agreeing == Workload(slurm_job_id="6", slurm_step="1", slurm_user="bob")
    alone = workload.slurm({"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0"}, "0::/user.slice/session-3.scope\n")
    assert alone == Workload(slurm_job_id="5", slurm_step="0") and alone.claimed == ("slurm_job_id", "slurm_step")
    assert alone.to_json()["claimed_by_environment"] == ["slurm_job_id", "slurm_step"]
    assert alone.describe() == "Slurm job 5 step 0 (as its environment says)"


@pytest.mark.parametrize("cgroup", [
    f"11:memory:/kubepods/burstable/pod{POD}/{CID}\n",  # cgroupfs driver, v1
    f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD.replace('-', '_')}.slice/"
    f"cri-containerd-{CID}.scope\n",  # systemd driver, v2
    f"0::/../../kubepods-burstable-pod{POD.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n",  # cgroupns view
    f"0::/kubepods/pod{POD}/{CID}\n",  # guaranteed QoS
])
def test_a_pod_from_the_cgroup_path(cgroup: str) -> None:
    assert workload.pod_uid(cgroup) == POD
    env = {"HOSTNAME": "trainer-0", "POD_NAMESPACE": "ml"}
    assert workload.pod_from_cgroup(env, cgroup) == Workload(namespace="ml", pod="trainer-0")
    assert workload.pod_from_cgroup({"HOSTNAME": "h", "POD_NAME": "trainer-1"}, cgroup).pod == "trainer-1"


def test_hostname_outside_a_pod_is_not_a_pod() -> None:
    assert workload.pod_from_cgroup({"HOSTNAME": "gpu-node-7"}, "0::/user.slice/session-1.scope\n") == Workload()


@pytest.mark.parametrize("value", ["a\nb", "x" * 300, "", "tab\there"])
def test_values_unfit_for_a_label_are_dropped(value: str) -> None:
    assert workload.slurm({"SLURM_JOB_ID": "1", "SLURM_JOB_USER": value}, "").slurm_user is None


def test_common_keeps_what_every_rank_says_alike() -> None:
    a = Workload("ml", "trainer-0", "main", "42", "0", "alice")
    b = Workload("ml", "trainer-1", "main", "42", "0", "alice")
    assert workload.common([a, b]) == Workload("ml", None, "main", "42", "0", "alice")
    assert workload.common([]) == Workload()
    assert workload.merged(Workload(pod="p"), Workload(pod="q", namespace="n")) == Workload(namespace="n", pod="p")
    assert not Workload() and Workload(slurm_job_id="1")
