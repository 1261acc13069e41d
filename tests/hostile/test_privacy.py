"""Hostile privacy cases: secrets in a rank's command line and environment, a dump asked while another user's
processes claim the job, an NCCL RAS port answered by someone else, and a held action's record over a week."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from tests.fakes.daemon import daemon_config
from tests.fakes.nccl_ras import FakeRank, json_report
from tests.users import ALICE, BOB, described, shared_folder, user_process
from watchdog.act.bundles import MAX_ACTION_RECORDS, Incident
from watchdog.boundary.secrets import REDACTED, redact_arguments, redact_variable
from watchdog.config import StacksConfig
from watchdog.sample.ranks import RankDiscovery, job_of
from watchdog.service import build
from watchdog.stacks import nccl_ras, ras_report
from watchdog.stacks.capture import StackCapturer
from watchdog.stacks.picture import capture_job
from watchdog.vocabulary.model import EpisodeEvent, EventKind, GpuSample, NodeSnapshot, Severity, Signature

S = "SeCrEt0x"  # every form below hides this; nothing else of the command line is lost

# Forms of a secret on a command line: those seen in training launch lines, CLIs and URLs.
ARGUMENT_FORMS = [
    ["--data", f"s3://AKIA:{S}@bucket/x"], ["--auth", f"user:{S}"], ["-p", S], [f"--wandb-key={S}"],
    [f"--passphrase={S}"], ["--db", f"postgres://u:{S}@h/db"], ["--hf-token", S], [f"HF_TOKEN={S}"],
    ["--cache", f"redis://:{S}@h:6379/0"], [f"--mysql-pwd={S}"], [f"--bearer={S}"], [f"--jwt={S}"],
    [f"--signature={S}"], [f"--cookie=session={S}"], ["-H", f"Authorization: Bearer {S}"],
    ["--header", f"Cookie: a={S}"], [f"--token:{S}"], [f"-p{S}"], ["--db", f"admin:{S}@db.example:5432"],
    ["--api-key", S], [f"--password={S}"], ["--secret", S], ["--access-key", S], [f"--private-key={S}"],
    ["--credentials", S], [f"WANDB_API_KEY={S}"], ["--aws-secret-access-key", S], ["--pw", S],
    [f"--github-token={S}"], ["--key", S], ["--auth-header", f"Bearer {S}"], ["-H", f"X-Api-Key: {S}"],
    ["--url", f"https://user:{S}@host.example/path"], ["--proxy", f"http://u:{S}@proxy:3128"],
    ["--url", f"https://bucket.s3.amazonaws.com/x?X-Amz-Signature={S}&X-Amz-Date=20261126"],
    ["--url", f"https://api.example/v1?access_token={S}"], ["--client-secret", S],
    # the nine that survived (issue 40)
    [f"-P{S}"],
    ["--blob", f"https://acct.blob.core.windows.net/c/x?sv=2022-11-02&sp=r&sig={S}%3D"],
    [f"--header=Authorization: Bearer {S}"], [f"-HAuthorization: Bearer {S}"], ["--gh-pat", S], ["--license", S],
    ["--session", S], ["--hmac", S], ["--notify", f"https://hooks.slack.com/services/T0AAA/B0BBB/{S}"],
    # tokens known by their shape, wherever they stand
    [f"ghp_{S}abcdefghijklmnopqrstu"], ["--repo-url", f"https://x:{S}@github.com/o/r.git"],
    ["--webhook", f"https://discord.com/api/webhooks/123/{S}"],
    # the forms that survived round 4's review: user:password joined to an option, curl's user options, a bare
    # --pass, openssl's password arguments, credential headers by their name, an Azure connection string
    [f"--master-addr=alice:{S}@10.0.0.1"], ["-u", f"alice:{S}"], ["--user", f"alice:{S}"],
    [f"--proxy-user=alice:{S}"], [f"-ualice:{S}"], ["-U", f"alice:{S}"], ["-u", f"sk_live_{S}:"],
    ["--pass", S], ["-pass", f"pass:{S}"], ["-passin", f"pass:{S}"], ["-passout", f"env:{S}"],
    ["-H", f"api-key: {S}"], ["-H", f"X-Vault-Token: {S}"], ["-H", f"X-Amz-Security-Token: {S}"],
    ["-H", f"Ocp-Apim-Subscription-Key: {S}"],
    ["--conn", f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={S}==;EndpointSuffix=core.windows.net"],
]


def test_the_table_has_at_least_forty_forms() -> None:
    assert len(ARGUMENT_FORMS) >= 40


@pytest.mark.parametrize("argv", ARGUMENT_FORMS, ids=lambda argv: " ".join(argv).replace(S, "S")[:40])
def test_each_form_of_a_secret_argument_is_redacted(argv: list[str]) -> None:
    kept = redact_arguments(["train.py", *argv, "--lr", "0.1"])
    assert S not in " ".join(kept) and REDACTED in " ".join(kept) and kept[-2:] == ("--lr", "0.1")
    assert len(kept) == len(argv) + 3


@pytest.mark.parametrize("argv", [["--tokenizer", "gpt2"], ["--lr", "0.1"], ["-P3306"], ["--patience", "5"],
                                  ["--data", "s3://bucket/x?versionId=7"], ["--master-addr", "node-1"],
                                  ["--session-dir", "/runs/a"], ["-Hv"], ["python", "-u", "train.py"],
                                  ["sudo", "-u", "alice", "id"], ["-H", "Content-Type: application/json"],
                                  ["--user", "1000:1000"], ["--nccl-bypass", "1"], ["-uroot"],
                                  ["--data", "s3://bucket/x", "--master-addr=node-1:29500"],
                                  ["pip", "install", "-U", "https://host/x.whl"], ["--conn", "AccountName=acct"]])
def test_plain_arguments_are_kept(argv: list[str]) -> None:
    assert redact_arguments(argv) == tuple(argv)


# Variables whose value is a secret by their name, or holds one inside it
SECRET_VARIABLES = {
    "REDIS_PASS": S, "SSHPASS": S, "RCLONE_CONFIG_S3_PASS": S, "ACCOUNTKEY": S, "AZURE_STORAGE_KEY": S,
    "AZURE_STORAGE_CONNECTION_STRING": f"DefaultEndpointsProtocol=https;AccountName=a;AccountKey={S}==;"
                                       "EndpointSuffix=core.windows.net",
    "SERVICEBUS": f"AccountKey={S};AccountName=a", "MASTER_ADDR": f"alice:{S}@host",
    "DATABASE_URL": f"postgres://alice:{S}@db/x", "CONN": f"Server=db;Database=x;User Id=alice;Password={S};",
}


@pytest.mark.parametrize("name", SECRET_VARIABLES)
def test_each_secret_variable_is_redacted(name: str) -> None:
    kept = redact_variable(name, SECRET_VARIABLES[name])
    assert S not in kept and REDACTED in kept


@pytest.mark.parametrize(("name", "value"), [("NCCL_SOCKET_IFNAME", "eth0"), ("NCCL_P2P_BYPASS", "1"),
                                             ("MASTER_ADDR", "node-1"), ("NCCL_IB_HCA", "mlx5_0:1")])
def test_plain_variables_are_kept(name: str, value: str) -> None:
    assert redact_variable(name, value) == value


# Variables a rank's environment keeps for diagnosis (launch, NCCL, Torch), with credentials inside
VARIABLE_FORMS = {
    "MASTER_ADDR": f"trainer:{S}@node-1",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"https://u:{S}@store.example/nccl_trace_rank_",
    "NCCL_NET_PLUGIN_CONFIG": f'{{"endpoint": "fabric", "key": "{S}"}}',
    "NCCL_IB_AUTH_TOKEN": S,
    "TORCH_FR_DUMP_TEMP_FILE": f"https://store.example/fr?sig={S}",
}


def test_a_real_ranks_command_line_and_environment_keep_no_credential() -> None:
    """What a bundle and a dump keep of a rank (RankDiscovery.describe): every argument form at once, and the
    variables whose values hold a credential in their middle."""
    argv = [arg for form in ARGUMENT_FORMS for arg in form]
    info = described(argv, {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "29500", "NCCL_DEBUG": "WARN",
                            **VARIABLE_FORMS})
    text = " ".join(info.cmdline) + " " + " ".join(f"{k}={v}" for k, v in info.env.items()) + " " + info.job_key
    assert S not in text
    assert info.env["MASTER_ADDR"] == f"trainer:{REDACTED}@node-1" and info.env["NCCL_DEBUG"] == "WARN"
    assert info.env["NCCL_NET_PLUGIN_CONFIG"] == REDACTED
    assert len(info.cmdline) == 3 + len(argv)


JOB = {"TORCHELASTIC_RUN_ID": "victim-42", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}


def _ras_picture(rank_pid: int) -> ras_report.RasFinding | None:
    rank = RankDiscovery().describe(rank_pid)
    assert rank is not None and "NCCL_RAS_ADDR" not in rank.env
    cfg = StacksConfig(observe_seconds=0, flight_recorder=False, nccl_ras_gap_seconds=0.2,
                       nccl_ras_timeout_seconds=1.0)
    return capture_job(job_of(rank.job_key, [rank]), StackCapturer.from_config(cfg), RankDiscovery(), cfg).ras


def _report(folder: Path, victim_pid: int) -> Path:
    """Rank 1 of the victim's job behind in AllReduce, in both queries: a conclusive culprit, if believed."""
    path = folder / "report.json"
    path.write_text(json_report([FakeRank(0, "node-a", victim_pid, 0, {"AllReduce": 9}),
                                 FakeRank(1, "node-a", victim_pid + 1, 1, {"AllReduce": 4})]))
    path.chmod(0o644)
    return path


def test_nccl_ras_is_believed_only_from_the_jobs_own_process_on_the_default_port() -> None:
    """Another user listens on localhost:28028 (the default) and answers for a job whose ranks set no
    NCCL_RAS_ADDR: the answer is not the job's (no rank of it holds that socket), so RAS is unknown. The
    same answer from a rank of the job that listens there is believed."""
    port = nccl_ras.DEFAULT_PORT
    with shared_folder() as folder:
        with user_process(folder, ALICE, ["queue"], env={**JOB, "RANK": "0", "LOCAL_RANK": "0"}) as victim:
            report = _report(folder, victim.pid)
            with user_process(folder, BOB, [str(port), str(report)], script="ras_speaker.py"):
                finding = _ras_picture(victim.pid)
            assert finding is not None and finding.culprits == () and not finding.conclusive
            assert finding.problem is not None and "not one of this job's listens on port 28028" in finding.problem
        with user_process(folder, ALICE, [str(port), str(report)], script="ras_speaker.py",
                          env={**JOB, "RANK": "0", "LOCAL_RANK": "0"}) as listening_rank:
            report = _report(folder, listening_rank.pid)
            finding = _ras_picture(listening_rank.pid)
            assert finding is not None and finding.problem is None and finding.culprits == (1,), finding



def test_nccl_ras_is_believed_from_another_rank_of_the_job_its_launcher_started() -> None:
    """A picture of one GPU holds rank 1 alone; the job's RAS listener is rank 0, started by the same launcher
    as the same user: its answer is the job's."""
    port = nccl_ras.DEFAULT_PORT
    with shared_folder() as folder:
        report = _report(folder, 0)
        ready = [folder / "ready-0", folder / "ready-1"]
        script = (f"RANK=0 LOCAL_RANK=0 python3 ras_speaker.py {port} {report} {ready[0]} & "
                  f"RANK=1 LOCAL_RANK=1 python3 stuck.py queue {ready[1]} & wait")
        launcher = subprocess.Popen(["/bin/sh", "-c", script], user=ALICE, group=ALICE, extra_groups=[], cwd=folder,
                                    start_new_session=True, env={"PATH": "/usr/bin:/bin", **JOB})
        try:
            deadline = time.monotonic() + 30
            while not all(r.exists() for r in ready):
                assert time.monotonic() < deadline and launcher.poll() is None, "the job did not start"
                time.sleep(0.05)
            time.sleep(0.2)
            rank1 = next(c.pid for c in psutil.Process(launcher.pid).children() if "stuck.py" in c.cmdline()[1])
            finding = _ras_picture(rank1)
        finally:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert finding is not None and finding.problem is None and finding.culprits == (1,), finding


CLAIMANTS = 3000


@contextlib.contextmanager
def claimants(uid: int, env: dict[str, str], count: int) -> Iterator[subprocess.Popen[bytes]]:
    """`count` /bin/sleep processes of `uid`, each with `env` (the claims of another user's job), started by
    one shell of that user that stays their parent."""
    script = f'i=0; while [ $i -lt {count} ]; do /bin/sleep 600 & i=$((i+1)); done; echo started; wait'
    shell = subprocess.Popen(["/bin/sh", "-c", script], user=uid, group=uid, extra_groups=[], start_new_session=True,
                             env={"PATH": "/usr/bin:/bin", **env}, stdout=subprocess.PIPE, cwd="/")
    try:
        assert shell.stdout is not None and shell.stdout.readline().strip() == b"started"
        yield shell
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()


def test_a_dump_in_scan_mode_answers_for_the_proven_job_only_and_fast(tmp_path: Path) -> None:
    """No GPU lists the job's ranks (scan mode). Another user starts 3,000 processes claiming the victim's job
    and one forged "rank 1": the dump of that job captures the victim's rank alone, says that others claim the
    job, and stays fast (the work per request is bounded, whatever the claimants' number)."""
    config = daemon_config(tmp_path, source={"kind": "sim", "scenario": "spin_hang"},
                           stacks={"observe_seconds": 0.2, "flight_recorder": False, "nccl_ras": False})
    service = build(config)
    daemon = service.daemon
    daemon.tick()
    with shared_folder() as folder, \
            user_process(folder, ALICE, ["queue"], env={**JOB, "RANK": "0", "LOCAL_RANK": "0"}) as victim, \
            claimants(BOB, {**JOB, "RANK": "1", "LOCAL_RANK": "1"}, CLAIMANTS), \
            user_process(folder, BOB, ["queue"], env={**JOB, "RANK": "1", "LOCAL_RANK": "1"}, launched=False) as forged:
        try:
            started = time.process_time()  # the daemon's CPU seconds for the request, every thread's
            dumped = daemon.dumps.handle(json.dumps({"training_job": "run:victim-42"}).encode())
            status, answer = dumped.status, dumped.body
            took = time.process_time() - started
            print(f"\nthe dump took {took:.2f} CPU s with {CLAIMANTS} claimants")
        finally:
            service.close()
    assert status == 200, answer
    jobs = answer["jobs"]
    assert isinstance(jobs, list) and [j["training_job"] for j in jobs] == ["run:victim-42"], jobs
    ranks = jobs[0]["ranks"]
    assert [(r["pid"], r["rank"]) for r in ranks] == [(victim.pid, 0)], ranks
    assert ranks[0]["capture"] == "ok"
    assert forged.pid not in [r["pid"] for job in jobs for r in job["ranks"]]  # the forged rank 1 is no rank
    claims = answer["claimants"]
    assert isinstance(claims, dict) and claims["count"] >= 1, claims
    assert took < 2, f"the dump took {took:.1f} CPU s with {CLAIMANTS} claimants"


class Clock:
    """The handler's monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


WEEK = 7 * 86400.0


def _wait(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# A rank that writes a checkpoint in bursts of random size: a sign of life whose clause (the bytes moved) differs
# at each look.
RESTLESS_WRITER = """
import os, pathlib, random, sys, time
pathlib.Path(sys.argv[-1]).write_text("ready")
chunk = os.urandom(64 * 1024)
with open(pathlib.Path(sys.argv[1]) / f"shard-{os.getpid()}.pt", "wb") as f:
    while True:
        for _ in range(random.randint(1, 64)):
            f.write(chunk)
        f.flush()
        if f.tell() > 64 * 2**20:
            f.seek(0)
        time.sleep(0.05)
"""


def test_a_held_action_is_recorded_once_over_a_simulated_week(tmp_path: Path) -> None:
    """A critical episode whose job keeps a sign of life (a rank writing a checkpoint) holds its action for a
    week, reconsidered all the while: each reconsideration decides `alive` again, each time with another
    clause (the bytes moved). The decision is recorded once, so the bundle's summary and report stay the
    size they had after the first, however long the week (the clock moves a week in steps: a reconsideration
    costs a real capture)."""
    clock = Clock()
    config = daemon_config(tmp_path, source={"kind": "sim", "scenario": "zero_util_hang"},
                           bundles={"capture_stacks": True},
                           stacks={"observe_seconds": 0.3, "flight_recorder": False, "nccl_ras": False,
                                   "confirm_seconds": 0},
                           actions={"mode": "act", "after_seconds": 10, "on_telemetry_only": True,
                                    "pause_file": str(tmp_path / "pause")})
    service = build(config, monotonic=clock)
    daemon = service.daemon
    handler = daemon.incidents
    onset, steps = 1.9e9, 24
    sizes = []
    with shared_folder() as folder:
        (folder / "restless_writer.py").write_text(RESTLESS_WRITER)
        (folder / "restless_writer.py").chmod(0o644)
        with user_process(folder, ALICE, [str(folder)], {**JOB, "RANK": "0", "LOCAL_RANK": "0"},
                          script="restless_writer.py") as writer:
            def snapshot(at: float) -> NodeSnapshot:
                return NodeSnapshot(at, (GpuSample(0, uuid="GPU-0", pids=(writer.pid,)),))

            event = EpisodeEvent(EventKind.FIRED, Signature.ZERO_UTIL, Severity.CRITICAL, (0,), (0,), onset,
                                 onset + 600, "GPU 0 idle", key="zero_util:0", headline="HANG (critical): GPU 0 idle")
            try:
                handler.handle(event, snapshot(onset + 600), [])
                [state] = handler.open.values()
                _wait(lambda: state.bundle is not None, 60, "the bundle was never written")
                bundle = Path(str(state.bundle))
                for step in range(steps):
                    clock.now += WEEK / steps
                    daemon.responder.consider(snapshot(onset + 600 + (step + 1) * WEEK / steps))
                    _wait(lambda: not state.acting, 60, "the decision never came")
                    sizes.append(((bundle / "summary.json").stat().st_size, (bundle / "report.html").stat().st_size))
            finally:
                service.close(timeout=15)
    decisions = json.loads((bundle / "summary.json").read_text())["actions"]
    assert state.decision is not None and state.decision.name == "alive", state.decision
    assert [d["decision"] for d in decisions] == ["alive"], [d["reason"] for d in decisions]
    assert sizes[-1] == sizes[0], f"summary and report grew from {sizes[0]} to {sizes[-1]} bytes in a week"


def test_a_flapping_decision_keeps_a_bounded_record(tmp_path: Path) -> None:
    """Decisions that change at every reconsideration for a week (20,160 of them) leave at most
    MAX_ACTION_RECORDS in the bundle: the first half and the newest, with the number left out."""
    service = build(daemon_config(tmp_path, source={"kind": "sim", "scenario": "zero_util_hang"}))
    daemon = service.daemon
    event = EpisodeEvent(EventKind.FIRED, Signature.ZERO_UTIL, Severity.CRITICAL, (0,), (0,), 1.9e9, 1.9e9 + 600,
                         "GPU 0 idle", key="zero_util:0", headline="HANG (critical): GPU 0 idle")
    bundles = daemon.incidents.bundles
    bundle = bundles.write(Incident(event, []))
    assert bundle is not None
    for n in range(3 * MAX_ACTION_RECORDS):
        bundles.record_action(str(bundle), {"decision": ("alive", "cooldown")[n % 2], "reason": f"look {n}"})
    service.close()
    summary = json.loads((bundle / "summary.json").read_text())
    kept = [a["reason"] for a in summary["actions"]]
    assert len(kept) == MAX_ACTION_RECORDS and summary["actions_left_out"] == 2 * MAX_ACTION_RECORDS
    assert kept[0] == "look 0" and kept[-1] == f"look {3 * MAX_ACTION_RECORDS - 1}"


def test_the_stacks_and_doctor_verbs_split_a_scan_by_proof_not_by_claim(tmp_path: Path) -> None:
    """`stacks dump --all` and `node --all-ranks` without NVML scan for launched ranks. Another user's process
    that claims the victim's job (unlaunched, its rank forged) is not in that job's picture: it is shown
    apart, as a claim."""
    with shared_folder() as folder, \
            user_process(folder, ALICE, ["queue"], env={**JOB, "RANK": "0", "LOCAL_RANK": "0"}) as victim, \
            user_process(folder, BOB, ["queue"], env={**JOB, "RANK": "1", "LOCAL_RANK": "1"}, launched=False) as forged:
        dump = subprocess.run([sys.executable, "-m", "watchdog", "stacks", "dump", "--all", "--json"],
                              capture_output=True, text=True, timeout=120)
        doctor = subprocess.run([sys.executable, "-m", "watchdog", "doctor", "--all-ranks", "--json"],
                                capture_output=True, text=True, timeout=120)
    pictures = [json.loads(line) for line in dump.stdout.splitlines() if line.startswith("{")]
    members = {p["job"]: sorted(m for g in p["groups"] for m in g["members"]) for p in pictures}
    assert members.get("run:victim-42") == ["rank 0"], (members, dump.stderr)
    claimed = [job for job in members if job != "run:victim-42" and "victim-42" in job]
    assert claimed and all("claimed" in job or "started by" in job for job in claimed), members
    picture = next(p for p in pictures if p["job"] == "run:victim-42")
    assert str(forged.pid) not in json.dumps(picture) and victim.pid > 0
    jobs = [json.loads(line)["job"] for line in doctor.stdout.splitlines() if line.startswith("{")]
    assert "run:victim-42" in jobs and any(j != "run:victim-42" and "victim-42" in (j or "") for j in jobs), jobs
