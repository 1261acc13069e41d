"""The incident report: one self-contained HTML page (inline SVG and CSS, no script, no network) that
works when opened from disk. A per-GPU timeline of utilization, power and SM clock around the onset with
the episodes shaded, the verdict sentence, the ranks, the grouped stacks with the outliers highlighted,
and the doctor's findings. Rendered from a bundle's own files, so `report BUNDLE_DIR` rebuilds it."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from watchdog.boundary import private_files
from watchdog.detect.summary import duration_text
from watchdog.export import bundle_files
from watchdog.export.report_readings import PANELS, Drawn
from watchdog.vocabulary.model import WORKLOAD_LABELS, EpisodeEvent, EventKind, Workload
from watchdog.vocabulary.stack_model import member_id
from watchdog.vocabulary.words import iso_time

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")
MAX_POINTS = 1200
_ROUND = (1, 1.2, 2, 3, 4, 5, 6, 8, 10)  # an axis tops at one of these x a power of ten: its half is round too


@dataclass
class ReportData:
    title: str
    timeline: Drawn
    episodes: list[dict[str, object]] = field(default_factory=list)  # onset/at as epoch seconds, signature
    verdict: str = ""
    severity: str = ""
    ranks: list[dict[str, object]] = field(default_factory=list)
    groups: list[dict[str, object]] = field(default_factory=list)
    outliers: list[str] = field(default_factory=list)
    doctor: list[dict[str, str]] = field(default_factory=list)
    naive_time: bool = False
    headline: str = ""  # the verdict in one line, said once, as the page's heading
    culprit_gpus: tuple[int, ...] = ()  # drawn bold and named in the legend
    actions: list[dict[str, object]] = field(default_factory=list)  # the actions policy's decisions and steps
    open_until: str = "when this page was written"  # an episode still open: until when it is seen


def episodes_from_events(events: Sequence[EpisodeEvent]) -> list[dict[str, object]]:
    """Fired (or escalated) episodes with the time they ended, for shading a replay's timeline."""
    episodes: dict[str, dict[str, object]] = {}
    for e in events:
        if e.event is EventKind.SUSPECTED:
            continue
        key = e.key or f"{e.signature.value}@{e.onset_seconds}"
        entry = episodes.setdefault(key, {"signature": e.signature.value, "onset": e.onset_seconds,
                                          "at": e.at_seconds, "end": None, "severity": e.severity.value,
                                          "summary": e.summary, "headline": e.headline,
                                          "culprit_gpus": list(e.culprit_gpus)})
        if e.event is EventKind.RESOLVED:
            entry["end"] = e.at_seconds
        else:
            entry.update(severity=e.severity.value, summary=e.summary, headline=e.headline, at=e.at_seconds,
                         culprit_gpus=list(e.culprit_gpus))  # `at`: when this headline was said
    return list(episodes.values())


def overall_severity(episodes: Sequence[dict[str, object]]) -> str:
    """critical, warning, or ok when no episode fired: the verdict's colour."""
    found = {str(e.get("severity")) for e in episodes}
    return "critical" if "critical" in found else "warning" if found else "ok"


def thin(count: int, limit: int = MAX_POINTS) -> range:
    """The snapshots drawn of `count`: every one, or an even stride of them down to about `limit`."""
    return range(0, count, max(1, count // limit))


def _stepped_back(times: Sequence[float]) -> float:
    """The largest step back of the snapshots' times, in seconds (0: none)."""
    return max((a - b for a, b in zip(times, times[1:]) if b < a), default=0.0)


def axis_top(peak: float) -> float:
    """The top of a panel's axis: the first round number at or above the peak (100 for a utilization that
    reaches 100%, 800 for 700 W, 40 for 37%), so its three labels (top, half, 0) are round numbers too."""
    if peak <= 0:
        return 1.0
    magnitude = 10.0 ** math.floor(math.log10(peak))
    return next(m * magnitude for m in _ROUND if m * magnitude >= peak * (1 - 1e-9))


def _svg_panel(data: ReportData, field_name: str, label: str, scale: float, unit: str, width: int = 960,
               height: int = 170) -> str:
    drawn = data.timeline
    kept = thin(len(drawn))
    if not kept:
        return ""
    t0 = min(drawn.times[n] for n in kept)  # a clock stepped back: its lines double back inside the chart
    t1 = max(max(drawn.times[n] for n in kept), t0 + 1)
    readings = sorted(drawn.readings[field_name].items())
    peak = max((v for _, series in readings for n in kept if (v := series[n]) == v), default=None)  # NaN: none
    if peak is None:  # nvidia-smi logs often leave a column out, or say [N/A]: say so, draw no empty chart
        return (f'<p class="absent muted" data-field="{field_name}">{html.escape(label)}: not in this '
                'recording.</p>')
    top = axis_top(peak * scale)
    left, right, pad = 56, 12, 18

    def x(t: float) -> float:
        return left + (t - t0) / (t1 - t0) * (width - left - right)

    def y(v: float) -> float:
        return pad + (1 - v / top) * (height - 2 * pad)

    parts = [f'<svg class="panel" data-field="{field_name}" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="{html.escape(label)} per GPU">']
    for ep in data.episodes:
        onset, end = float(ep["onset"]), float(ep.get("end") or t1)  # type: ignore[arg-type]
        if end < t0 or onset > t1:
            continue
        a, b = x(max(onset, t0)), x(min(end, t1))
        parts.append(f'<rect class="episode" data-signature="{html.escape(str(ep["signature"]))}" x="{a:.1f}" '
                     f'y="{pad}" width="{max(b - a, 1):.1f}" height="{height - 2 * pad}"><title>'
                     f'{html.escape(str(ep["signature"]))} from {html.escape(iso_time(onset, data.naive_time))}'
                     '</title></rect>')
    for fraction in (0.0, 0.5, 1.0):
        v = top * fraction
        parts.append(f'<line class="grid" x1="{left}" x2="{width - right}" y1="{y(v):.1f}" y2="{y(v):.1f}"/>'
                     f'<text class="axis" x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:g}</text>')
    parts.append(f'<text class="axis" x="{left}" y="12">{html.escape(label)} ({unit})</text>')
    parts.append(f'<text class="axis" x="{left}" y="{height - 3}">{html.escape(iso_time(t0, data.naive_time))}'
                 f'</text><text class="axis" x="{width - right}" y="{height - 3}" text-anchor="end">'
                 f'{html.escape(iso_time(t1, data.naive_time))}</text>')
    at = [f"{x(drawn.times[n]):.1f}," for n in kept]  # one x per snapshot drawn, shared by every GPU's line
    for gpu, series in readings:
        line = " ".join(at[i] + f"{y(v * scale):.1f}" for i, n in enumerate(kept) if (v := series[n]) == v)
        if line:
            odd = gpu in data.culprit_gpus
            marked = ' data-culprit="true"' if odd else ""
            parts.append(f'<polyline class="series" data-gpu="{gpu}"{marked} '
                         f'fill="none" stroke-width="{3.2 if odd else 1.4}" stroke="{PALETTE[gpu % len(PALETTE)]}" '
                         f'points="{line}"><title>GPU {gpu}{" (culprit)" if odd else ""}</title></polyline>')
    parts.append("</svg>")
    return "".join(parts)


def _legend(data: ReportData) -> str:
    gpus = sorted(data.timeline.gpus)

    def entry(g: int) -> str:
        odd = g in data.culprit_gpus
        return (f'<span{" class=culprit" if odd else ""}><i style="background:{PALETTE[g % len(PALETTE)]}"></i>'
                f'GPU {g}{" (culprit: the others wait on it)" if odd else ""}</span>')

    return '<p class="legend">' + " ".join(entry(g) for g in gpus) + "</p>"


def _table(rows: list[dict[str, object]], columns: list[str], culprits: set[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for row in rows:
        css = ' class="culprit"' if str(row.get("member")) in culprits else ""
        body.append(f"<tr{css}>" + "".join(f"<td>{html.escape(bundle_files.text(row.get(c, '')))}</td>"
                                           for c in columns) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1000px;color:#1d1d1f;padding:0 12px}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.verdict{font-size:15px;padding:12px 14px;border-radius:6px;background:#f3f4f6;border-left:5px solid #9ca3af}
.verdict.warning{background:#fff4e5;border-color:#f59e0b} .verdict.critical{background:#fdecec;border-color:#dc2626}
.verdict.ok{background:#ecfdf3;border-color:#16a34a} .muted{color:#666} .legend .culprit{font-weight:700}
svg.panel{width:100%;height:auto;display:block;margin:6px 0 14px;background:#fafafa;border:1px solid #eee}
.grid{stroke:#e5e5e5} .axis{font-size:11px;fill:#666} .episode{fill:#dc2626;fill-opacity:.12}
.legend span{margin-right:12px;font-size:12px} .legend i{display:inline-block;width:10px;height:10px;margin-right:4px}
table{border-collapse:collapse;width:100%;font-size:13px}
td,th{border-bottom:1px solid #eee;padding:4px 6px;text-align:left}
tr.culprit td{background:#fdecec;font-weight:600} pre{background:#f6f6f6;padding:8px;overflow:auto;font-size:12px}
.group.outlier{border-left:4px solid #dc2626;padding-left:8px} .sev-error,.sev-warning{color:#b91c1c;font-weight:600}
"""


def render(data: ReportData) -> str:
    """The headline once, as the heading; under it the rest of the verdict (why, the telemetry, the stacks),
    coloured by severity; then the timeline and the tables."""
    culprits = set(data.outliers)
    heading = data.headline or data.title
    rest = data.verdict.removeprefix(data.headline).lstrip(";. ") if data.headline else data.verdict
    parts = [f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{html.escape(data.title)}</title>"
             f"<style>{CSS}</style></head><body>", f"<h1>{html.escape(heading)}</h1>"]
    if data.headline and data.title != heading:
        parts.append(f'<p class="muted">{html.escape(data.title)}</p>')
    said = next((e for e in data.episodes if e.get("headline") == data.headline), None) if data.headline else None
    if said is not None:
        parts.append(f'<p class="muted">{html.escape(_when_said(said, data.naive_time, data.open_until))}</p>')
    if rest or data.severity:
        parts.append(f'<p class="verdict {html.escape(data.severity)}">{html.escape(rest or data.severity)}</p>')
    parts.append("<h2>Timeline</h2>" + _legend(data))
    back = _stepped_back(data.timeline.times)
    if back:
        parts.append(f'<p class="muted">The recording\'s clock stepped back {duration_text(back)} at the most: '
                     'its lines double back where it did.</p>')
    if not len(data.timeline):
        parts.append('<p class="absent muted">No snapshot to draw: the telemetry holds none (a dump\'s bundle has '
                     'no telemetry.jsonl).</p>')
    parts += [_svg_panel(data, *panel) for panel in PANELS]
    if data.episodes:
        one = len(data.episodes) == 1 and data.episodes[0].get("headline") == data.headline
        seen = max(data.timeline.times, default=0.0)
        parts.append("<h2>Episodes</h2>" + _table(
            [_episode_row(e, data.naive_time, seen) for e in data.episodes],
            ["signature", "severity", "onset", "verdict after", "end", "lasted", *([] if one else ["headline"])],
            set()))
    if data.actions:
        parts.append("<h2>Actions</h2>" + _table([_action_row(a, data.naive_time) for a in data.actions],
                                                 ["at", "decision", "after", "reason", "steps", "evidence"], set()))
    if data.ranks:
        scheduler = ["runs_in"] if any(r.get("runs_in") for r in data.ranks) else []  # the pod or Slurm job
        parts.append("<h2>Ranks</h2>" + _table(data.ranks, ["member", "rank", "pid", "gpus", *scheduler, "activity",
                                                           "where", "cpu_seconds", "write_bytes"], culprits))
    if data.groups:
        parts.append("<h2>Stacks</h2>")
        for group in data.groups:
            members = [str(m) for m in group.get("members", [])]  # type: ignore[attr-defined]
            odd = " outlier" if culprits & set(members) else ""
            frames = "\n".join(f"{f['function']} ({f['file']}:{f['line']})" for f in group.get("frames", []))  # type: ignore[attr-defined]
            parts.append(f'<div class="group{odd}"><p><b>{len(members)} x {html.escape(str(group.get("where")))}'
                         f'</b> <span class="muted">[{html.escape(", ".join(members))}]</span></p>'
                         f"<pre>{html.escape(frames)}</pre></div>")
    if data.doctor:
        parts.append("<h2>Doctor</h2><ul>" + "".join(
            f'<li><span class="sev-{html.escape(d["severity"])}">{html.escape(d["severity"])}</span> '
            f'<b>{html.escape(d["check"])}</b>: {html.escape(d["evidence"])}'
            + (f' <span class="muted">Fix: {html.escape(d["fix"])}</span>' if d.get("fix") else "") + "</li>"
            for d in data.doctor) + "</ul>")
    parts.append('<p class="muted">stall-watchdog incident report</p></body></html>')
    return "".join(parts)


def _when_said(episode: dict[str, object], naive: bool, open_until: str) -> str:
    """Under the heading: when in the episode its verdict (and the duration it quotes) was said, beside how long
    the episode lasted, so the two durations on the page read as what they are."""
    onset, at, end = float(episode["onset"]), float(episode["at"]), episode.get("end")  # type: ignore[arg-type]
    text = f"This verdict was said {duration_text(at - onset)} into the episode"
    if end is None:
        return f"{text}, which was still open {open_until}."
    return (f"{text}; the episode lasted {duration_text(float(end) - onset)}, "  # type: ignore[arg-type]
            f"to {iso_time(float(end), naive)}.")  # type: ignore[arg-type]


def _episode_row(episode: dict[str, object], naive: bool, seen: float) -> dict[str, object]:
    """When it began, when its verdict was said, when it ended, and how long it lasted: an episode still open
    says so, with how long so far (to `seen`, the last snapshot drawn, where it is later than the verdict)."""
    onset, at, end = float(episode["onset"]), float(episode["at"]), episode.get("end")  # type: ignore[arg-type]
    lasted = duration_text((float(end) if end is not None else max(at, seen)) - onset)  # type: ignore[arg-type]
    return {**episode, "onset": iso_time(onset, naive), "verdict after": duration_text(at - onset),
            "end": iso_time(float(end), naive) if end is not None else "still open",  # type: ignore[arg-type]
            "lasted": lasted if end is not None else f"{lasted} so far"}


def _action_row(record: dict[str, object], naive: bool) -> dict[str, object]:
    """One decision of the actions policy: when, what, why, and each step with its result."""
    at = record.get("at")
    listed = record.get("steps")
    steps = [st for st in listed if isinstance(st, dict)] if isinstance(listed, list) else []
    hang = record.get("hang_seconds")
    return {"at": iso_time(float(at), naive) if isinstance(at, (int, float)) else "",  # checked by from_bundle
            "decision": record.get("decision", ""), "reason": record.get("reason", ""),
            "after": duration_text(float(hang)) + " of hang" if _finite(hang) else "",  # type: ignore[arg-type]
            "steps": "; ".join(" ".join(bundle_files.text(st.get(k)) for k in ("action", "result"))
                               + f": {bundle_files.text(st.get('detail'))}" for st in steps),
            "evidence": record.get("evidence", "")}


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 1e15


def from_bundle(folder: Path) -> ReportData:
    """A bundle's page, from its files: BundleDamaged (naming the file and the field) for one that cannot be read
    or holds what the daemon never writes, TraceError for a telemetry line that is not a snapshot."""
    name = folder / "summary.json"
    summary = bundle_files.load_json(name, dict) or {}
    assert isinstance(summary, dict)
    event = bundle_files.mapping(summary.get("event"), f"{name}: event")
    timeline = bundle_files.telemetry(folder / "telemetry.jsonl")
    jobs = summary.get("jobs")
    if "verdict" not in summary and isinstance(jobs, list) and jobs and isinstance(jobs[0], dict):
        found = jobs[0]["verdict"] if isinstance(jobs[0].get("verdict"), dict) else {}
        summary = {**summary, "verdict": found.get("sentence", ""), "headline": found.get("headline", ""),
                   "severity": found.get("severity") or ""}
    stacks = bundle_files.stacks(folder / "stacks.json")
    activity = {m: g["activity"] for g in stacks["groups"] for m in g["members"]}
    where = {m: g["where"] for g in stacks["groups"] for m in g["members"]}
    ranks = []
    for n, raw in enumerate(bundle_files.listed(summary.get("ranks"), f"{name}: ranks")):
        r = bundle_files.mapping(raw, f"{name}: ranks[{n}]")
        member = member_id(r.get("pid"), r.get("rank"))
        h = stacks["host"].get(member, {})
        ranks.append({"member": member, "rank": r.get("rank"), "pid": r.get("pid"), "gpus": r.get("gpus"),
                      "runs_in": _runs_in(r.get("workload")), "activity": activity.get(member, ""),
                      "where": where.get(member, ""),
                      "cpu_seconds": h.get("cpu_seconds", ""), "write_bytes": h.get("write_bytes", "")})
    onset = event.get("onset")
    episodes = []
    resolved = summary.get("resolved")
    end = bundle_files.seconds_at(resolved, f"{name}: resolved") if resolved is not None else None
    if onset:
        start = bundle_files.seconds_at(onset, f"{name}: event.onset")
        episodes.append({"signature": bundle_files.text(event.get("signature")), "severity": summary.get("severity"),
                         "onset": start, "end": end,
                         "at": bundle_files.seconds_at(event["at"], f"{name}: event.at") if "at" in event else start,
                         "summary": event.get("summary"), "headline": summary.get("headline", "")})
    title = "stall-watchdog: " + (f"{bundle_files.text(event.get('signature'))} from {onset}" if onset
                                  else _plain_title(event))
    if end is not None:
        title += f", resolved {resolved}"
    culprit_gpus = _gpu_numbers(bundle_files.listed(event.get("culprit_gpus"), f"{name}: event.culprit_gpus"))
    actions = [bundle_files.mapping(a, f"{name}: actions[{n}]")
               for n, a in enumerate(bundle_files.listed(summary.get("actions"), f"{name}: actions"))]
    for n, a in enumerate(actions):
        if a.get("at") is not None:
            bundle_files.seconds_at(a["at"], f"{name}: actions[{n}].at")
    return ReportData(title, timeline, episodes, bundle_files.text(summary.get("verdict")),
                      bundle_files.text(summary.get("severity")), ranks, stacks["groups"], stacks["outliers"],
                      bundle_files.findings(folder / "doctor.json"),
                      headline=bundle_files.text(summary.get("headline")), culprit_gpus=culprit_gpus,
                      actions=actions, open_until="when its bundle was written")


def _runs_in(saved: object) -> str:
    """'pod ml/trainer-0 (container main), Slurm job 42 step 0' from a bundle's workload object."""
    if not isinstance(saved, dict):
        return ""
    known = {name: str(saved[name]) if saved.get(name) else None for name in WORKLOAD_LABELS}
    claimed = saved.get("claimed_by_environment")
    return Workload(**known, claimed=tuple(map(str, claimed)) if isinstance(claimed, list) else ()).describe()


def _plain_title(event: dict[str, object]) -> str:
    """For bundles written before headlines: the signature and the GPUs it names (the culprits first)."""
    culprits, gpus = _gpu_numbers(event.get("culprit_gpus")), _gpu_numbers(event.get("gpus"))
    signature = bundle_files.text(event.get("signature")) or "incident"
    if not culprits and not gpus:
        return signature
    return f"{signature} {'waiting on' if culprits else 'on'} GPUs {', '.join(map(str, culprits or gpus))}"


def _gpu_numbers(listed: object) -> tuple[int, ...]:
    """The GPU numbers of a bundle's list: whole numbers only (true is no GPU 1)."""
    return tuple(g for g in listed if isinstance(g, int) and not isinstance(g, bool)) if isinstance(listed, list) \
        else ()


def write_for_bundle(folder: Path) -> Path:
    """Render first, then write (a page that fails to render leaves the old one, never an empty file),
    replacing report.html atomically and never through a link planted there."""
    return private_files.write_text(folder / "report.html", render(from_bundle(folder)), replace=True)
