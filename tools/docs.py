"""Regenerates every file (and README table) made from a fact kept elsewhere, so each fact has one home:

    config.example.yaml                   the configuration model (watchdog/config/)
    README.md, configuration reference    the same model
    README.md, metric list                the metric table (watchdog/export/metrics.py)
    README.md, busy_spin's legs           the legs' order and their settings (watchdog/detect/busy_spin.py)
    deploy/kubernetes/*                   config.example.yaml, the rules and the dashboard (render.py)

    make docs                      # rewrite what is out of date
    python tools/docs.py --check   # exit 1 and name what is out of date (the tests run this)

A README table sits between `<!-- generated: NAME -->` and `<!-- end generated -->`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from watchdog.config import example_yaml, reference_markdown  # noqa: E402
from watchdog.detect.busy_spin import legs_markdown  # noqa: E402
from watchdog.export.metrics import metric_list_markdown  # noqa: E402

README_TABLES: dict[str, Callable[[], str]] = {"configuration": reference_markdown, "metrics": metric_list_markdown,
                                               "legs": legs_markdown}


def readme() -> str:
    text = (REPO / "README.md").read_text()
    for name, make in README_TABLES.items():
        # The block's own lines only: an empty block never reaches into the next one's end
        pattern = re.compile(rf"(<!-- generated: {name} -->\n)(?:(?!<!-- ).)*?(\n?<!-- end generated -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"docs.py: README.md has no <!-- generated: {name} --> block")
        text = pattern.sub(lambda m, make=make: m.group(1) + make() + m.group(2), text, count=1)  # type: ignore[misc]
    return text


OUTPUTS: dict[Path, Callable[[], str]] = {REPO / "config.example.yaml": example_yaml, REPO / "README.md": readme}


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for path, make in OUTPUTS.items():  # config.example.yaml first: the Kubernetes ConfigMap is made from it
        made = make()
        if path.read_text() != made:
            stale.append(path.relative_to(REPO))
            if not check:
                path.write_text(made)
    render = [sys.executable, str(REPO / "deploy" / "kubernetes" / "render.py")] + (["--check"] if check else [])
    rendered = subprocess.run(render, capture_output=True, text=True)
    if check:
        for path in stale:
            print(f"{path} is out of date: run make docs", file=sys.stderr)
        if rendered.returncode:
            print(rendered.stderr.replace("python deploy/kubernetes/render.py", "make docs"), end="", file=sys.stderr)
        return 1 if stale or rendered.returncode else 0
    for path in stale:
        print(f"wrote {path}")
    print(rendered.stdout, end="")
    return rendered.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
