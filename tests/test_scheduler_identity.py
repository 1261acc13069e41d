"""From an alert to the pod and the Slurm job that hung: a real gloo job whose ranks carry Slurm's
variables, on GPUs a real gRPC kubelet says a pod holds. The pod and the job reach rank_info, both
alert receivers, the bundle and its summary."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from tests.conftest import gloo_job
from tests.fakes.daemon import Receiver, daemon_config, stepping_clock
from tests.fakes.podresources import KubeletServer
from tests.test_daemon import wait_for_looks
from watchdog.sample import sim
from watchdog.service import build

SLURM = {"SLURM_JOB_ID": "9001", "SLURM_STEP_ID": "0", "SLURM_JOB_USER": "alice"}


def sim_uuid(index: int) -> str:
    return f"GPU-{index:08x}-5157-4a1e-9d7c-000000000000"  # what the simulated node calls its GPUs


def test_the_alert_leads_to_the_pod_and_the_slurm_job(tmp_path: Path) -> None:
    hook, manager = Receiver(), Receiver()
    pods = [("ml", "trainer-0", [("main", [("nvidia.com/gpu", [sim_uuid(g) for g in range(8)])])])]
    with tempfile.TemporaryDirectory(prefix="kubelet-") as folder:
        socket_path = Path(folder) / "kubelet.sock"
        try:
            with (KubeletServer(socket_path, pods) as kubelet,
                  gloo_job("dataloader", tmp_path, odd_rank=2, env=SLURM) as ranks):
                pids = {4: [ranks[2].pid], 0: [ranks[0].pid], 1: [ranks[1].pid], 2: [ranks[3].pid]}
                # A kubelet slow to give its first answer (a busy node): the look waits for it, and the alert
                # still names the pod.
                kubelet.delay = 1.5
                config = daemon_config(
                    tmp_path, source={"scenario": "odd_rank", "start_offset_seconds": 295, "pids": pids},
                    bundles={"capture_stacks": True}, stacks={"observe_seconds": 0.3},
                    kubernetes={"pod_resources_socket": str(socket_path)},
                    alerts={"receivers": [{"type": "webhook", "name": "hook", "url": hook.url},
                                          {"type": "alertmanager", "name": "am", "url": manager.url}]})
                service = build(config, sim.SimSource(sim.SCENARIOS["odd_rank"], 1.0, 295, pids,
                                                     clock=stepping_clock()))
                daemon = service.daemon
                ticks = 0
                while not daemon.incidents.open and ticks < 40:
                    daemon.tick()
                    ticks += 1
                wait_for_looks(daemon)
                for _ in range(45 - ticks):
                    daemon.tick()
                # The episode may fire on the last tick: let its bundle be written (the alert follows it)
                # before stopping, or the stop writes it as partial, without the ranks.
                deadline = time.monotonic() + 30
                while not hook.requests and time.monotonic() < deadline:
                    time.sleep(0.05)
                exposition = service.exposition().decode()
                service.close(timeout=15)
        finally:
            hook.close()
            manager.close()
    info = [line for line in exposition.splitlines() if line.startswith("stall_watchdog_rank_info{")]
    assert len(info) == 4
    for line in info:
        assert 'namespace="ml",pid=' in line and 'pod="trainer-0"' in line and 'container="main"' in line
        assert 'slurm_job_id="9001"' in line and 'slurm_step="0"' in line and 'slurm_user="alice"' in line
        # the Slurm variables are the ranks' claims; what proves their job is their launcher (this test), as us
        assert 'proof="launcher"' in line and f'uid="{os.getuid()}"' in line
    assert len(hook.requests) == 1, [b["alert"]["status"] + " " + b["alert"]["summary"] for _, b in hook.requests]
    (_, body), = hook.requests
    alert = body["alert"]
    # The kubelet names the pod; the Slurm job here comes from the ranks' environment alone (these test
    # ranks run in no Slurm cgroup), so it is marked as claimed.
    assert alert["workload"] == {"namespace": "ml", "pod": "trainer-0", "container": "main",
                                 "slurm_job_id": "9001", "slurm_step": "0", "slurm_user": "alice",
                                 "claimed_by_environment": ["slurm_job_id", "slurm_step", "slurm_user"]}
    assert ("[pod ml/trainer-0 (container main), Slurm job 9001 step 0 (user alice) (as its environment says)]"
            in body["text"])
    (path, sent), = manager.requests
    labels = sent[0]["labels"]
    assert path == "/api/v2/alerts"
    assert labels["namespace"] == "ml" and labels["pod"] == "trainer-0" and labels["slurm_job_id"] == "9001"
    bundle = Path(alert["bundle"])
    assert (bundle / "environment.json").exists(), (bundle / "summary.json").read_text()  # notes say why
    environment = json.loads((bundle / "environment.json").read_text())
    assert {r["workload"]["slurm_job_id"] for r in environment} == {"9001"}
    assert {r["workload"]["pod"] for r in environment} == {"trainer-0"}
    summary = json.loads((bundle / "summary.json").read_text())
    assert all(r["workload"]["pod"] == "trainer-0" for r in summary["ranks"])
    page = (bundle / "report.html").read_text()
    assert "<th>runs_in</th>" in page and "pod ml/trainer-0 (container main), Slurm job 9001 step 0" in page
