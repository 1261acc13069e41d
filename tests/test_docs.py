"""The README and docs/ as a newcomer follows them: every `stall-watchdog` command they show parses with the real
parser, the README's quick start runs as written, its Kubernetes overlay renders, its Prometheus, daemon and
Alertmanager blocks reach a page in a real Alertmanager, and every link lands on a file and heading that exist."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, need_tool
from tests.integration.test_prometheus import Sink, free_port, get_json, stop_all, until
from watchdog.cli.parser import build_parser

PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", REPO / "CONTRIBUTING.md",
         *sorted((REPO / "docs").glob("*.md"))]
SCRIPT = str(Path(sys.executable).with_name("stall-watchdog"))


def blocks(text: str, language: str | None = None) -> list[str]:
    """The fenced code blocks of a page, those of one language if given."""
    return [body for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
            if language is None or lang == language]


def section(text: str, heading: str) -> str:
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def commands(page: Path) -> Iterator[str]:
    """Each `stall-watchdog ...` command of a page's shell blocks and inline code, one line each (a backslash
    continuation joined, the comment, a pipe and what follows `&&` cut off)."""
    text = page.read_text()
    lines = [line for body in blocks(text) if not body.lstrip().startswith("usage:")
             for line in body.replace("\\\n", " ").splitlines()]
    lines += re.findall(r"`((?:\S*/)?stall-watchdog [^`]+)`", text)
    for line in lines:
        line = re.split(r"\s(?:#|\||&&|>)\s?", " ".join(line.split()), maxsplit=1)[0].strip()
        words = line.split()
        synopsis = " [" in line or " (--" in line  # the README's synopsis, which the parser itself writes
        if (words and words[0].endswith("stall-watchdog") and len(words) > 1 and re.fullmatch(r"[a-z-]+", words[1])
                and not synopsis):
            yield line


DOCUMENTED = [(page.relative_to(REPO).as_posix(), command) for page in PAGES if page.name != "cli.md"
              for command in commands(page)]


def test_the_docs_show_commands() -> None:
    """The collection itself: the quick start, the service, the coordinator and the recording commands."""
    shown = " ".join(command for _, command in DOCUMENTED)
    for verb in ("replay", "analyze", "doctor", "check-config", "coordinate", "record", "stacks dump"):
        assert f"stall-watchdog {verb}" in shown, verb


@pytest.mark.parametrize(("page", "command"), DOCUMENTED)
def test_every_documented_command_parses(page: str, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A command a page shows is one the parser takes: no flag renamed or removed under it (`doctor --all` once
    stood in a verdict for `--all-ranks`). A placeholder (PID, N) stands for a number where one is wanted."""
    words = [{"PID": "1234", "N": "1", "S": "5"}.get(w, "1234" if re.fullmatch(r"<\w+>", w) else w)
             for w in shlex.split(command)[1:]]
    try:
        build_parser().parse_args(words)
    except SystemExit as exc:
        error = capsys.readouterr().err.strip()
        # --help and --version exit 0; prose names a verb without its operands (`stacks analyze` reads ...)
        if exc.code != 0 and not re.search(r"error: (the following arguments are|one of the arguments .*) requ", error):
            pytest.fail(f"{page}: `{command}` does not parse: {error}")


def test_the_readme_quick_start_runs_as_written(tmp_path: Path) -> None:
    """The quick start's commands (past `make run`, which tests/test_demo.py runs on a clone), in a folder laid
    out as a checkout with its .venv: each exits as documented and says what the README says it does."""
    quick = blocks(section((REPO / "README.md").read_text(), "Quick start"), "sh")[0]
    lines = [line.split("  #", 1)[0].strip() for line in quick.splitlines()]
    for name in ("tests", "bench"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "stall-watchdog").symlink_to(SCRIPT)
    ran = []
    for line in lines:
        if line == "make run":
            continue
        result = subprocess.run(shlex.split(line), cwd=tmp_path, capture_output=True, text=True, timeout=300)
        allowed = {0, 3, 4} if " doctor" in line else {0}  # the doctor exits 4 on an error it finds (README)
        assert result.returncode in allowed, f"{line}: {result.returncode}\n{result.stdout[-999:]}{result.stderr[-99:]}"
        assert result.stdout.strip(), line
        ran.append((line, result.stdout))
    said = dict(ran)
    assert "FIRED" in said[".venv/bin/stall-watchdog replay sim:spin_hang"]
    assert (tmp_path / "odd-rank.html").stat().st_size > 10_000
    assert "busy_spin" in said[".venv/bin/stall-watchdog replay tests/data/h100_idle_matmul_spin.jsonl"]
    assert sum("HANG (critical)" in out for line, out in ran if " analyze " in line) == 2
    assert len(ran) == len(lines) - 1 >= 5


def test_the_readme_kubernetes_overlay_renders(tmp_path: Path) -> None:
    """The README's overlay, written as its heredoc writes it beside a copy of deploy/, renders with the real
    `kubectl kustomize`: the DaemonSet runs the named image, and the optional components are in."""
    kubectl = need_tool("kubectl")
    deploy = blocks(section((REPO / "README.md").read_text(), "Deploy"), "sh")
    [script] = [body for body in deploy if "kustomization.yaml <<'YAML'" in body]
    overlay = script.split("<<'YAML'\n", 1)[1].split("\nYAML\n", 1)[0]
    subprocess.run(["cp", "-r", str(REPO / "deploy"), str(tmp_path / "deploy")], check=True)
    (tmp_path / "my-watchdog").mkdir()
    (tmp_path / "my-watchdog" / "kustomization.yaml").write_text(overlay + "\n")
    result = subprocess.run([kubectl, "kustomize", "my-watchdog/"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    objects = list(yaml.safe_load_all(result.stdout))
    spec = next(o for o in objects if o["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    assert {c["image"] for c in spec["containers"]} == {"REGISTRY/stall-watchdog:0.1.0"}
    assert {"ServiceMonitor", "PrometheusRule"} <= {o["kind"] for o in objects}


def test_the_readmes_prometheus_and_alertmanager_blocks_reach_a_page(tmp_path: Path) -> None:
    """"Hook up Prometheus and alerts", done as written: its prometheus.yml (scrape job, the shipped rules, the
    Alertmanager), its daemon configuration (an alertmanager receiver) and its alertmanager.yml (critical pages)
    on a real Prometheus and Alertmanager, against a daemon playing a spin. Only what a test must change is
    changed: host names and ports to loopback, the rules' path to the checkout's, the intervals to 1 s, the
    receivers' URLs to a local sink, and the daemon's source to a simulated node (there is no GPU here)."""
    prometheus, alertmanager = need_tool("prometheus"), need_tool("prometheus-alertmanager")
    hookup = section((REPO / "README.md").read_text(), "Hook up Prometheus and alerts")
    prom_text, daemon_text, am_text = blocks(hookup, "yaml")
    ports = {name: free_port() for name in ("prom", "am", "node")}
    sink = Sink()
    processes: list[subprocess.Popen[bytes]] = []

    def start(args: list[str], log: str) -> None:
        processes.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=(tmp_path / log).open("wb")))

    try:
        am = yaml.safe_load(am_text)
        for receiver in am["receivers"]:
            for hook in receiver["webhook_configs"]:
                hook["url"] = f"{sink.url}/{receiver['name']}"
        (tmp_path / "am.yml").write_text(yaml.safe_dump(am))
        start([alertmanager, f"--config.file={tmp_path / 'am.yml'}", f"--storage.path={tmp_path / 'am-data'}",
               f"--web.listen-address=127.0.0.1:{ports['am']}", "--cluster.listen-address="], "am.log")
        am_url = f"http://127.0.0.1:{ports['am']}"
        until(lambda: get_json(am_url + "/api/v2/status"), 120, "Alertmanager to start")

        daemon = yaml.safe_load(daemon_text.replace("http://alertmanager:9093", am_url))
        daemon["export"]["listen_address"] = f"127.0.0.1:{ports['node']}"
        daemon.update(source={"kind": "sim", "scenario": "spin_hang", "start_offset_seconds": 292},
                      bundles={"directory": str(tmp_path / "incidents")})
        daemon["alerts"]["instance"] = "gpu-node-1"
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(daemon))
        start([SCRIPT, "run", "--config", str(tmp_path / "config.yaml")], "daemon.log")

        prom = yaml.safe_load(prom_text.replace("alertmanager:9093", f"127.0.0.1:{ports['am']}"))
        prom["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        prom["rule_files"] = [str(REPO / "deploy" / "prometheus" / "rules.yml")]
        [job] = prom["scrape_configs"]
        job["scrape_interval"] = "1s"
        job["static_configs"] = [{"targets": [f"127.0.0.1:{ports['node']}"]}]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(prom))
        start([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
               f"--storage.tsdb.path={tmp_path / 'prom-data'}", f"--web.listen-address=127.0.0.1:{ports['prom']}"],
              "prom.log")
        prom_url = f"http://127.0.0.1:{ports['prom']}"

        def query(q: str) -> list[dict[str, object]]:
            answer = get_json(f"{prom_url}/api/v1/query?" + urllib.parse.urlencode({"query": q}))
            return answer["data"]["result"]  # type: ignore[index,no-any-return]

        until(lambda: query('up{job="stall-watchdog"} == 1'), 180, "the scrape job the rules expect to be up")
        until(lambda: [r for r in query("ALERTS") if r["metric"]["alertname"] == "StallWatchdogBusySpin"], 240,
              "the shipped rule to raise StallWatchdogBusySpin")
        pages = until(lambda: [body for path, body in sink.received if path == "/pager"], 240, "a page")
        alerts = [a for body in pages for a in body["alerts"]]  # type: ignore[union-attr, index]
        assert {a["labels"]["alertname"] for a in alerts} == {"StallWatchdogBusySpin"}
        assert {a["labels"]["severity"] for a in alerts} == {"critical"}
        assert all(path != "/chat" or body["commonLabels"].get("severity") != "critical"
                   for path, body in sink.received)
        # One alert for the incident, whether the daemon or the rules reported it.
        held = get_json(am_url + "/api/v2/alerts?filter=alertname%3D%22StallWatchdogBusySpin%22")
        assert len(held) == 1, json.dumps(held)[:2000]  # type: ignore[arg-type]
    finally:
        stop_all(processes)
        sink.close()


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_pages_lands() -> None:
    anchors = {page: {_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", page.read_text(), re.M)} for page in PAGES}
    broken = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors.get(file, set()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_the_readme_is_a_page_and_the_rest_is_linked_from_it() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for page in (REPO / "docs").glob("*.md"):
        assert f"(docs/{page.name})" in readme, f"docs/{page.name} is not linked from the README"
    assert os.path.exists(REPO / "CHANGELOG.md") and "(CHANGELOG.md)" in readme


def test_the_figures_the_readme_states_are_the_configurations() -> None:
    """One truth per fact: each figure the README's opening, table and hook-up state is read from the
    configuration's defaults here (a default that moves fails this test until the page says the new figure)."""
    from watchdog.config import Config

    config = Config()
    readme = (REPO / "README.md").read_text()
    opening = readme[:readme.index("## ")]
    confirm = config.stacks.confirm_min_seconds
    assert f"critical in {confirm:g}-{confirm + 5:g} s (two looks at their stacks agree)" in opening
    assert f"in about {config.detectors.busy_spin.for_seconds:g} s" in opening
    assert f"(at most {config.detectors.zero_util.critical_after_seconds / 60:g} minutes)" in opening
    port = config.export.listen_address.rsplit(":", 1)[1]
    hookup = section(readme, "Hook up Prometheus and alerts")
    assert f"(default `{config.export.listen_address}`" in hookup and f"'0.0.0.0:{port}'" in hookup
    assert all(f":{port}'" in target for target in re.findall(r"'gpu-node-\d+:\d+'", hookup))
    compares = section(readme, "How it compares")
    assert f"about {config.detectors.busy_spin.for_seconds:g} s after it starts" in compares
    page = (REPO / "docs" / "how-it-works.md").read_text()
    lost = config.detectors.gpu_lost
    assert f"`gpu_lost.for_seconds` ({lost.for_seconds:g} s)" in page
    assert f"`gpu_lost.hung_for_seconds` ({lost.hung_for_seconds:g} s)" in page
