"""A day in the daemon's life, on an accelerated clock: the real daemon (build(), every component) over
the faithful fake of pynvml with 8 GPUs and real processes on them, ticking as fast as it can while
its clocks advance a second per tick. Every 10 minutes the node does something worth an episode (all
ranks spin, one rank stalls while the others wait, a GPU throttles, a checkpoint), so a day holds
hundreds; GPU 5 falls off the bus for 10 minutes in hour 5 and comes back; the webhook receiver
answers 503 for all of hour 10. The ranks are real Python processes (blocked in a queue), so every
suspected stall has its stacks captured with py-spy (and looked at again when they show a hang), and
the configuration file is rewritten and reloaded (SIGHUP's path) every 30 simulated minutes. Memory
should stay flat: the benchmark prints the resident memory at the start, every simulated hour and the
end, with the episodes, alerts, stack captures, reloads and bundles of each hour.

    python bench/soak.py [HOURS]      (24 by default; about a minute per simulated hour here)
"""

from __future__ import annotations

import gc
import http.server
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fakes.fake_pynvml import FakeGpu, FakeNvml  # noqa: E402
from watchdog.config import parse_config  # noqa: E402
from watchdog.plumbing import logfmt  # noqa: E402
from watchdog.sample.nvml import NvmlSource  # noqa: E402
from watchdog.service import build  # noqa: E402

GPUS = 8
START = 1.9e9
CYCLE = 600  # seconds: 5 minutes of training, then the cycle's event, then training again


class Receiver(http.server.BaseHTTPRequestHandler):
    down = False
    received = 0

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        Receiver.received += not Receiver.down
        self.send_response(503 if Receiver.down else 200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def drive(gpus: list[FakeGpu], t: int) -> None:
    """Set each fake GPU's readings for second `t` of the day."""
    cycle, phase = divmod(t, CYCLE)
    kind = cycle % 4
    for index, gpu in enumerate(gpus):
        state = "train"
        if 300 <= phase < 420:
            if kind == 0:
                state = "spin"  # every rank in a collective that never finishes
            elif kind == 1:
                state = "zero" if index == 3 else "spin"  # rank 3 stalls; the others wait on it
            elif kind == 3:
                state = "write" if index == 0 else ("spin" if phase < 390 else "train")  # a checkpoint
        wobble = (t * 7 + index * 13) % 5
        if state == "train":
            gpu.util_percent, gpu.memory_util_percent = 97 + wobble % 3, 40 + wobble
            gpu.power_mw = 600_000 + wobble * 4000
            gpu.sm_activity_percent = 70.0
        elif state == "spin":
            gpu.util_percent, gpu.memory_util_percent, gpu.power_mw = 100, 0, 150_000 + wobble * 300
            gpu.sm_activity_percent = 1.0
        elif state == "zero":
            gpu.util_percent, gpu.memory_util_percent, gpu.power_mw = 0, 0, 120_000 + wobble * 200
            gpu.sm_activity_percent = 0.0
        else:  # write
            gpu.util_percent, gpu.memory_util_percent, gpu.power_mw = 1, 0, 140_000
            gpu.sm_activity_percent = 0.0
        gpu.memory_used = 60 * 2**30
        gpu.clock_event_reasons = 0x40 if kind == 2 and index == 2 and 300 <= phase < 480 else 0
        gpu.lost = index == 5 and 5 * 3600 <= t < 5 * 3600 + CYCLE
        gpu.calls.clear()  # the fake's own call log, not the daemon's memory


def main() -> None:
    hours = int(sys.argv[1]) if len(sys.argv) > 1 else 24
    logfmt.log.setLevel(logfmt.ERROR)  # the daemon's own episode lines: hundreds of them
    stuck = Path(__file__).resolve().parent.parent / "tests" / "targets" / "stuck.py"
    ranks = [subprocess.Popen([sys.executable, str(stuck), "queue"]) for _ in range(GPUS)]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    clock = {"now": START}
    gpus = [FakeGpu(uuid=f"GPU-{n:08d}-0000-0000-0000-000000000000", pids=[rank.pid],
                    bus_id=f"00000000:{n + 7:02x}:00.0") for n, rank in enumerate(ranks)]
    try:
        with tempfile.TemporaryDirectory() as folder:
            settings = {
                "bundles": {"directory": str(Path(folder) / "incidents"), "capture_stacks": True},
                "alerts": {"receivers": [{"type": "webhook", "name": "soak",
                                          "url": f"http://127.0.0.1:{server.server_port}/"}],
                           "max_attempts": 2, "backoff_seconds": 0.05, "rate_limit_per_minute": 1000},
            }
            config = parse_config(settings)
            config_file = Path(folder) / "config.yaml"
            source = NvmlSource(nvml=FakeNvml(gpus), call_timeout_seconds=2.0, clock=lambda: clock["now"])
            source.open()
            service = build(config, source, monotonic=lambda: clock["now"] - START, wall=lambda: clock["now"])
            daemon = service.daemon
            daemon.config_path = str(config_file)
            reloads = 0
            process = psutil.Process()
            print(f"soak: {hours} simulated hours of 1 Hz ticks, {GPUS} GPUs, events every {CYCLE // 60} min")
            last = {"episodes": 0.0, "alerts": 0.0, "captures": 0.0,
                    "cpu": process.cpu_times().user + process.cpu_times().system, "wall": time.monotonic()}
            for t in range(hours * 3600 + 1):
                if t == 10 * 3600 or t == 11 * 3600:
                    Receiver.down = t == 10 * 3600
                drive(gpus, t)
                clock["now"] = START + t
                if t % 1800 == 900:  # a new threshold, as an operator's edit and SIGHUP would bring it
                    settings["detectors"] = {"throttle": {"clear_seconds": 10.0 + t // 1800 % 2}}
                    config_file.write_text(yaml.safe_dump(settings))
                    reloads += daemon.reload()
                daemon.tick()
                if t % 3600 == 0:
                    gc.collect()
                    counts = daemon.counters.snapshot()
                    episodes = sum(counts.get("episodes_total", {}).values())
                    alerts = sum(v for (receiver, result), v in counts.get("alerts_total", {}).items()
                                 if result == "sent")
                    cpu = process.cpu_times().user + process.cpu_times().system
                    captures = sum(counts.get("stack_captures_total", {}).values())
                    incidents = Path(folder) / "incidents"
                    bundles = sum(1 for p in incidents.iterdir() if p.is_dir()) if incidents.is_dir() else 0
                    note = " (the receiver was down)" if t == 11 * 3600 else ""
                    print(f"  after {t // 3600:>2} h: RSS {process.memory_info().rss / 2**20:5.1f} MiB | "
                          f"{episodes - last['episodes']:3.0f} episodes, {alerts - last['alerts']:3.0f} alerts "
                          f"delivered{note}, {captures - last['captures']:3.0f} stack captures, {reloads} reloads "
                          f"so far, {bundles} bundles kept | {(cpu - last['cpu']) / 3600 * 1000:.2f} ms CPU per "
                          f"tick", flush=True)
                    last.update(episodes=episodes, alerts=alerts, cpu=cpu, captures=captures)
            service.close(timeout=10)
            counts = daemon.counters.snapshot()
            print(f"end: RSS {process.memory_info().rss / 2**20:.1f} MiB after {hours * 3600 + 1} ticks in "
                  f"{time.monotonic() - last['wall']:.0f} s; episodes {dict(counts.get('episodes_total', {}))}; "
                  f"alerts {dict(counts.get('alerts_total', {}))}; component errors "
                  f"{dict(counts.get('component_errors_total', {})) or 'none'}")
    finally:
        server.shutdown()
        for rank in ranks:
            rank.kill()
            rank.wait()


if __name__ == "__main__":
    main()
