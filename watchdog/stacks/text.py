"""The grouped picture of a job's stacks, for a terminal."""

from __future__ import annotations

from watchdog.stacks.picture import StackPicture

_MAX_FRAMES = 12


def render(report: StackPicture) -> str:
    a, v = report.analysis, report.verdict
    lines = []
    title = f"job {report.job}"
    if report.world_size is not None:
        title += f" (world size {report.world_size}{', ranks on other nodes too' if report.spans_other_nodes else ''})"
    lines.append(title)
    severity = f" ({v.severity.value})" if v.severity else ""
    lines.append(f"  {v.title.upper()}{severity}: {v.sentence}")
    odd = set(a.outliers)
    for group in a.groups:
        marker = "*" if odd & set(group.members) else " "
        state = f", {group.state}" if group.state else ""
        members = ", ".join(group.members[:8]) + (f", +{len(group.members) - 8} more" if len(group.members) > 8 else "")
        lines.append(f" {marker}{group.count:>3} x {group.activity.text}{state}: {group.where}   [{members}]")
        for frame in group.frames[:_MAX_FRAMES]:
            lines.append(f"          {frame.function}" + (f" ({frame.where})" if frame.where else ""))
        if len(group.frames) > _MAX_FRAMES:
            lines.append(f"          ... {len(group.frames) - _MAX_FRAMES} outer frames")
    failed = [c for c in report.captures if c.result != "ok"]
    if report.captures:
        took = max(c.seconds for c in report.captures)
        blocking = sum(c.blocking for c in report.captures)
        lines.append(f"  captured {len(report.captures) - len(failed)} of {len(report.captures)} ranks in {took:.2f} s"
                     + (f" ({blocking} needed a blocking read)" if blocking else " (nonblocking)"))
    for capture in failed:
        lines.append(f"  ! pid {capture.target.pid}: {capture.result}: {capture.message}")
    for recorder in report.flight_recorder:
        lines.append(f"  flight recorder, rank {recorder.rank}: {recorder.result}: {recorder.message}")
    return "\n".join(lines)
