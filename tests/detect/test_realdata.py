"""Detector verdicts on real material from ../shared/realdata: nvidia-smi logs of real DDP runs, and
nvidia-smi tables posted in issue threads about real hangs and healthy runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REALDATA, REPO, realdata, run_engine
from tests.detect.judge import newest, stretch_of
from watchdog.config import Config
from watchdog.detect import busy_spin
from watchdog.detect.stretch import Context
from watchdog.sample.smi_csv import read_smi_csv
from watchdog.vocabulary.model import EpisodeEvent, EventKind, GpuSample, NodeSnapshot, Severity, Signature

MiB = 2**20


def replay_csv(path: Path) -> list[EpisodeEvent]:
    with path.open() as f:
        return run_engine(read_smi_csv(f, str(path)))


def critical(events: list[EpisodeEvent]) -> list[EpisodeEvent]:
    return [e for e in events if e.severity is Severity.CRITICAL]


# -- real training logs ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [
    "h100-traces/ckpt10.csv",
    "h100-traces/ckpt500.csv",
    "titanx-traces/power-trace_2gpu_2025-12-04-01-22-31.csv",
    "titanx-traces/power-trace_2gpu_2025-12-05-02-37-06.csv",
    "titanx-traces/power-trace_2gpu_2025-12-10-17-40-10.csv",
])
def test_healthy_training_logs_raise_no_critical(name: str) -> None:
    events = replay_csv(realdata("telemetry", "grantwilkins-training_profile", *name.split("/")))
    assert critical(events) == [], [e.summary for e in critical(events)]


def test_ckpt1_warns_that_seven_gpus_wait_on_gpu_0() -> None:
    """7 GPUs spin at ~150 W for 9 minutes while GPU 0 writes checkpoints: a wait, not a hang."""
    events = replay_csv(realdata("telemetry", "grantwilkins-training_profile", "h100-traces", "ckpt1.csv"))
    assert critical(events) == []
    fired = [e for e in events if e.event is EventKind.FIRED]
    assert len(fired) == 1
    (warning,) = fired
    assert warning.signature is Signature.WAITING and warning.culprit_gpus == (0,)
    assert warning.gpus == tuple(range(8))
    assert "GPUs 1-7 spin" in warning.summary and "waiting on GPU 0" in warning.summary


def test_ckpt10_waits_also_name_gpu_0() -> None:
    events = replay_csv(realdata("telemetry", "grantwilkins-training_profile", "h100-traces", "ckpt10.csv"))
    assert events and all(e.signature is Signature.WAITING and e.culprit_gpus == (0,) for e in events)


# -- nvidia-smi tables from issue threads, held steady ---------------------------------------------
EXPECTED = {"hang-spin", "hang-zero-util", "mixed", "healthy", "running-slow"}
# The T4 table has no idle history to compare 41 W against: see test_t4_spin_with_its_idle_history.
NEEDS_HISTORY = {"accelerate-233-1.json"}


def snapshot_files() -> list[str]:
    """Tables whose thread says what happened (labels other than 'unknown')."""
    folder = REALDATA / "smi_snapshots"
    if not folder.is_dir():
        return ["(no ../shared/realdata)"]
    return sorted(p.name for p in folder.glob("*.json")
                  if json.loads(p.read_text())["label"] in EXPECTED and p.name not in NEEDS_HISTORY)


def held(table: dict, seconds: int = 150, start: float = 1e9) -> list[NodeSnapshot]:
    """The table as a steady trace at 1 Hz. Rows the thread cut off (no utilization) are left out:
    nothing is known of those GPUs. nvidia-smi tables show no memory or SM activity, so those legs
    stay unknown and the verdict rests on power and utilization alone."""
    gpus = []
    for row in table["gpus"]:
        if row["util_percent"] is None:
            continue
        gpus.append(GpuSample(
            index=row["index"], name=row["name"], utilization_ratio=row["util_percent"] / 100,
            power_watts=row["power_w"], power_limit_watts=row["power_cap_w"],
            memory_used_bytes=row["memory_used_mib"] * MiB if row["memory_used_mib"] is not None else None,
            memory_total_bytes=row["memory_total_mib"] * MiB if row["memory_total_mib"] is not None else None,
            temperature_celsius=row["temp_c"],
        ))
    return [NodeSnapshot(start + t, tuple(gpus)) for t in range(seconds)]


@pytest.mark.parametrize("name", snapshot_files())
def test_snapshot_table_verdict_matches_its_label(name: str) -> None:
    table = json.loads(realdata("smi_snapshots", name).read_text())
    label = table["label"]
    events = run_engine(held(table))
    if label in ("healthy", "running-slow"):
        assert events == [], [e.summary for e in events]
    elif label == "hang-spin":
        assert [(e.signature, e.severity) for e in events] == [(Signature.BUSY_SPIN, Severity.CRITICAL)]
    elif label == "hang-zero-util":
        # Telemetry alone cannot tell a hang from a long checkpoint: a warning first, critical once the pause
        # outlasts detectors.zero_util.critical_after_seconds.
        events = run_engine(held(table, seconds=660))
        assert [(e.event, e.signature, e.severity) for e in events] == [
            (EventKind.FIRED, Signature.ZERO_UTIL, Severity.WARNING),
            (EventKind.ESCALATED, Signature.ZERO_UTIL, Severity.CRITICAL)]
        assert events[0].at_seconds - events[0].onset_seconds <= 60
        assert events[1].at_seconds - events[1].onset_seconds <= Config().detectors.zero_util.critical_after_seconds
    else:  # mixed: some GPUs spin, others sit at 0%; the verdict must single out the ones at 0%
        (event,) = events
        idle = {g["index"] for g in table["gpus"]
                if g["util_percent"] == 0 and (g["memory_used_mib"] or 0) * MiB >= Config().job.memory_min_bytes}
        assert idle and (idle <= set(event.culprit_gpus) or event.signature is Signature.ZERO_UTIL)
        assert idle <= set(event.gpus)


def test_t4_spin_with_its_idle_history() -> None:
    """accelerate-233: stuck at the start of training, 41 W of a T4's 70 W cap (58%). A fixed fraction
    of the cap cannot call that a spin; this GPU's own idle level (SOURCES: a T4 idles at 10-30 W) can."""
    table = json.loads(realdata("smi_snapshots", "accelerate-233-1.json").read_text())
    hung = held(table, start=1e9 + 60)
    idle = [NodeSnapshot(1e9 + t, tuple(g._replace(utilization_ratio=0.0, power_watts=20.0,
                                                   memory_used_bytes=0) for g in hung[0].gpus))
            for t in range(60)]
    assert run_engine(hung) == []  # without history: not enough evidence
    (event,) = run_engine(idle + hung)
    assert (event.signature, event.severity) == (Signature.BUSY_SPIN, Severity.CRITICAL)
    assert "power_near_idle" in event.legs


@pytest.mark.parametrize("name", ["libai-528-1.json", "caffe-364-1.json"])
def test_healthy_low_power_jobs_look_like_spins_on_power_alone(name: str) -> None:
    """Tensor parallel at batch 1 (libai) and a P40 benchmark (caffe) sit at 25-34% of their cap: read as a
    spin reads (pinned at 100%), the power leg alone says spin for at least one GPU. Utilization that never
    pins keeps the verdict healthy (test_snapshot_table_verdict_matches_its_label), and its gaps teach this
    power as the GPU's work (detect/levels.py)."""
    table = json.loads(realdata("smi_snapshots", name).read_text())
    trace = [NodeSnapshot(s.time_seconds, tuple(g._replace(utilization_ratio=1.0) for g in s.gpus))
             for s in held(table, seconds=30)]
    cfg = Config().detectors.busy_spin
    power_alone = []
    pinned = cfg.model_copy(update={"utilization_min_ratio": 0.0})
    for gpu in trace[0].gpus:
        samples = [(snap.time_seconds, snap.gpus[[g.index for g in snap.gpus].index(gpu.index)]) for snap in trace]
        evidence = busy_spin.detect(newest(stretch_of(samples)), pinned, Context(20.0, 2**30)).get(0)
        if evidence is not None and "power_near_idle" in evidence.legs:
            power_alone.append(gpu.index)
    assert power_alone, "expected at least one GPU whose power alone looks like a spin"


def test_a_real_h100_idle_then_matmul_then_a_spinning_kernel() -> None:
    """Recorded by bench/nvml_cost.py through the daemon's own NVML source on an H100 (driver 580): 10 s
    idle, 30 s of bf16 matrix products (99% util, 31% memory util, 698 W), then one warp polling a flag
    that never changes (100% util, 0% memory util, 120 W, SM activity 1%). The products are work; the
    poll is the spin a collective waiting for a peer shows, and only it is called a hang."""
    from watchdog.sample.replay import open_trace

    with open_trace(str(REPO / "tests" / "data" / "h100_idle_matmul_spin.jsonl")) as trace:
        snapshots = list(trace.snapshots)
    events = run_engine(snapshots)
    assert [(e.event, e.signature, e.severity) for e in events] == [
        (EventKind.FIRED, Signature.BUSY_SPIN, Severity.CRITICAL)]
    products = [s.time_seconds for s in snapshots if (s.gpus[0].power_watts or 0) > 600]
    assert len(products) > 15 and max(products) <= events[0].onset_seconds  # the products came first
    fired = next(s for s in snapshots if s.time_seconds >= events[0].at_seconds).gpus[0]
    assert fired.utilization_ratio == 1.0 and fired.memory_utilization_ratio == 0.0 and fired.power_watts < 200
    assert "sm_activity_low" in events[0].legs and "power_near_idle" in events[0].legs


def test_a_real_nccl_all_reduce_whose_peer_never_arrives_on_an_h200() -> None:
    """Recorded by bench/nvml_cost.py on an H200 (driver 580): idle, bf16 matrix products, the flag-polling
    kernel, then two real NCCL ranks sharing the GPU (over loopback sockets) whose rank 1 stops taking part:
    rank 0's all_reduce waits on the GPU at 100% util, 0% memory util, 128 W of 700 W and 1.5% SM activity.
    Both waits are called hangs, once each, and the NCCL one is suspected as soon as it is seen with its
    two ranks; the matrix products never are."""
    from watchdog.sample.replay import open_trace

    with open_trace(str(REPO / "tests" / "data" / "h200_idle_matmul_spin_nccl.jsonl")) as trace:
        snapshots = list(trace.snapshots)
    events = run_engine(snapshots)
    fired = [e for e in events if e.event is EventKind.FIRED]
    assert [(e.signature, e.severity) for e in fired] == [(Signature.BUSY_SPIN, Severity.CRITICAL)] * 2
    ranks = [s.time_seconds for s in snapshots if len(s.gpus[0].pids) == 2]
    products = [s.time_seconds for s in snapshots if (s.gpus[0].power_watts or 0) > 600]
    assert products and all(e.onset_seconds > max(products) for e in events)
    nccl = fired[1]
    assert min(ranks) <= nccl.onset_seconds <= min(ranks) + 2 and nccl.at_seconds - min(ranks) <= 32
    at = next(s for s in snapshots if s.time_seconds >= nccl.at_seconds).gpus[0]
    assert at.pids and len(at.pids) == 2 and at.power_watts < 0.25 * at.power_limit_watts
    assert {"sm_activity_low", "memory_idle", "power_near_idle"} <= set(nccl.legs)
