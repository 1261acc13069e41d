"""Regenerates every file (and docs table) made from a fact kept elsewhere, so each fact has one home:

    config.example.yaml                       the configuration model (watchdog/config/)
    docs/configuration.md, the reference      the same model
    docs/metrics.md, the metric list          the series table (watchdog/export/series.py)
    docs/how-it-works.md, busy_spin's legs    the legs' order and their settings (watchdog/detect/busy_spin.py)
    docs/cli.md, README.md's synopsis         the command line's parser (watchdog/cli/parser.py)
    deploy/kubernetes/*                       config.example.yaml, the rules and the dashboard (render.py)

    make docs                      # rewrite what is out of date
    python tools/docs.py --check   # exit 1 and name what is out of date (the tests run this)

A table inside a hand-written page sits between `<!-- generated: NAME -->` and `<!-- end generated -->`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from watchdog.cli.reference import reference_markdown as cli_markdown  # noqa: E402
from watchdog.cli.reference import synopsis_markdown  # noqa: E402
from watchdog.config import example_yaml, reference_markdown  # noqa: E402
from watchdog.detect.busy_spin import legs_markdown  # noqa: E402
from watchdog.export.series import metric_list_markdown  # noqa: E402

# Each hand-written page's generated blocks, by name.
TABLES: dict[str, dict[str, Callable[[], str]]] = {
    "README.md": {"synopsis": synopsis_markdown},
    "docs/configuration.md": {"configuration": reference_markdown},
    "docs/metrics.md": {"metrics": metric_list_markdown},
    "docs/how-it-works.md": {"legs": legs_markdown},
}

CLI_HEAD = """# Command-line reference

Every command's `--help`, as the installed `stall-watchdog` prints it (generated from the parser by
`make docs`; a test fails when this page and the parser differ). The README's quick start and
[usage.md](usage.md) say what each is for.

"""


def with_tables(page: str) -> str:
    text = (REPO / page).read_text()
    for name, make in TABLES[page].items():
        # The block's own lines only: an empty block never reaches into the next one's end
        pattern = re.compile(rf"(<!-- generated: {name} -->\n)(?:(?!<!-- ).)*?(\n?<!-- end generated -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"docs.py: {page} has no <!-- generated: {name} --> block")
        text = pattern.sub(lambda m, make=make: m.group(1) + make() + m.group(2), text, count=1)  # type: ignore[misc]
    return text


OUTPUTS: dict[Path, Callable[[], str]] = {
    REPO / "config.example.yaml": example_yaml,
    REPO / "docs" / "cli.md": lambda: CLI_HEAD + cli_markdown(),
    **{REPO / page: (lambda page=page: with_tables(page)) for page in TABLES},  # type: ignore[misc]
}


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for path, make in OUTPUTS.items():  # config.example.yaml first: the Kubernetes ConfigMap is made from it
        made = make()
        if not path.exists() or path.read_text() != made:
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
