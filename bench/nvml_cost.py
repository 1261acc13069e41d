"""On a machine with an NVIDIA GPU: what the daemon's NVML sampling costs per tick, side by side with
`nvidia-smi --query-gpu=... -l 1` on the same GPU, and what the readings look like idle, under a
matrix multiply, under a kernel that spins on a flag (the shape of a collective waiting for a peer) and
under a real NCCL all_reduce whose peer never arrives (two ranks sharing the GPU). Without a driver it
says so and stops.

    python bench/nvml_cost.py [--out FOLDER]      (FOLDER gets the recording of the four phases)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from watchdog.config import Config  # noqa: E402
from watchdog.detect.engine import DetectorEngine  # noqa: E402
from watchdog.sample import nvml_readings, recording  # noqa: E402
from watchdog.sample.nvml import NvmlSource, NvmlUnavailable  # noqa: E402
from watchdog.vocabulary.model import HEALTH_COUNTERS  # noqa: E402

QUERY = ("timestamp,index,utilization.gpu,utilization.memory,power.draw,enforced.power.limit,clocks.sm,"
         "clocks.max.sm,memory.used,memory.total,temperature.gpu,clocks_event_reasons.active")
MATMUL = """
import torch, time
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
end = time.time() + float(__import__("sys").argv[1])
while time.time() < end:
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
"""
SPIN = """
import cupy, sys
spin = cupy.RawKernel(r'''
__device__ long long now() { long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
extern "C" __global__ void spin(volatile int *flag, long long nanoseconds) {
    long long start = now();   // a peer that never arrives: poll a flag, do no work (giving up after
    while (*flag == 0 && now() - start < nanoseconds) { }   // `nanoseconds`, so the benchmark ends)
}''', "spin")
flag = cupy.zeros(1, dtype=cupy.int32)
spin((1,), (32,), (flag, cupy.int64(float(sys.argv[1]) * 1e9)))  # one warp, as a proxy's wait holds
cupy.cuda.Device().synchronize()
"""
# A real NCCL all_reduce whose peer never arrives: two ranks on the one GPU (each told it is on a host of
# its own, NCCL_HOSTID, so NCCL lets them share it and talks between them over loopback sockets), a few
# collectives of work, then rank 1 stops taking part and rank 0's next all_reduce waits for it on the GPU.
NCCL = """
import datetime, os, sys, time, torch, torch.distributed as dist
rank, seconds = int(os.environ["RANK"]), float(sys.argv[1])
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=seconds + 120))
x = torch.ones(1 << 22, device="cuda")
for _ in range(50):
    dist.all_reduce(x)
torch.cuda.synchronize()
if rank == 1:
    time.sleep(seconds + 120)  # held elsewhere (a data loader, another collective): never joins the next one
dist.all_reduce(x)
torch.cuda.synchronize()
"""


def nccl_ranks(seconds: float) -> list[subprocess.Popen]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "WORLD_SIZE": "2",
           "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}
    return [subprocess.Popen([sys.executable, "-c", NCCL, str(seconds)],
                             env={**env, "RANK": str(rank), "NCCL_HOSTID": f"bench-host-{rank}"})
            for rank in (0, 1)]


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    source = NvmlSource()
    try:
        source.open()
    except NvmlUnavailable as exc:
        print(f"nvml_cost: no NVIDIA driver here ({exc}); nothing to measure")
        return
    me = psutil.Process()
    print(f"{source.gpu_count} GPU(s), driver {source.driver_version}")
    for _ in range(3):
        source.sample()
    walls, cpus = [], []
    for _ in range(60):
        cpu, wall = cpu_seconds(me), time.perf_counter()
        source.sample()
        walls.append(time.perf_counter() - wall)
        cpus.append(cpu_seconds(me) - cpu)
        time.sleep(0.25)
    print(f"daemon's NVML sample, per tick: {statistics.median(walls) * 1000:.2f} ms wall median "
          f"({max(walls) * 1000:.2f} max), {sum(cpus) / len(cpus) * 1000:.2f} ms CPU mean")
    # The health counters (ECC, memory repair, NVLink, PCIe) are read every HEALTH_SECONDS: a tick that reads
    # them, as every 30th does, and what they read on this machine.
    every = nvml_readings.HEALTH_SECONDS
    nvml_readings.HEALTH_SECONDS = 0.0
    walls, cpus = [], []
    for _ in range(20):
        cpu, wall = cpu_seconds(me), time.perf_counter()
        snapshot = source.sample()
        walls.append(time.perf_counter() - wall)
        cpus.append(cpu_seconds(me) - cpu)
        time.sleep(0.25)
    nvml_readings.HEALTH_SECONDS = every
    print(f"a tick that also reads the health counters (every {every:.0f} s): {statistics.median(walls) * 1000:.2f} ms "
          f"wall median, {sum(cpus) / len(cpus) * 1000:.2f} ms CPU mean; Xid events "
          f"{'watched' if source.watches_xids else 'not available'}")
    for gpu in snapshot.gpus[:2]:
        print(f"  GPU {gpu.index}: " + ", ".join(f"{name} {getattr(gpu, name)}" for name in HEALTH_COUNTERS))

    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv", "-l", "1"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    watched = psutil.Process(smi.pid)
    time.sleep(2)
    before, started = cpu_seconds(watched), time.monotonic()
    time.sleep(20)
    used, elapsed = cpu_seconds(watched) - before, time.monotonic() - started
    smi.terminate()
    lines = smi.communicate()[0].decode().splitlines()
    print(f"nvidia-smi -l 1: {used / elapsed * 1000:.2f} ms CPU per second of logging ({len(lines)} lines in "
          f"{elapsed + 2:.0f} s)")
    shots = []
    for _ in range(5):
        started = time.perf_counter()
        subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv"], capture_output=True, check=True)
        shots.append(time.perf_counter() - started)
    print(f"one nvidia-smi --query-gpu call, start to exit: {statistics.median(shots) * 1000:.0f} ms median")

    snapshots = []
    for phase, program, seconds in (("idle", None, 10), ("matmul", MATMUL, 30), ("spin", SPIN, 50),
                                    ("nccl", NCCL, 75)):
        if program is NCCL:
            workers = nccl_ranks(seconds)
        else:
            workers = [subprocess.Popen([sys.executable, "-c", program, str(seconds)])] if program else []
        end = time.monotonic() + seconds
        phase_snaps = []
        while time.monotonic() < end:
            phase_snaps.append(source.sample())
            time.sleep(1.0)
        for worker in workers:
            if program is NCCL:  # rank 0 would wait for its peer until NCCL's own timeout
                worker.kill()
            worker.wait(timeout=60)
        snapshots += phase_snaps
        tail = [s.gpus[0] for s in phase_snaps[len(phase_snaps) // 2:]]
        util = statistics.median(g.utilization_ratio or 0 for g in tail)
        power = statistics.median(g.power_watts or 0 for g in tail)
        mem = statistics.median(g.memory_utilization_ratio or 0 for g in tail)
        activity = [g.sm_activity_ratio for g in tail if g.sm_activity_ratio is not None]
        clock = statistics.median((g.sm_clock_hertz or 0) / 1e6 for g in tail)
        active = f"{statistics.median(activity):.0%}" if activity else "n/a"
        print(f"{phase:>6}: util {util:.0%}, memory util {mem:.0%}, power {power:.0f} W of "
              f"{tail[-1].power_limit_watts or 0:.0f} W, SM clock {clock:.0f} MHz, SM activity {active}")
    engine = DetectorEngine(Config())
    for snapshot in snapshots:
        for event in engine.observe(snapshot):
            print(f"  detector: {event.event.value} {event.signature.value} {event.severity.value} at "
                  f"+{event.at_seconds - snapshots[0].time_seconds:.0f} s: {event.headline}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "phases.jsonl").open("w") as f:
            recording.write(f, recording.header("nvml", "bench"), snapshots)
    source.close()


if __name__ == "__main__":
    main()
