"""A real single-node Slurm on loopback: munged, slurmctld and slurmd (Debian's slurm-wlm and munge), with
a configuration of its own in a temporary folder, its own ports and munge socket, so it never meets a
cluster the machine may belong to. Jobs run in Slurm's own cgroups (proctrack/cgroup): a rank's cgroup
names its job as on a real cluster. Its Prolog and Epilog are deploy/slurm's scripts (behind a wrapper
that notes each run). `.ci/run` installs the packages; without them a test is skipped, in CI it fails.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO, TARGETS, need_tool
from tests.fakes.loopback import free_port

SLURM_DEPLOY = REPO / "deploy" / "slurm"


@dataclass
class Slurm:
    folder: Path
    node: str
    env: dict[str, str]  # SLURM_CONF and PATH, for sbatch, scontrol and the daemon's actions

    def run(self, *argv: str, check: bool = True) -> str:
        done = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=30)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as key=value pairs."""
        return _pairs(self.run("scontrol", "show", "job", job_id, "--oneliner"))

    def node_state(self) -> dict[str, str]:
        shown = self.run("scontrol", "show", "node", self.node, "--oneliner")
        pairs = _pairs(shown.split(" Reason=", 1)[0])
        if " Reason=" in shown:
            pairs["Reason"] = shown.split(" Reason=", 1)[1].strip()
        return pairs

    def wait_job(self, job_id: str, states: tuple[str, ...], seconds: float = 60) -> dict[str, str]:
        """The job as shown once its state is one of `states`; an assertion error after `seconds`."""
        deadline = time.monotonic() + seconds
        while True:
            shown = self.job(job_id)
            if shown.get("JobState") in states:
                return shown
            assert time.monotonic() < deadline, f"job {job_id} is {shown.get('JobState')}, not one of {states}"
            time.sleep(0.5)


def _pairs(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split() if "=" in item)


@contextmanager
def slurm_cluster(folder: Path) -> Iterator[Slurm]:
    """One at a time on the machine, across test workers: two clusters' slurmd share the node's cgroup tree
    (`/slurm/uid_0/job_<id>`), and both number their jobs from 1, so one's cleanup would kill the other's ranks."""
    for tool in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol"):
        need_tool(tool)
    with open(Path(tempfile.gettempdir()) / "stall-watchdog-tests-slurm.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with _cluster(folder) as slurm:
            yield slurm


@contextmanager
def _cluster(folder: Path) -> Iterator[Slurm]:
    if not Path("/etc/munge/munge.key").exists():
        subprocess.run(["mungekey", "--create"], check=True, capture_output=True)
    node = socket.gethostname().split(".")[0]
    folder.mkdir(parents=True, exist_ok=True)
    for sub in ("state", "spool"):
        (folder / sub).mkdir(exist_ok=True)
    venv_bin = str(Path(sys.executable).parent)
    wrapper = {}
    for script in ("prolog", "epilog"):
        path = folder / f"{script}.sh"
        path.write_text(f"#!/bin/sh\necho \"$SLURM_JOB_ID\" >> {folder}/{script}.ran\n"
                        f"export PATH={venv_bin}:$PATH STALL_WATCHDOG_URL=$(cat {folder}/daemon-url 2>/dev/null)\n"
                        f"exec /bin/sh {SLURM_DEPLOY / (script + '.sh')}\n")
        path.chmod(0o755)
        wrapper[script] = path
    (folder / "slurm.conf").write_text(f"""ClusterName=stallwatchdog
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={folder}/munge.sock
CredType=cred/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
ProctrackType=proctrack/cgroup
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
Prolog={wrapper['prolog']}
Epilog={wrapper['epilog']}
NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 2} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
""")
    (folder / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n"
                                        "ConstrainCores=no\nConstrainRAMSpace=no\nConstrainDevices=no\n")
    env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}
    started = []
    try:
        started.append(subprocess.Popen(
            ["munged", "-F", f"--socket={folder}/munge.sock", f"--pid-file={folder}/munged.pid",
             f"--log-file={folder}/munged.log", f"--seed-file={folder}/munge.seed", "--force"], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 60
        while not (folder / "munge.sock").exists():
            assert time.monotonic() < deadline, "munged did not start"
            time.sleep(0.1)
        for daemon in ("slurmctld", "slurmd"):
            started.append(subprocess.Popen([shutil.which(daemon) or daemon, "-D", "-f", str(folder / "slurm.conf")],
                                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        slurm = Slurm(folder, node, env)
        deadline = time.monotonic() + 30
        while "idle" not in slurm.run("sinfo", "-h", "-o", "%T", check=False):
            assert all(p.poll() is None for p in started), f"Slurm did not start: see {folder}/slurmctld.log"
            assert time.monotonic() < deadline, f"the node never became idle: see {folder}/slurmd.log"
            time.sleep(0.3)
        yield slurm
    finally:
        subprocess.run(["scancel", "--full", "--quiet", "--user", "root"], env=env, capture_output=True, timeout=30)
        time.sleep(1)
        for process in reversed(started):
            process.terminate()
        for process in started:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def hung_job(slurm: Slurm, tmp: Path) -> tuple[str, int]:
    """A batch job whose one rank blocks in its data loader: (job id, the rank's pid)."""
    pidfile, ready = tmp / "pid", tmp / "ready"
    script = tmp / "job.sh"
    script.write_text(f"#!/bin/sh\necho $$ > {pidfile}\nexport RANK=0 WORLD_SIZE=1 LOCAL_RANK=0\n"
                      f"exec {sys.executable} {TARGETS / 'stuck.py'} queue {ready}\n")
    script.chmod(0o755)
    job = slurm.run("sbatch", "--parsable", "--requeue", "-o", "/dev/null", str(script)).strip()
    deadline = time.monotonic() + 180  # a loaded machine: slurmctld's scheduling, then the rank's start
    while not ready.exists():
        assert time.monotonic() < deadline, f"job {job} did not start: {slurm.job(job)}"
        time.sleep(0.2)
    ready.unlink()
    return job, int(pidfile.read_text())
