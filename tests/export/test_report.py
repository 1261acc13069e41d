"""The incident report in a real headless browser (Debian's chromium, driven by Playwright): it loads
from disk with no console errors, draws one series per GPU, highlights the culprit; a screenshot is kept
under test-output/ as an artifact."""

from __future__ import annotations

import html
import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from tests.conftest import REPO, need_tool
from tests.fakes.daemon import daemon_config, stepping_clock
from watchdog.act.bundles import BundleStore, Incident
from watchdog.config import BundlesConfig
from watchdog.export import report
from watchdog.export.metrics import new_counters
from watchdog.sample import sim
from watchdog.service import build
from watchdog.vocabulary.model import EpisodeEvent, EventKind, GpuSample, NodeSnapshot, Severity, Signature

ARTIFACTS = REPO / "test-output"


def bundle_with_culprit(tmp_path: Path) -> Path:
    """A real bundle: odd_rank through the daemon, with a stacks.json naming rank 4."""
    service = build(daemon_config(tmp_path, source={"scenario": "odd_rank"}),
                    sim.SimSource(sim.SCENARIOS["odd_rank"], 1.0, 270, clock=stepping_clock()))
    daemon = service.daemon
    for _ in range(80):
        daemon.tick()
    service.close(timeout=5)
    (bundle,) = daemon.bundles.bundles()
    groups = [{"members": [f"rank {r}" for r in range(8) if r != 4], "activity": "collective",
               "collective": "all_reduce", "where": "all_reduce (train.py:42)", "state": "idle",
               "frames": [{"function": "all_reduce", "file": "torch/distributed/distributed_c10d.py", "line": 3252}]},
              {"members": ["rank 4"], "activity": "data_loading", "collective": None,
               "where": "DataLoader.__next__ -> Queue.get", "state": "idle",
               "frames": [{"function": "Queue.get", "file": "queue.py", "line": 171}]}]
    (bundle / "stacks.json").write_text(json.dumps([{"groups": groups, "outliers": ["rank 4"]}]))
    summary = json.loads((bundle / "summary.json").read_text())
    summary["ranks"] = [{"pid": 100 + r, "rank": r, "gpus": [r], "job": "run:demo"} for r in range(8)]
    (bundle / "summary.json").write_text(json.dumps(summary))
    report.write_for_bundle(bundle)
    return bundle


def test_report_command_rebuilds_the_page(tmp_path: Path) -> None:
    bundle = bundle_with_culprit(tmp_path)
    (bundle / "report.html").unlink()
    result = subprocess.run([sys.executable, "-m", "watchdog", "report", str(bundle)], capture_output=True,
                            text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == str(bundle / "report.html")
    page = (bundle / "report.html").read_text()
    assert "<script" not in page and "http://" not in page and "https://" not in page  # no network, no CDN
    assert page.count('class="series"') == 3 * 8 and '<tr class="culprit">' in page


def test_report_in_a_real_browser(tmp_path: Path) -> None:
    chromium = need_tool("chromium")
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright (make test does)")
    bundle = bundle_with_culprit(tmp_path)
    ARTIFACTS.mkdir(exist_ok=True)
    errors: list[str] = []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1100, "height": 1600})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}"))
        page.goto((bundle / "report.html").as_uri())
        assert errors == []
        for field in ("utilization_ratio", "power_watts", "sm_clock_hertz"):
            gpus = page.eval_on_selector_all(f'svg[data-field="{field}"] polyline.series',
                                             "nodes => nodes.map(n => n.dataset.gpu)")
            assert sorted(gpus, key=int) == [str(g) for g in range(8)], field
            assert page.locator(f'svg[data-field="{field}"] rect.episode').count() >= 1
        culprit = page.locator("tr.culprit")
        assert culprit.count() == 1 and "rank 4" in culprit.inner_text()
        assert culprit.evaluate("r => getComputedStyle(r.cells[0]).backgroundColor") != "rgba(0, 0, 0, 0)"
        assert page.locator(".group.outlier").count() == 1
        summary = json.loads((bundle / "summary.json").read_text())
        assert page.locator("h1").inner_text() == summary["headline"]  # said once, as the heading
        colour = {"warning": "rgb(255, 244, 229)", "critical": "rgb(253, 236, 236)"}[summary["severity"]]
        assert page.locator(".verdict").evaluate("e => getComputedStyle(e).backgroundColor") == colour
        widths = page.eval_on_selector_all('svg[data-field="power_watts"] polyline.series',
                                           "nodes => nodes.map(n => [n.dataset.gpu, n.getAttribute('stroke-width')])")
        assert {gpu for gpu, width in widths if float(width) > 2} == {"4"}  # the culprit drawn bold
        page.screenshot(path=str(ARTIFACTS / "incident-report.png"), full_page=True)
        browser.close()
    assert (ARTIFACTS / "incident-report.png").stat().st_size > 10_000


def test_replay_draws_the_trace_with_its_episodes(tmp_path: Path) -> None:
    out = tmp_path / "timeline.html"
    result = subprocess.run([sys.executable, "-m", "watchdog", "replay", "sim:checkpoint", "--report", str(out)],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    page = out.read_text()
    assert page.count('class="series"') == 3 * 8
    assert page.count('class="episode" data-signature="waiting"') == 3  # shaded in each panel


def test_report_data_from_events() -> None:
    fired = EpisodeEvent(EventKind.FIRED, Signature.BUSY_SPIN, Severity.CRITICAL, (0,), (), 1e9, 1e9 + 30, "spin")
    resolved = EpisodeEvent(EventKind.RESOLVED, Signature.BUSY_SPIN, Severity.CRITICAL, (0,), (), 1e9, 1e9 + 90,
                            "spin over")
    other = EpisodeEvent(EventKind.FIRED, Signature.ZERO_UTIL, Severity.CRITICAL, (0,), (), 1e9 + 100, 1e9 + 145, "z")
    episodes = report.episodes_from_events([fired, resolved, other])
    assert [(e["signature"], e["end"], e["summary"]) for e in episodes] == [
        ("busy_spin", 1e9 + 90, "spin"), ("zero_util", None, "z")]
    snapshots = [NodeSnapshot(1e9 + t, (GpuSample(index=0, utilization_ratio=1.0, power_watts=150.0),))
                 for t in range(0, 200, 10)]
    page = report.render(report.ReportData("t", snapshots, episodes, verdict="v",
                                           severity=report.overall_severity(episodes)))
    assert 'class="verdict critical"' in page and Incident(fired, []).name.endswith("busy_spin-gpu0")
    # no SM clock in this recording (as in every real nvidia-smi log here): said, not drawn empty
    assert page.count('data-signature="busy_spin"') == 2 and page.count('data-signature="zero_util"') == 2
    assert '<p class="absent muted" data-field="sm_clock_hertz">SM clock: not in this recording.</p>' in page
    # when each episode ended and how long it lasted; one still open says so
    assert "<td>90 s</td>" in page and "<td>still open</td><td>45 s so far</td>" in page


def test_the_colour_says_the_severity_and_a_healthy_trace_is_not_amber() -> None:
    assert report.overall_severity([]) == "ok"
    assert report.overall_severity([{"severity": "warning"}]) == "warning"
    assert report.overall_severity([{"severity": "warning"}, {"severity": "critical"}]) == "critical"
    healthy = report.render(report.ReportData("t", [], [], headline="no episode", severity="ok"))
    assert 'class="verdict ok"' in healthy and ".verdict.ok{background:#ecfdf3" in healthy


def test_a_bundle_page_says_the_headline_once_and_when_it_ended(tmp_path: Path) -> None:
    bundle = bundle_with_culprit(tmp_path)
    summary = json.loads((bundle / "summary.json").read_text())
    headline = summary["headline"]
    page = (bundle / "report.html").read_text()
    assert page.count(html.escape(headline)) == 1 and f"<h1>{html.escape(headline)}</h1>" in page
    assert page.count('data-culprit="true"') == 3  # GPU 4, bold in each of the three charts
    assert "GPU 4 (culprit: the others wait on it)" in page
    assert "<td>still open</td>" in page
    onset = summary["event"]["onset"]
    resolved = EpisodeEvent(EventKind.RESOLVED, Signature.WAITING, Severity.WARNING, (0,), (4,),
                            datetime.fromisoformat(onset).timestamp(), datetime.fromisoformat(onset).timestamp() + 560,
                            "over")
    store = BundleStore(BundlesConfig(directory=str(tmp_path)), new_counters(), report.write_for_bundle)
    store.record_end(str(bundle), resolved)
    page = (bundle / "report.html").read_text()
    assert "<td>9 min 20 s</td>" in page and "resolved " in page and "still open" not in page
