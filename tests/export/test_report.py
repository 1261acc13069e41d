"""The incident report in a real headless browser (Debian's chromium, driven by Playwright): it loads
from disk with no console errors, draws one series per GPU, highlights the culprit; a screenshot is kept
under test-output/ as an artifact."""

from __future__ import annotations

import html
import json
import math
import subprocess
import sys
import tracemalloc
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO, need_tool
from tests.fakes.daemon import daemon_config, stepping_clock
from watchdog.act.bundles import BundleStore, Incident
from watchdog.config import BundlesConfig
from watchdog.export import bundle_files, report
from watchdog.export.metrics import new_counters
from watchdog.sample import recording, sim
from watchdog.service import build
from watchdog.vocabulary.model import (
    EpisodeEvent,
    EventKind,
    GpuSample,
    NodeSnapshot,
    Severity,
    Signature,
    SnapshotBlock,
)

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


def test_a_replays_open_episode_lasts_to_the_recordings_end_and_an_unwritable_page_is_said_first(
        tmp_path: Path) -> None:
    """sim:spin_hang runs 10 minutes past its onset: its open episode read '30 s so far' (when its verdict was
    said); --report into a folder that is not there was found only after the whole replay."""
    out = tmp_path / "spin.html"
    result = subprocess.run([sys.executable, "-m", "watchdog", "replay", "sim:spin_hang", "--report", str(out)],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "still open</td><td>10 min 0 s so far" in out.read_text()
    result = subprocess.run([sys.executable, "-m", "watchdog", "replay", "sim:spin_hang", "--report",
                             str(tmp_path / "absent" / "x.html")], capture_output=True, text=True, cwd=REPO,
                            timeout=120)
    assert result.returncode == 1 and result.stdout == "", result.stdout[-500:]  # nothing replayed first
    assert "absent is no folder" in result.stderr, result.stderr


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
    page = report.render(report.ReportData("t", report.Drawn(snapshots), episodes, verdict="v",
                                           severity=report.overall_severity(episodes)))
    assert 'class="verdict critical"' in page and Incident(fired, []).name.endswith("busy_spin-gpu0")
    # no SM clock in this recording (as in every real nvidia-smi log here): said, not drawn empty
    assert page.count('data-signature="busy_spin"') == 2 and page.count('data-signature="zero_util"') == 2
    assert '<p class="absent muted" data-field="sm_clock_hertz">SM clock: not in this recording.</p>' in page
    # when each episode ended and how long it lasted; one still open says so, to the last snapshot drawn (190 s)
    assert "<td>90 s</td>" in page and "<td>still open</td><td>90 s so far</td>" in page


def _drawn_rows(drawn: report.Drawn) -> list[tuple[float, dict[str, dict[int, float | None]]]]:
    """Each snapshot's time and the readings drawn of it (a GPU without one left out), to compare."""
    return [(t, {name: {gpu: series[n] for gpu, series in by_gpu.items() if not math.isnan(series[n])}
                 for name, by_gpu in drawn.readings.items()})
            for n, t in enumerate(drawn.times)]


def _expected_rows(snapshots: list[NodeSnapshot]) -> list[tuple[float, dict[str, dict[int, float | None]]]]:
    return [(s.time_seconds, {name: {g.index: getattr(g, name) for g in s.gpus if getattr(g, name) is not None}
                              for name, *_ in report.PANELS}) for s in snapshots]


def test_a_bundles_timeline_holds_every_reading_of_its_recording(tmp_path: Path) -> None:
    snapshots = []  # GPUs that come and go, readings some GPUs lack: many short stretches read back
    for n in range(60):
        gpus = [GpuSample(index=i, utilization_ratio=(n * i % 7) / 7,
                          power_watts=None if (n + i) % 5 == 0 else 100.0 + n, sm_clock_hertz=1.4e9 if i != 2 else None)
                for i in range(4) if not (i == 3 and 20 <= n < 33) and not (i == 1 and n < 9)]
        snapshots.append(NodeSnapshot(1.9e9 + 2 * n, tuple(gpus)))
    (tmp_path / "summary.json").write_text("{}")
    with (tmp_path / "telemetry.jsonl").open("w") as f:
        recording.write(f, recording.header("bundle", "2030-03-17T17:46:40Z"), snapshots)
    timeline = report.from_bundle(tmp_path).timeline
    assert _drawn_rows(timeline) == _expected_rows(snapshots) and timeline.gpus == {0, 1, 2, 3}
    assert _drawn_rows(report.Drawn(snapshots)) == _expected_rows(snapshots)


def test_a_timeline_drawn_from_a_readers_block_skips_its_dropped_rows() -> None:
    nan = float("nan")
    fields = GpuSample._fields
    columns: list[object] = [None] * len(fields)
    columns[fields.index("index")] = [0, 1, 0, 1, 0, 1]
    columns[fields.index("utilization_ratio")] = np.array([1.0, 0.5, nan, 0.25, 0.75, 0.0])
    columns[fields.index("power_watts")] = np.array([300.0, 90.0, 310.0, 0.0, 320.0, 95.0])
    block = SnapshotBlock((10.0, 11.0, 12.0), (0, 1), tuple(columns),  # type: ignore[arg-type]
                          present=[True, True, True, False, True, True])  # GPU 1 dropped from the 2nd snapshot
    expected = _expected_rows(block.snapshots())
    assert _drawn_rows(report.Drawn([block])) == expected
    assert expected[1][1]["power_watts"] == {0: 310.0} and expected[1][1]["utilization_ratio"] == {}
    assert _drawn_rows(report.Drawn([block.snapshots()[0], block])) == [expected[0], *expected]


def test_a_timeline_with_a_most_keeps_an_even_stride_of_any_length() -> None:
    """A hand-made telemetry of any length is drawn in bounded memory: past `most` snapshots the timeline keeps
    every other one, evenly, whether they come one at a time or in a reader's blocks (report read them all)."""
    snapshots = [NodeSnapshot(100.0 + n, tuple(GpuSample(index=i, utilization_ratio=(n % 9) / 9, power_watts=n + i)
                                               for i in range(3))) for n in range(1000)]
    one_at_a_time = report.Drawn(snapshots, most=100)
    assert len(one_at_a_time) == 63 and list(one_at_a_time.times)[:3] == [100.0, 116.0, 132.0]  # 1,000 / 16
    assert _drawn_rows(one_at_a_time) == _expected_rows(snapshots[::16])
    fields = GpuSample._fields
    blocks = []
    for start in range(0, 1000, 37):  # blocks that straddle the stride's multiples
        part = snapshots[start:start + 37]
        columns: list[object] = [None] * len(fields)
        for name in ("index", "utilization_ratio", "power_watts"):
            columns[fields.index(name)] = [getattr(g, name) for s in part for g in s.gpus]
        blocks.append(SnapshotBlock(tuple(s.time_seconds for s in part), (0, 1, 2), tuple(columns)))  # type: ignore[arg-type]
    assert _drawn_rows(report.Drawn(blocks, most=100)) == _expected_rows(snapshots[::16])
    assert _drawn_rows(report.Drawn(snapshots[:100], most=100)) == _expected_rows(snapshots[:100])  # under it: all


def test_a_large_bundles_page_is_drawn_without_holding_its_telemetry(tmp_path: Path) -> None:
    """64 GPUs' 2 minutes of ten readings (0.7 MB of text; a 5-minute bundle's is 6 MB) drawn a stretch at a time:
    the page costs about what it draws (1.1 MiB at the most, traced), not a sample object per reading of the file
    read whole (5.8 MiB before; 33 MiB for a 5-minute bundle)."""
    gpus = list(range(64))
    with (tmp_path / "telemetry.jsonl").open("w") as f:
        f.write(json.dumps(recording.header("bundle", "2030-03-17T17:46:40Z")) + "\n")
        for n in range(120):
            columns = {"index": gpus, "utilization_ratio": [((n + g) % 10) / 10 for g in gpus],
                       "power_watts": [100.0 + n + g for g in gpus], "sm_clock_hertz": [1.98e9] * 64,
                       "memory_used_bytes": [70 << 30] * 64, "memory_total_bytes": [80 << 30] * 64,
                       "temperature_celsius": [60.0] * 64, "energy_joules": [1e6 + n] * 64,
                       "sm_activity_ratio": [0.5] * 64, "pids": [[1000 + g] for g in gpus]}
            f.write(json.dumps({"t": 1.9e9 + n, "gpus": columns}) + "\n")
    (tmp_path / "summary.json").write_text(json.dumps({"event": {"culprit_gpus": [3]}}))
    tracemalloc.start()
    try:
        page = report.render(report.from_bundle(tmp_path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert page.count('class="series"') == 3 * 64 and 'data-gpu="3" data-culprit="true"' in page
    assert peak < 3 << 20, f"{peak / 2**20:.1f} MiB at the most to draw the page"


def test_the_colour_says_the_severity_and_a_healthy_trace_is_not_amber() -> None:
    assert report.overall_severity([]) == "ok"
    assert report.overall_severity([{"severity": "warning"}]) == "warning"
    assert report.overall_severity([{"severity": "warning"}, {"severity": "critical"}]) == "critical"
    healthy = report.render(report.ReportData("t", report.Drawn(), [], headline="no episode", severity="ok"))
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


def test_a_clock_that_stepped_back_is_drawn_inside_the_chart_and_said() -> None:
    """A recording whose clock stepped back 30 s drew its later lines left of the chart, with no word."""
    snapshots = [NodeSnapshot(t, (GpuSample(index=0, utilization_ratio=1.0, power_watts=100.0),))
                 for t in (*range(1000, 1100, 10), *range(1060, 1200, 10))]
    page = report.render(report.ReportData("t", report.Drawn(snapshots)))
    xs = [float(point.split(",")[0]) for point in page.split('points="')[1].split('"')[0].split()]
    assert min(xs) >= 56 and max(xs) <= 960 - 12 and "clock stepped back 30 s" in page


def test_reports_help_says_the_limits_its_reader_keeps() -> None:
    result = subprocess.run([sys.executable, "-m", "watchdog", "report", "--help"], capture_output=True, text=True,
                            cwd=REPO, timeout=60)
    said = " ".join(result.stdout.split())
    assert f"at most {bundle_files.MAX_JSON_BYTES >> 20} MiB" in said
    assert f"at most {bundle_files.KEPT_SNAPSHOTS:,} of its snapshots" in said
