"""How many series a node exports, read off the real daemon's /metrics: `stall-watchdog demo` (the real
daemon, 8 real ranks, one on each simulated GPU, their stacks sampled) scraped every 2 s, healthy and then
while rank 4 hangs (from the first scrape with an episode open). A series "of a GPU" carries a `gpu` label
with a value; the others are the node's.

    python bench/series_budget.py [--series standard|beside_dcgm|full]

Goal (issue 57): at most 12 series a GPU and 30 a node, healthy and during the hang, with the default
`export.series: standard`; the other settings print the same figures (beside_dcgm: a node that already
runs dcgm-exporter; full: every reading, as before the budget).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fakes.loopback import free_port  # noqa: E402
from watchdog.export.series import SERIES_MODES  # noqa: E402

GPUS = 8
GOAL_GPU, GOAL_NODE = 12, 30
_OPEN = re.compile(r"^stall_watchdog_episode_state\{.*\} [1-9]", re.M)  # an episode open (full: 0s too)
_GPU_LABEL = re.compile(r'[{,]gpu="[^"]')  # a GPU's (an alert of the whole node has gpu="")


def count(text: str) -> tuple[int, int, Counter[str]]:
    """(series with a gpu label, series without, per-GPU series by metric name) of one exposition."""
    per_gpu = node = 0
    names: Counter[str] = Counter()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if _GPU_LABEL.search(line):
            per_gpu += 1
            names[name] += 1
        else:
            node += 1
    return per_gpu, node, names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--series", dest="mode", default=SERIES_MODES[0], choices=SERIES_MODES,
                        help="the export.series setting (default: standard)")
    parser.add_argument("--seconds", type=float, default=75.0, help="how long the demo runs (default 75)")
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        command = [sys.executable, "-m", "watchdog", "demo", "--duration-seconds", str(args.seconds),
                   "--port", str(port), "--folder", str(folder / "demo"), "--series", args.mode]
        demo = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "TMPDIR": scratch})
        healthy: list[tuple[int, int, Counter[str]]] = []
        hung: list[tuple[int, int, Counter[str]]] = []
        try:
            while demo.poll() is None:
                time.sleep(2)
                try:
                    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
                except OSError:
                    continue
                if "stall_watchdog_rank_info{" not in text:
                    continue  # the ranks are not found yet
                (hung if _OPEN.search(text) else healthy).append(count(text))
        finally:
            output = demo.communicate(timeout=120)[0]
    if not healthy or not hung:
        print(output[-3000:])
        print("the demo did not reach both phases", file=sys.stderr)
        return 1
    ok = True
    mode = f"export.series: {args.mode}"
    print(f"series on the real daemon's /metrics, {GPUS} GPUs with one real rank each ({mode}):")
    for phase, scrapes in (("healthy", healthy), ("hang", hung)):
        per_gpu = max(s[0] for s in scrapes)
        node = max(s[1] for s in scrapes)
        worst = max(scrapes, key=lambda s: s[0])[2]
        ok &= args.mode == "full" or (per_gpu <= GOAL_GPU * GPUS and node <= GOAL_NODE)
        print(f"  {phase:8} {len(scrapes):3} scrapes: at most {per_gpu / GPUS:.2f} a GPU (goal <= {GOAL_GPU}), "
              f"{node} a node (goal <= {GOAL_NODE}), {per_gpu + node} in all")
        print("           a GPU: " + ", ".join(f"{name.removeprefix('stall_watchdog_')} {n / GPUS:g}"
                                               for name, n in sorted(worst.items())))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
