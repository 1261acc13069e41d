"""Hostile configuration files: each is refused by `check-config` with its key named and no traceback,
exactly as `run` would refuse it, and a SIGHUP reload of it leaves the running daemon as it was."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

BAD = {
    "not_utf8": (b"sample:\n  interval_seconds: 1\n# \xff\xfe\n", "not UTF-8"),
    "deep": (b"a: " + b"[" * 3000 + b"]" * 3000 + b"\n", "nested deeper"),
    "inf": (b"sample: {interval_seconds: .inf}\n", "sample.interval_seconds"),
    "huge": (b"detectors: {busy_spin: {for_seconds: 1e10}}\n", "detectors.busy_spin.for_seconds"),
    "tiny": (b"sample: {interval_seconds: 0.000001}\n", "sample.interval_seconds"),
    "port": (b"export: {listen_address: '127.0.0.1:99999'}\n", "export.listen_address"),
    "nonsense": (b"export: {listen_address: nonsense}\n", "export.listen_address"),
    "webhook_without_url": (b"alerts: {receivers: [{type: webhook, name: hook}]}\n", "give exactly one of url"),
    "command_without_argv": (b"alerts: {receivers: [{type: command, name: page}]}\n", "needs argv"),
    "scenario": (b"source: {kind: sim, scenario: nope}\n", "source.scenario"),
    "cert_without_key": (b"export: {tls_cert_file: /etc/cert.pem}\n", "tls_cert_file and tls_key_file"),
    "password_without_user": (b"export: {basic_auth_password_file: /etc/pw}\n", "without basic_auth_user"),
    "url_without_scheme": (b"alerts: {receivers: [{type: webhook, name: h, url: 'hooks.example/SECRETKEY'}]}\n",
                           "http:// or https://"),
    "alias_bomb": (b"a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                   b"c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
                   b"e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n"
                   b"g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]\nh: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g, *g]\n",
                   "aliases expanded"),
    "long_value": (b"sample: {interval_seconds: '" + b"x" * 100_000 + b"'}\n", "(100002 characters)"),
}


def check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "watchdog", "check-config", str(path)], capture_output=True,
                          text=True, cwd=REPO, timeout=60)


@pytest.mark.parametrize("name", sorted(BAD))
def test_check_config_refuses_with_the_key_and_no_traceback(tmp_path: Path, name: str) -> None:
    content, phrase = BAD[name]
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(content)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = check(path)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert result.returncode == 2, result.stdout + result.stderr
    assert phrase in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(result.stderr) < 4000  # an excerpt, never the whole input
    assert "SECRETKEY" not in result.stderr
    # The work it did, counted in CPU seconds (what a loaded machine does not inflate, as it does wall time):
    # a hostile config (a billion laughs, a deep nesting) costs what a plain one does, about 1.5 s
    assert after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime < 10


def test_a_bad_reload_is_rejected_and_the_daemon_keeps_running(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    good = (f"source: {{kind: sim, scenario: healthy}}\nexport: {{listen_address: '127.0.0.1:0'}}\n"
            f"bundles: {{directory: '{tmp_path / 'incidents'}'}}\n")
    config.write_text(good)
    daemon = subprocess.Popen([sys.executable, "-m", "watchdog", "run", "--config", str(config)], cwd=REPO,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert daemon.stderr is not None
        assert any("event=started" in daemon.stderr.readline() for _ in range(2))  # after the dump notice
        for name in ("not_utf8", "deep", "inf", "alias_bomb", "port"):
            config.write_bytes(BAD[name][0])
            daemon.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 20
            seen = ""
            while "reload_rejected" not in seen:
                assert time.monotonic() < deadline, f"no reload_rejected for {name}"
                seen = daemon.stderr.readline()
            assert daemon.poll() is None, f"the daemon died reloading {name}"
        config.write_text(good)
        daemon.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while "event=reloaded" not in (seen := daemon.stderr.readline()):
            assert time.monotonic() < deadline and "Traceback" not in seen, seen
    finally:
        daemon.terminate()
        rest = daemon.communicate(timeout=30)[1]
    assert "Traceback" not in rest and daemon.returncode == 0, rest[-2000:]


@pytest.mark.parametrize(("text", "said"), [
    ("stacks:\n  sample_rate_hz: true\n", "stacks.sample_rate_hz: expected a whole number, got true"),
    ("detectors:\n  busy_spin:\n    for_seconds: false\n", "detectors.busy_spin.for_seconds: expected a number"),
    ("detectors:\n  zero_util:\n    for_seconds: '30'\n", "detectors.zero_util.for_seconds: expected a number"),
    ("detectors:\n  underuse:\n    window_seconds: 604800\n", "detectors.underuse.window_seconds: "),
    ("detectors:\n  straggler:\n    wait_window_seconds: 604800\n", "detectors.straggler.wait_window_seconds: "),
    ("export:\n  listen_address: no-such-host.invalid:9944\n", "export.listen_address: 'no-such-host.invalid' is no "
     "address to listen on"),
    ("stacks:\n  py_spy_command: [/nonexistent/py-spy]\n", "stacks.py_spy_command: '/nonexistent/py-spy' is not a "
     "program"),
    ("bundles:\n  directory: {file}\n", "bundles.directory: {file} is a file, not a folder"),
])
def test_check_config_refuses_what_passes_and_then_hurts(tmp_path: Path, text: str, said: str) -> None:
    """Each of these said ok and then hurt: a detector firing at once, a week of rows kept in memory, an address
    that cannot be listened on, captures that could never run, bundles that could never be written."""
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("x")
    config = tmp_path / "config.yaml"
    config.write_text(text.format(file=a_file))
    done = check(config)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert said.format(file=a_file) in done.stderr, done.stderr
