"""Shared test helpers: where the real data lives, and small builders for snapshots."""

from __future__ import annotations

import atexit
import contextlib
import getpass
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from watchdog.config import Config
from watchdog.detect.engine import DetectorEngine
from watchdog.vocabulary.model import EpisodeEvent, EventKind, NodeSnapshot

REPO = Path(__file__).resolve().parent.parent
REALDATA = Path(os.environ.get("STALL_WATCHDOG_REALDATA", REPO.parent / "shared" / "realdata"))

# The tests leave nothing in $TMPDIR: what torch would put there (its compile cache folder, made by every rank that
# imports it) goes to a folder of this process's own, removed when it ends; pytest's folders, by its
# tmp_path_retention_policy, and pytest_unconfigure below.
_SCRATCH = tempfile.mkdtemp(prefix="stall-watchdog-tests-")
atexit.register(shutil.rmtree, _SCRATCH, True)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_SCRATCH, "torchinductor"))


def pytest_unconfigure(config: pytest.Config) -> None:
    """pytest's per-user folder of temporary folders, once the run has removed what it kept there (kept only
    for failed tests): an empty folder is not left behind."""
    if not hasattr(config, "workerinput"):  # the controller, after its workers
        with contextlib.suppress(OSError):
            os.rmdir(Path(tempfile.gettempdir()) / f"pytest-of-{getpass.getuser()}")


def realdata(*parts: str) -> Path:
    """A file under ../shared/realdata; the test skips (with the reason) when a clone has no ../shared."""
    path = REALDATA.joinpath(*parts)
    if not REALDATA.is_dir():
        pytest.skip(f"real data not found at {REALDATA} (CI provides ../shared; a fresh clone may not)")
    assert path.exists(), f"{path} is missing from the real data"
    return path


def run_engine(snapshots: Iterable[NodeSnapshot], config: Config | None = None) -> list[EpisodeEvent]:
    """The alerting events (fired, escalated, resolved) of the engine over a trace."""
    engine = DetectorEngine(config or Config())
    events: list[EpisodeEvent] = []
    for snapshot in snapshots:
        events.extend(e for e in engine.observe(snapshot) if e.event is not EventKind.SUSPECTED)
    return events


TARGETS = REPO / "tests" / "targets"
# The Debian package that brings each tool the tests use (.ci/run installs them).
PACKAGES = {"prometheus": "prometheus", "promtool": "prometheus", "alertmanager": "prometheus-alertmanager",
            "prometheus-alertmanager": "prometheus-alertmanager", "amtool": "prometheus-alertmanager",
            "systemd-analyze": "systemd", "openssl": "openssl", "setpriv": "util-linux", "chromium": "chromium",
            "kubectl": "kubectl", "victoria-metrics": "victoria-metrics", "vmagent": "victoria-metrics",
            "vmalert": "victoria-metrics"}


def _hint(name: str) -> str:
    return f"apt-get install {PACKAGES.get(name, name)} (a Debian package; .ci/run installs it)"


def need_tool(name: str) -> str:
    """A server or tool users have (promtool, prometheus, alertmanager, systemd-analyze). A newcomer
    without it is told what to install; in CI (CI=true) its absence is a failure, never a skip."""
    import shutil

    found = shutil.which(name)
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail(f"{name} is missing in CI: {_hint(name)}")
    pytest.skip(f"{name} not installed: {_hint(name)}")


def until(condition: Callable[[], object], seconds: float, what: str) -> None:
    """Wait for a condition, looking twice a second: a guard against a test that would otherwise wait forever, far
    longer than the condition needs, never a limit on the machine's speed."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds:g} s: {what}"
        time.sleep(0.5)


def wait_for(paths: list[Path], timeout: float = 90.0,
             processes: Iterable[subprocess.Popen[str]] = ()) -> None:
    """Until every path exists; fails at once when one of `processes` exits first (a rank that died
    will never write its file)."""
    deadline = time.monotonic() + timeout
    processes = list(processes)
    while not all(p.exists() for p in paths):
        dead = [p.args for p in processes if p.poll() is not None]
        assert not dead, f"a target exited before it was ready: {dead}"
        assert time.monotonic() < deadline, f"targets did not start: {[str(p) for p in paths if not p.exists()]}"
        time.sleep(0.05)


@contextmanager
def python_target(mode: str, tmp: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[str]]:
    """A real Python process (tests/targets/stuck.py) that has reached its stuck point."""
    ready = tmp / f"ready-{mode}-{time.monotonic_ns()}"
    process = subprocess.Popen([sys.executable, str(TARGETS / "stuck.py"), mode, str(ready)], text=True,
                               stdout=subprocess.PIPE, env={**os.environ, **(env or {})})
    try:
        wait_for([ready], 30, [process])
        time.sleep(0.2)  # from the ready file to the blocking call
        yield process
    finally:
        process.kill()
        process.wait()


@contextmanager
def gloo_job(scenario: str, tmp: Path, ranks: int = 4, odd_rank: int = 2, env: dict[str, str] | None = None,
             flight_recorder: bool = False, elsewhere: int = 0, rank_env: dict[int, dict[str, str]] | None = None
             ) -> Iterator[list[subprocess.Popen[str]]]:
    """A real torch.distributed job on CPU (tests/targets/gloo_job.py), launched the way torchrun launches
    workers, held at its stall. `flight_recorder`: PyTorch records the collectives and each rank answers
    the dump pipe (`<tmp>/fr_pipe_<rank>.pipe`, dumps to `<tmp>/fr_dump_<rank>`). `elsewhere`: ranks of the
    job past `ranks`, standing for another node's (not yielded: the node under test does not see them).
    `rank_env`: variables of some ranks only (by rank), e.g. which rank stands in for NCCL's RAS service."""
    extra = dict(env or {})
    if flight_recorder:
        extra.update(TORCH_FR_BUFFER_SIZE="2000", TORCH_FR_DEBUG_INFO_PIPE_FILE=str(tmp / "fr_pipe_"),
                     TORCH_FR_DUMP_TEMP_FILE=str(tmp / "fr_dump_"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    processes = []
    try:
        for rank in range(ranks + elsewhere):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(ranks + elsewhere),
                   "LOCAL_RANK": str(rank % ranks), "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port),
                   "TORCHELASTIC_RUN_ID": f"test-{port}", "ODD_RANK": str(odd_rank), "NCCL_DEBUG": "WARN", **extra,
                   **(rank_env or {}).get(rank, {})}
            processes.append(subprocess.Popen([sys.executable, str(TARGETS / "gloo_job.py"), scenario, str(tmp)],
                                              env=env, text=True, stderr=subprocess.DEVNULL))
        wait_for([tmp / f"rank-{r}" for r in range(ranks + elsewhere)], processes=processes)
        time.sleep(1.5)  # from "ready" to blocking in the stall
        assert all(p.poll() is None for p in processes), "a rank died before the test looked at it"
        yield processes[:ranks]
    finally:
        for p in processes:
            p.kill()
        for p in processes:
            p.wait()
