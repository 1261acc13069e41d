"""The test helpers themselves: waiting on real processes stops at once when one of them dies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import wait_for


def test_wait_for_stops_when_a_process_dies(tmp_path: Path) -> None:
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], text=True)
    with pytest.raises(AssertionError, match="exited before it was ready"):  # not the 60 s timeout's message
        wait_for([tmp_path / "never"], timeout=60, processes=[process])


def test_wait_for_returns_when_the_files_appear(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    process = subprocess.Popen([sys.executable, "-c", f"open({str(ready)!r}, 'w'); import time; time.sleep(5)"],
                               text=True)
    try:
        wait_for([ready], timeout=30, processes=[process])
    finally:
        process.kill()
        process.wait()
