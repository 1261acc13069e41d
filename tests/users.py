"""Ranks of other users, and this project's code run under the privileges the shipped units give it.

Tests here run as root; a hostile or merely unrelated neighbour is a real process of another user (uids
1001 and 1002, no account needed), started by a launcher of its own (a shell of that user that stays its
parent, as torchrun's agent does) or by nobody in particular. Such processes run Debian's python3 over
copies of tests/targets in a world-readable folder: this checkout and its venv may sit where other users
cannot read (/root).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import psutil

from watchdog.sample.ranks import RankDiscovery, RankInfo

TARGETS = Path(__file__).parent / "targets"
SYSTEM_PYTHON = "/usr/bin/python3"
ALICE, BOB = 1001, 1002  # two users who are not this test's (root) and not each other


@contextmanager
def shared_folder() -> Iterator[Path]:
    """A folder every user may read and write (sticky, like /tmp), holding copies of tests/targets."""
    folder = Path(tempfile.mkdtemp(prefix="stall-watchdog-users-"))
    try:
        folder.chmod(0o1777)
        for script in TARGETS.glob("*.py"):
            shutil.copy(script, folder / script.name)
            (folder / script.name).chmod(0o644)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class UserProcess:
    """A target started as another user: `pid` is the Python process itself (under its launcher's shell
    where it has one)."""

    pid: int
    create_time: float
    session: subprocess.Popen[bytes]

    def alive(self) -> bool:
        try:
            process = psutil.Process(self.pid)
            return process.create_time() == self.create_time and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


@contextmanager
def user_process(folder: Path, uid: int, args: Sequence[str], env: dict[str, str] | None = None,
                 launched: bool = True, script: str = "stuck.py") -> Iterator[UserProcess]:
    """tests/targets/<script> ARGS... READY as `uid`, once it has written READY. `launched`: under a shell of
    the same user that stays its parent (a launcher); otherwise this test process is its parent."""
    ready = folder / f"ready-{uid}-{time.monotonic_ns()}"
    argv = [SYSTEM_PYTHON, str(folder / script), *args, str(ready)]
    if launched:
        argv = ["/bin/sh", "-c", '"$@"; exit $?', "sh", *argv]
    session = subprocess.Popen(argv, user=uid, group=uid, extra_groups=[], cwd=folder, start_new_session=True,
                               env={"PATH": "/usr/bin:/bin", **(env or {})}, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert session.poll() is None, f"{argv} exited before it was ready"
            assert time.monotonic() < deadline, f"{argv} did not start"
            time.sleep(0.05)
        time.sleep(0.2)  # from the ready file to the blocking call
        process = psutil.Process(session.pid)
        if launched:
            [process] = process.children()
        yield UserProcess(process.pid, process.create_time(), session)
    finally:
        with suppress(ProcessLookupError):
            os.killpg(session.pid, signal.SIGKILL)
        session.wait()


def unit_capabilities(*files: Path) -> list[str]:
    """The capabilities a systemd unit (and its drop-ins, later ones winning) puts in the ambient set, as
    setpriv names them: ['sys_ptrace', 'dac_read_search']."""
    caps: list[str] = []
    for file in files:
        for line in file.read_text().splitlines():
            if line.startswith("AmbientCapabilities="):
                caps = [c.strip().lower().removeprefix("cap_") for c in line.split("=", 1)[1].split()]
    return caps


def with_capabilities(argv: Sequence[str], caps: Sequence[str], uid: int | None) -> list[str]:
    """`argv` under setpriv with exactly `caps` (bounding, inheritable and ambient sets), as `uid` (a systemd
    DynamicUser) or, with None, as root with the rest dropped (a container's root with `drop: [ALL]`)."""
    sets = "".join(f",+{c}" for c in caps)
    user = ["--reuid", str(uid), "--regid", str(uid), "--clear-groups"] if uid is not None else []
    return ["setpriv", *user, f"--inh-caps=-all{sets}", f"--ambient-caps=-all{sets}", f"--bounding-set=-all{sets}",
            *argv]


_PACKAGES = ("psutil", "msgspec", "yaml", "_yaml", "numpy")


def portable_install(folder: Path) -> dict[str, str]:
    """This checkout's package and what it imports, copied where any user can read them, with py-spy: the
    environment (PYTHONPATH, PATH) under which Debian's python3 runs `-m watchdog` as another user."""
    import importlib.util
    lib = folder / "lib"
    lib.mkdir()
    for name in (*_PACKAGES, "watchdog"):
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin, f"{name} is not installed"
        source = Path(spec.origin)
        if source.name == "__init__.py":
            shutil.copytree(source.parent, lib / source.parent.name,
                            ignore=shutil.ignore_patterns("__pycache__"))
            shared = source.parent.with_name(source.parent.name + ".libs")  # a wheel's bundled libraries (numpy's)
            if shared.is_dir():
                shutil.copytree(shared, lib / shared.name)
        else:
            shutil.copy(source, lib / source.name)
    py_spy = Path(sys.executable).with_name("py-spy")  # installed with the test extras, beside this python
    shutil.copy(py_spy if py_spy.exists() else shutil.which("py-spy") or "py-spy", folder / "py-spy")
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o755 if path.is_dir() or path.name == "py-spy" else 0o644)
    folder.chmod(0o1777)
    return {"PYTHONPATH": str(lib), "PATH": f"{folder}:/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}


@contextmanager
def asleep(env: dict[str, str], argv: Sequence[str] = ()) -> Iterator[subprocess.Popen[bytes]]:
    """A real Python process, asleep, with exactly these variables, once it has said it runs: until its exec
    has finished, /proc/<pid>/environ and cmdline read empty, and a test reading them sooner fails under load."""
    process = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)",
                                *argv], env=env, stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None and process.stdout.readline() == b"up\n"
        yield process
    finally:
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


def described(argv: Sequence[str], env: dict[str, str]) -> RankInfo:
    """What the daemon keeps of a process (RankDiscovery.describe) that runs with these arguments and variables
    (on top of this test's environment): a real process, asleep, ended once described."""
    with asleep({**os.environ, **env}, argv) as process:
        info = RankDiscovery().describe(process.pid)
    assert info is not None
    return info
