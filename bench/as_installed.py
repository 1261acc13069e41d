"""The environment a benchmark runs the daemon's own processes in: as an installed package runs, with its
modules' bytecode cached (pip compiles it on install; a checkout writes it on its first run).

A shell with PYTHONDONTWRITEBYTECODE set (as some containers are) would compile every module of the package
from source on every start: 0.2 s of a replay's start here, and 1.6 MiB more of a daemon's resident memory (the
compiler's leftovers). The cache is a folder of the benchmark's own, removed on exit; `warm()` fills it with
one short replay that is not measured.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_CACHED = tempfile.mkdtemp(prefix="bench-bytecode-")
atexit.register(shutil.rmtree, _CACHED, True)

ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, "PYTHONPYCACHEPREFIX": _CACHED}


def warm() -> None:
    """One replay of a one-sample log, not measured: the modules' bytecode written to the cache."""
    with tempfile.TemporaryDirectory() as tmp:
        tiny = Path(tmp) / "one.csv"
        tiny.write_text("timestamp, index, utilization.gpu [%], power.draw [W]\n"
                        "2026/01/01 00:00:00.000, 0, 5 %, 60 W\n")
        subprocess.run([sys.executable, "-m", "watchdog", "replay", str(tiny)], capture_output=True, check=True,
                       env=ENV)
