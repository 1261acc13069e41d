"""`stall-watchdog analyze` on real third-party evidence: timeout logs, NCCL RAS reports, py-spy dumps and Flight
Recorder analyzer output taken from public repositories and NCCL's and PyTorch's own documentation
(bench/evidence/SOURCES.md has each item's address), plus the raw excerpts of ../shared/realdata, read in place.

Each item's label (bench/evidence/manifest.json) was written from what the file shows, before the tool ran on it:

  expect    stuck (the job is hung or timed out), progress (the file shows the job moving), unclear (it cannot tell)
  culprits  the global ranks the file shows the others wait on; [] when it shows none behind; null: it does not say

  (the field corpus, bench/evidence/field: also `crash`, a process or GPU that died of an error; and
  `held_out`, a quarter of the items chosen by their names' digest before any reader was changed for them)

Scored per item:
  right             stuck: a hang/waiting/remote verdict naming exactly the labelled culprits (when labelled);
                    progress: no_stall; unclear: any verdict but no_stall, naming the labelled culprits if any;
                    crash: a crash verdict naming the labelled culprits (when labelled)
  false all-clear   no_stall where the label is stuck, unclear or crash
  false hang        a hang verdict (suspected or not) where the label is progress
  refused           analyze exited non-zero or printed nothing on an item of a format the docs list
                    (on a plain training log, kind "mixed", that is counted as wrong)
  wrong             anything else

    python bench/evidence.py [--verbose] [--perturb] [--field] [--code OLD_CHECKOUT]

`--field` scores the field corpus (gathered for issue 55, labelled before the tool ran on it), the training part
and the held-out part apart; `--code` runs an older checkout's `analyze` on it (`git worktree add /tmp/old
<commit>`): the blind score of the code before it was changed for the corpus.

Goal (issue 39): right on >= 95%, no false all-clear, no refusal.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path


def _code() -> str:
    """The checkout whose `analyze` is scored: --code's, else this one."""
    if "--code" in sys.argv[:-1]:
        return str(Path(sys.argv[sys.argv.index("--code") + 1]).resolve())
    return str(Path(__file__).resolve().parents[1])


sys.path.insert(0, _code())

from watchdog.cli import main as cli  # noqa: E402

HERE = Path(__file__).resolve().parent / "evidence"
FIELD = HERE / "field"
_RANK = re.compile(r"^rank (\d{1,7})$")
_GPU = re.compile(r"^GPU (\d{1,3}) \(")  # an nvidia-smi table names the odd GPU by its index (and bus id)
_ORDER = {"crash": 5, "hang": 4, "waiting": 3, "remote": 3, "unknown": 1, "no_stall": 0}


def run(path: Path) -> tuple[int, list[dict[str, object]], str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli(["analyze", "--json", str(path)])
        except SystemExit as exc:
            code = int(exc.code) if isinstance(exc.code, int) else 2
        except Exception as exc:  # noqa: BLE001 -- a traceback is a refusal, said as one
            code, err = 3, io.StringIO(f"{type(exc).__name__}: {exc}")
    pictures = [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]
    return code, pictures, err.getvalue().strip()


def named(picture: dict[str, object]) -> set[int]:
    """The global ranks a picture names as the ones waited on."""
    ranks = {int(m.group(1)) for o in picture.get("outliers") or [] if (m := _RANK.match(str(o)))}
    for key in ("nccl_timeouts", "nccl_ras", "flight_recorder_analysis"):
        part = picture.get(key)
        if isinstance(part, dict):
            ranks |= {int(r) for r in part.get("culprits") or []}
    return ranks


def _wrap(text: str) -> str:
    """A terminal or a mail client's hard wrap at 80 columns, mid-word."""
    return "\n".join(line[i:i + 80] for line in text.splitlines() for i in range(0, max(len(line), 1), 80))


PERTURBATIONS = {
    "wrapped at 80 columns": _wrap,
    "quoted (Markdown '> ')": lambda text: "".join(f"> {line}\n" for line in text.splitlines()),
    "CRLF line ends": lambda text: text.replace("\n", "\r\n"),
}


def score(item: dict[str, object], perturb: str = "", folder: Path = HERE) -> tuple[str, str]:
    path = (folder / str(item["file"])).resolve()
    if not path.exists():
        return "missing", f"{path} not found"
    if perturb:
        if path.suffix == ".json":
            return "skipped", "JSON is not pasted as text"
        with tempfile.TemporaryDirectory() as folder:
            changed = Path(folder) / path.name
            changed.write_text(PERTURBATIONS[perturb](path.read_text()))
            return _judged(item, *run(changed))
    return _judged(item, *run(path))


def _judged(item: dict[str, object], code: int, pictures: list[dict[str, object]], err: str) -> tuple[str, str]:
    if code != 0 or not pictures:
        why = err.splitlines()[-1] if err else f"exit {code}"
        # A plain training log is no format the docs list: not reading it is a miss, not a refusal.
        return ("refused" if item["kind"] not in ("mixed", "progress_log") else "wrong"), why
    top = max(pictures, key=lambda p: _ORDER.get(str(p["verdict"]["kind"]), 0))  # type: ignore[index]
    kind = str(top["verdict"]["kind"])  # type: ignore[index]
    ranks = set().union(*(named(p) for p in pictures))
    said = f"{kind}: {top['verdict']['headline']}"  # type: ignore[index]
    culprits, gpus = item.get("culprits"), item.get("gpus")
    named_gpus = {int(m.group(1)) for p in pictures for o in p.get("outliers") or []  # type: ignore[attr-defined]
                  if (m := _GPU.match(str(o)))}
    # A label's GPUs stand for its ranks where the evidence names GPUs only (an nvidia-smi table of one node)
    fits = culprits is None or set(culprits) == ranks or (  # type: ignore[arg-type]
        bool(gpus) and not ranks and named_gpus == set(gpus))  # type: ignore[arg-type]
    expect = item["expect"]
    if kind == "no_stall" and expect in ("stuck", "unclear", "crash"):
        return "false all-clear", said
    if expect == "progress":
        return ("right" if kind == "no_stall" else "false hang" if kind == "hang" else "wrong"), said
    ok = (kind in ("hang", "waiting", "remote") and fits) if expect == "stuck" else \
        (kind == "crash" and fits) if expect == "crash" else fits
    return ("right" if ok else "wrong"), said + ("" if fits else f" [named {sorted(ranks)}, label {culprits}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--verbose", action="store_true", help="every item's outcome and verdict")
    parser.add_argument("--perturb", action="store_true",
                        help="also score every text item hard-wrapped at 80 columns, quoted, and with CRLF line ends")
    parser.add_argument("--field", action="store_true", help="the field corpus (bench/evidence/field), its held-out "
                        "part apart")
    parser.add_argument("--code", metavar="CHECKOUT", help="score this checkout's analyze (an older commit's worktree)")
    args = parser.parse_args()
    folder = FIELD if args.field else HERE
    items = json.loads((folder / "manifest.json").read_text())["items"]
    by_kind: dict[str, Counter[str]] = defaultdict(Counter)
    total: Counter[str] = Counter()
    parts: dict[str, Counter[str]] = defaultdict(Counter)
    for item in items:
        outcome, said = score(item, folder=folder)
        by_kind[str(item["kind"])][outcome] += 1
        total[outcome] += 1
        parts["held out" if item.get("held_out") else "the rest"][outcome] += 1
        if args.verbose or outcome != "right":
            shown = "(held out)" if item.get("held_out") and not args.verbose else said[:300]
            print(f"  {outcome:>15}  {item['file']}\n{'':>19}{shown}")
    print(f"\nreal evidence through `analyze` of {_code()}: {len(items)} items ({folder / 'manifest.json'})")
    print(f"  {'kind':>13}  {'items':>5}  {'right':>5}  {'wrong':>5}  {'refused':>7}  {'false all-clear':>15}  "
          f"{'false hang':>10}")
    for kind, counts in sorted(by_kind.items()):
        print(f"  {kind:>13}  {sum(counts.values()):>5}  {counts['right']:>5}  {counts['wrong']:>5}  "
              f"{counts['refused']:>7}  {counts['false all-clear']:>15}  {counts['false hang']:>10}")
    if args.field:
        for part, counts in sorted(parts.items()):
            print(f"  {part:>13}  {sum(counts.values()):>5}  {counts['right']:>5}  {counts['wrong']:>5}  "
                  f"{counts['refused']:>7}  {counts['false all-clear']:>15}  {counts['false hang']:>10}")
    if total["missing"]:
        print(f"  {total['missing']} items not found (../shared/realdata is read in place, beside the clone): "
              "scored over the rest")
    right = total["right"] / max(1, len(items) - total["missing"])
    met = right >= 0.95 and not total["false all-clear"] and not total["refused"] and not total["false hang"]
    print(f"  {'all':>13}  {len(items):>5}  {total['right']:>5}  {total['wrong']:>5}  {total['refused']:>7}  "
          f"{total['false all-clear']:>15}  {total['false hang']:>10}")
    print(f"  right {right:.0%} (goal >= 95%, no false all-clear, no refusal: {'met' if met else 'NOT met'})")
    if args.perturb:
        print("\nthe same items as people mangle them when they paste:")
        for name in PERTURBATIONS:
            counts = Counter(score(item, name, folder)[0] for item in items)
            scored = len(items) - counts["skipped"]
            print(f"  {name:>24}: {counts['right']} of {scored} right, {counts['wrong']} wrong, {counts['refused']} "
                  f"refused, {counts['false all-clear']} false all-clear")


if __name__ == "__main__":
    main()
