"""`stall-watchdog run` as systemd runs it: readiness and watchdog pings on NOTIFY_SOCKET, SIGHUP
reloads (an invalid config is rejected and the old one stays), SIGTERM stops cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.conftest import REPO
from tests.fakes.loopback import free_port


def config_text(tmp: Path, port: int, interval: float = 0.5) -> str:
    return (f"sample: {{interval_seconds: {interval}}}\n"
            "source: {kind: sim, scenario: healthy}\n"
            f"export: {{listen_address: '127.0.0.1:{port}'}}\n"
            f"bundles: {{directory: '{tmp}/incidents'}}\n")


def wait_for_line(lines: list[str], process: subprocess.Popen[str], needle: str, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in lines:
            if needle in line:
                return line
        time.sleep(0.05)
    raise AssertionError(f"{needle!r} not logged; got:\n" + "\n".join(lines))


def test_systemd_notify_reload_and_stop(tmp_path: Path) -> None:
    notify = tmp_path / "notify.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(notify))
    server.settimeout(30)  # a cold start beside the other test workers can take more than 10 s
    config = tmp_path / "config.yaml"
    port = free_port()
    config.write_text(config_text(tmp_path, port))
    process = subprocess.Popen([sys.executable, "-m", "watchdog", "run", "--config", str(config)], cwd=REPO,
                               env={**os.environ, "NOTIFY_SOCKET": str(notify), "WATCHDOG_USEC": "30000000"},
                               stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    import threading

    threading.Thread(target=lambda: lines.extend(iter(process.stderr.readline, "")), daemon=True).start()  # type: ignore[union-attr]
    try:
        messages = []
        while not any("READY=1" in m for m in messages):
            messages.append(server.recv(4096).decode())
        assert any("STATUS=watching 8 GPUs" in m for m in messages)
        assert server.recv(4096).decode() == "WATCHDOG=1"  # pinged from the loop, every tick
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            assert response.status == 200

        config.write_text("detectors: {busy_spin: {for_seconds: 30s}}\n")
        process.send_signal(signal.SIGHUP)
        rejected = wait_for_line(lines, process, "event=reload_rejected")
        assert "detectors.busy_spin.for_seconds: expected a number of seconds" in rejected
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            assert b"stall_watchdog_gpu_power_ratio" in response.read()  # still running on the old config

        config.write_text(config_text(tmp_path, port, interval=0.25)
                          + "stacks: {timeout_seconds: 7}\nalerts: {rate_limit_per_minute: 3}\n")
        process.send_signal(signal.SIGHUP)
        reloaded = wait_for_line(lines, process, "event=reloaded")
        assert "applied=sample,stacks" in reloaded and "restart_needed_for=alerts" in reloaded, reloaded

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
        wait_for_line(lines, process, "event=stopping")
        while True:
            message = server.recv(4096).decode()
            if message == "STOPPING=1":
                break
    finally:
        if process.poll() is None:
            process.kill()
        server.close()


def test_every_section_is_either_reloaded_or_named_for_a_restart() -> None:
    from watchdog.config import Config
    from watchdog.daemon import RELOAD

    assert set(RELOAD) == set(Config.model_fields) and set(RELOAD.values()) == {"reload", "restart"}


def test_run_without_a_driver_explains(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "watchdog", "run"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1
    assert "NVML could not start" in result.stderr and "kind: sim" in result.stderr
    assert "Traceback" not in result.stderr
