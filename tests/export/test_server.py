"""The endpoint: /metrics and /healthz, TLS, basic auth."""

from __future__ import annotations

import base64
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.fakes.daemon import daemon_config, stepping_clock
from watchdog.daemon import Daemon
from watchdog.export.server import Endpoint, EndpointError
from watchdog.sample import sim
from watchdog.service import build


def serve(tmp_path: Path, clock: Callable[[], float] = time.time, **export: object) -> tuple[Daemon, Endpoint]:
    config = daemon_config(tmp_path, export={"listen_address": "127.0.0.1:0", **export})
    service = build(config, sim.SimSource(sim.SCENARIOS["healthy"], clock=clock))
    daemon = service.daemon
    endpoint = service.endpoint
    endpoint.start()
    return daemon, endpoint


def get(url: str, auth: str | None = None, context: ssl.SSLContext | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_metrics_and_healthz(tmp_path: Path) -> None:
    daemon, endpoint = serve(tmp_path)
    try:
        base = endpoint.url.removesuffix("/metrics")
        assert get(base + "/healthz")[0] == 503  # no sample yet
        daemon.tick()
        status, body = get(endpoint.url)
        assert status == 200 and "stall_watchdog_gpu_power_ratio" in body
        status, body = get(base + "/healthz")
        assert status == 200 and body.startswith("ok: last sample")
        assert get(base + "/nope")[0] == 404
    finally:
        endpoint.stop()


def test_healthz_fails_when_samples_go_stale(tmp_path: Path) -> None:
    daemon, endpoint = serve(tmp_path, clock=stepping_clock(start=time.time() - 3600))
    try:
        daemon.tick()
        status, body = get(endpoint.url.removesuffix("/metrics") + "/healthz")
        assert status == 503 and "last sample 3600 s ago" in body
    finally:
        endpoint.stop()


def test_basic_auth(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    daemon, endpoint = serve(tmp_path, basic_auth_user="prom", basic_auth_password_file=str(secret))
    try:
        assert get(endpoint.url)[0] == 401
        assert get(endpoint.url, "prom:wrong")[0] == 401
        assert get(endpoint.url, "prom:s3cret")[0] == 200
    finally:
        endpoint.stop()


def test_tls(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    daemon, endpoint = serve(tmp_path, tls_cert_file=str(cert), tls_key_file=str(key))
    try:
        assert endpoint.url.startswith("https://")
        context = ssl.create_default_context(cafile=str(cert))
        assert get(endpoint.url, context=context)[0] == 200
        with pytest.raises(OSError):  # plain HTTP is refused (URLError and resets are both OSErrors)
            urllib.request.urlopen(endpoint.url.replace("https", "http"), timeout=3)
    finally:
        endpoint.stop()


def test_endpoint_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(EndpointError, match="export.basic_auth_password_file"):
        serve(tmp_path, basic_auth_user="prom", basic_auth_password_file=str(tmp_path / "absent"))
    with pytest.raises(EndpointError, match="export.tls_cert_file"):
        serve(tmp_path, tls_cert_file=str(tmp_path / "absent.pem"), tls_key_file=str(tmp_path / "absent.key"))
    daemon, endpoint = serve(tmp_path)
    try:
        port = endpoint.url.rsplit(":", 1)[1].split("/")[0]
        with pytest.raises(EndpointError, match="cannot listen"):
            serve(tmp_path, listen_address=f"127.0.0.1:{port}")
    finally:
        endpoint.stop()
