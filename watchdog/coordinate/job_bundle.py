"""The job bundle: one folder per job verdict, written whole (hidden, then renamed), files 0600.

    job.json          the job verdict: odd ranks, groups across nodes, Flight Recorder, NCCL RAS, nodes
    nodes/<node>.json each node's /v1/dump answer as it came (named by the instance and a digest of it)
    report.html       all of it on one self-contained page
"""

from __future__ import annotations

import contextlib
import hashlib
import html
import json
import re
import shutil
import time
from pathlib import Path

from watchdog.boundary import private_files

from .job_verdict import MAX_BUNDLE_BYTES, JobVerdict, merge
from .nodes import NodeAnswer, Placement

MARKER = ".stall-watchdog-job-bundle"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")[:80] or "job"


def _write(path: Path, text: str, budget: private_files.Budget | None = None) -> None:
    private_files.write_text(path, text, budget)


def _node_answer(answer: NodeAnswer, budget: private_files.Budget, reserved: int = 0) -> str:
    """A node's answer as it came (its bytes, or compact: indenting a deeply nested answer multiplies it
    hundreds of times), or a note saying it was left out when it would pass the bundle's budget less what is
    `reserved` for the notes of the nodes still to write."""
    head: dict[str, object] = {"instance": answer.instance, "status": answer.status, "error": answer.error}
    if answer.raw is None and answer.size:  # read but not kept: the answers kept before it filled the budget
        return _omitted(head, answer.size)
    if answer.raw is not None:  # UTF-8 JSON the coordinator parsed: put in as it came
        text = json.dumps(head, separators=(",", ":"))[:-1] + ',"answer":' + answer.raw.decode() + "}\n"
    else:
        text = json.dumps({**head, "answer": answer.body}, separators=(",", ":"), default=str) + "\n"
    size = len(text.encode())  # bytes, as the budget counts them
    return _omitted(head, size) if size > budget.limit - budget.spent - reserved else text


def _omitted(head: dict[str, object], size: int) -> str:
    """The note for a node whose answer is not kept: at most _NOTE_BYTES, its error cut until it fits (JSON
    writes a character outside ASCII as six bytes)."""
    said = head.get("error")
    error = said[:_ERROR_CHARS] if isinstance(said, str) else None
    while True:
        note = json.dumps({**head, "error": error,
                           "omitted": f"the answer ({size} bytes) would pass the job bundle's budget"}) + "\n"
        if len(note) <= _NOTE_BYTES or not error:
            return note
        error = error[:len(error) // 2]


# The most one node's note takes (its instance, host:port, at most 260 characters; its error, cut; the sentence):
# room for every node's note is kept before answers fill the budget, so a job of thousands of nodes still gets its
# bundle, every node said.
_NOTE_BYTES = 1024
_ERROR_CHARS = 300


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:  # removed by a rotation running beside this one
        return 0


def node_file_name(instance: str) -> str:
    """One file per instance, never two instances in one: `h:1` and `h_1` slug alike, so a short digest
    of the instance follows the slug."""
    return f"{_slug(instance)}-{hashlib.sha256(instance.encode()).hexdigest()[:8]}.json"


def _ours(path: Path) -> bool:
    return not path.is_symlink() and path.is_dir() and (path / MARKER).is_file()


def rotate(root: Path, keep: int) -> list[Path]:
    """Remove the oldest job bundles beyond `keep`, and half-written ones another process left (killed
    mid-write): only folders this service wrote (its marker inside)."""
    for left in root.iterdir():
        if left.name.startswith(".partial-") and not private_files.made_here(left.name) and _ours(left):
            shutil.rmtree(left, ignore_errors=True)
    ours = sorted((p for p in root.iterdir() if "-job-" in p.name and not p.name.startswith(".") and _ours(p)),
                  key=lambda p: (p.name[:16], _mtime(p)))
    removed = ours[:max(0, len(ours) - keep)]
    for old in removed:
        shutil.rmtree(old, ignore_errors=True)
    return removed


def write(root: str | Path, result: JobVerdict, keep: int = 200) -> Path:
    root = Path(root)
    private_files.make_dir(root, parents=True)
    name = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-job-{_slug(result.job)}"
    temporary = private_files.make_dir(root / private_files.unique_name(f".partial-{name}"))
    _write(temporary / MARKER, json.dumps({"written_by": "stall-watchdog coordinate"}) + "\n")
    budget = private_files.Budget(MAX_BUNDLE_BYTES)
    _write(temporary / "job.json", json.dumps(result.to_json(), indent=1, default=str) + "\n", budget)
    _write(temporary / "report.html", render(result), budget)
    nodes = private_files.make_dir(temporary / "nodes")
    for n, answer in enumerate(result.answers):
        reserved = (len(result.answers) - n - 1) * _NOTE_BYTES
        _write(nodes / node_file_name(answer.instance), _node_answer(answer, budget, reserved), budget)
    final = private_files.rename_free(temporary, root, name)
    with contextlib.suppress(OSError):  # the bundle is in place; the next write rotates again
        rotate(root, keep)
    return final


def read(job: dict[str, object], nodes: list[object]) -> JobVerdict:
    """A job bundle read back for `analyze`: job.json and each nodes/ file as parsed, the answers read at
    the same edge as live ones (a malformed one costs its node), with the placement Prometheus gave."""
    answers = []
    for node in nodes:
        if not isinstance(node, dict) or not isinstance(node.get("instance"), str):
            continue
        status, error, body = node.get("status"), node.get("error"), node.get("answer", {})
        if not isinstance(body, dict):
            body, error = {}, "a malformed answer: not an object"
        answers.append(NodeAnswer(node["instance"], status if isinstance(status, int) else None, body,
                                  str(error)[:300] if error is not None else None))
    return merge(str(job.get("training_job")), answers, Placement.from_json(job.get("rank_placement")))


def _rows(rows: list[list[object]], head: list[str]) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{cells}</tr>{body}</table>"


def render(result: JobVerdict) -> str:
    v = result.verdict
    odd = _rows([[o["member"], o["node"], o["pid"], o["gpus"], o["activity"], o["where"]] for o in result.odd],
                ["rank", "node", "pid", "GPU", "activity", "where"])
    groups = _rows([[g.count, ", ".join(g.members[:16]) + (" ..." if len(g.members) > 16 else ""), g.activity.name,
                     g.where] for g in result.analysis.groups], ["ranks", "members", "activity", "where"])
    nodes = _rows([[a.instance, a.body.get("node", ""), "answered" if a.answered else "no answer", a.status or "",
                    a.error or "", f"{a.seconds:.1f} s"] for a in result.answers],
                  ["instance", "node", "result", "HTTP", "error", "took"])
    extra = ""
    if result.fr is not None:
        extra += f"<h2>Flight Recorder</h2><p>{html.escape(result.fr.summary)}</p>"
    if result.ras is not None:
        extra += f"<h2>NCCL RAS</h2><p>{html.escape(str(result.ras.get('summary')))}</p>"
    severity = v.severity.value if v.severity else "none"
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(result.job)}: job verdict</title>
<style>body{{font:14px sans-serif;margin:2em;max-width:1100px}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}}.critical{{color:#b00}}
.warning{{color:#a60}}</style></head><body>
<h1>Training job {html.escape(result.job)}</h1>
<p class="{severity}"><b>{html.escape(v.title)} ({severity})</b>: {html.escape(v.headline)}</p>
<p>{html.escape(v.sentence)}</p>
<h2>Odd ranks</h2>{odd if result.odd else "<p>none named</p>"}
<h2>Stacks across nodes</h2>{groups}
{extra}
<h2>Nodes</h2><p>{sum(a.answered for a in result.answers)} of {len(result.answers)} answered in
{result.seconds:.1f} s.</p>{nodes}
</body></html>
"""
