"""Hostile alert receivers on loopback: a URL or token that leaks, a redirect that carries the token away,
a server that trickles its answer, a command whose children outlive it."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import psutil
import pytest

from tests.act.test_alerts import alert, alerts_config
from tests.conftest import until
from tests.fakes.daemon import Receiver
from watchdog.act.alerts import AlertDispatcher, build_receivers
from watchdog.export.metrics import new_counters


def test_a_url_file_without_a_scheme_is_refused_without_its_secret(tmp_path: Path) -> None:
    url_file = tmp_path / "url"
    url_file.write_text("hooks.example.com/services/SECRETKEY\n")
    with pytest.raises(ValueError) as caught:
        build_receivers(alerts_config([{"type": "webhook", "name": "slack", "url_file": str(url_file)}]))
    assert "url_file" in str(caught.value) and "SECRETKEY" not in str(caught.value)


def test_a_token_with_a_line_break_is_refused_without_its_value(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("T0KEN\nX-Injected: yes\n")
    with pytest.raises(ValueError) as caught:
        build_receivers(alerts_config([{"type": "webhook", "name": "hook", "url": "http://127.0.0.1:9",
                                        "token_file": str(token)}]))
    assert "token_file" in str(caught.value) and "T0KEN" not in str(caught.value)


def test_a_redirect_is_a_failure_and_the_token_goes_nowhere_else(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    elsewhere = Receiver("ok")
    redirecting = Receiver("redirect", location=elsewhere.url + "/steal")
    token = tmp_path / "token"
    token.write_text("T0KEN\n")
    caplog.set_level(logging.INFO, logger="stall_watchdog")
    try:
        counters = new_counters()
        dispatcher = AlertDispatcher(alerts_config([{"type": "webhook", "name": "hook", "url": redirecting.url,
                                                     "token_file": str(token)}]), counters)
        dispatcher.submit(alert())
        dispatcher.close(timeout=10)
    finally:
        redirecting.close()
        elsewhere.close()
    assert elsewhere.requests == []
    assert counters.get("alerts_total", "hook", "failed") == 1 and counters.get("alerts_total", "hook", "sent") == 0
    assert "redirects are not followed" in caplog.text and "T0KEN" not in caplog.text


def test_a_trickling_server_costs_one_delivery_timeout_not_the_receiver() -> None:
    server = Receiver("trickle")
    try:
        counters = new_counters()
        dispatcher = AlertDispatcher(alerts_config([{"type": "webhook", "name": "hook", "url": server.url,
                                                     "timeout_seconds": 1}], max_attempts=1), counters)
        dispatcher.submit(alert("one"))
        until(lambda: counters.get("alerts_total", "hook", "failed") >= 1, 50, "the delivery's failure")
        assert server.holding == 1, "the delivery ended with the trickle, not at its own deadline"
        dispatcher.close(timeout=5)
    finally:
        server.close()


def test_a_command_that_times_out_takes_its_children_with_it(tmp_path: Path) -> None:
    marker = tmp_path / "child.pid"
    script = tmp_path / "page.sh"
    script.write_text(f"#!/bin/sh\nsleep 60 &\necho $! > {marker}\nwait\n")
    script.chmod(0o755)
    counters = new_counters()
    dispatcher = AlertDispatcher(alerts_config([{"type": "command", "name": "page", "argv": [str(script)],
                                                 "timeout_seconds": 1}], max_attempts=1), counters)
    dispatcher.submit(alert())
    dispatcher.close(timeout=10)
    assert counters.get("alerts_total", "page", "failed") == 1
    child = int(marker.read_text())
    time.sleep(0.2)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
