"""`analyze PATH...`: every kind of hang evidence, recognised by its content, read into one picture.

    py-spy text or JSON, `stacks dump --out` folders   the stacks, grouped; the odd ranks named
    incident and dump bundles                          their stacks, Flight Recorder dumps and RAS finding
    Flight Recorder dumps (pickle or JSON) or folders   matched per process group
    ncclras reports (JSON or text; two = stuck test)    the ranks behind
    NCCL watchdog timeout logs (one or many ranks)      the ranks behind by sequence number, the silent ones
    coordinator job bundles                             the job verdict across nodes, re-derived

The output is `stacks analyze`'s contract: `groups`, `outliers` ("rank N" / "pid N"), `summary`,
`verdict`, plus `flight_recorder` and `nccl_ras` when those were given.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from watchdog import rank_files
from watchdog.cli.common import EXIT_FAILURE, EXIT_OK, error
from watchdog.cli.stacks import print_pictures
from watchdog.coordinate.job_verdict import merge
from watchdog.coordinate.nodes import NodeAnswer
from watchdog.model import Severity, StackDump, Verdict
from watchdog.stacks import fr_dumps, nccl_ras, nccl_timeouts
from watchdog.stacks.analysis import Analysis, analyze
from watchdog.stacks.formats import MAX_DUMP_BYTES, StackFormatError, parse_capture, parse_pyspy_json
from watchdog.stacks.formats import load as load_stacks
from watchdog.stacks.fr_dumps import FlightRecorderError, RankTrace
from watchdog.stacks.nccl_ras import RasError, RasStatus
from watchdog.stacks.picture import StackPicture, named_by, with_job_evidence, with_notes
from watchdog.stacks.verdict import verdict

_BUNDLE_MARKER = ".stall-watchdog-bundle"
_JOB_MARKER = ".stall-watchdog-job-bundle"


@dataclass
class Evidence:
    dumps: list[StackDump] = field(default_factory=list)
    traces: list[RankTrace] = field(default_factory=list)
    ras: list[RasStatus] = field(default_factory=list)
    pictures: list[StackPicture] = field(default_factory=list)  # job bundles: already whole
    kinds: list[str] = field(default_factory=list)
    timeout_logs: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "path: why", said on stderr, never dropped silently


def _read(path: Path) -> bytes:
    """Every file `analyze` reads: a regular file of at most MAX_DUMP_BYTES (a FIFO or /dev/zero is an
    error, never a wait or an endless read)."""
    try:
        return rank_files.read_given(path, MAX_DUMP_BYTES)
    except rank_files.RankFileError as exc:
        raise StackFormatError(str(exc)) from None


def _json(path: Path) -> object:
    try:
        return json.loads(_read(path).decode("utf-8", errors="replace"))
    except ValueError as exc:
        raise StackFormatError(f"{path}: not valid JSON ({str(exc)[:120]})") from None
    except RecursionError:
        raise StackFormatError(f"{path}: JSON nested too deeply") from None


def _job_bundle(folder: Path) -> StackPicture:
    job = _json(folder / "job.json")
    if not isinstance(job, dict):
        raise StackFormatError(f"{folder}/job.json: not a job verdict")
    answers = []
    for node in sorted((folder / "nodes").glob("*.json")):
        raw = _json(node)
        if isinstance(raw, dict):
            answers.append(NodeAnswer(str(raw.get("instance")), raw.get("status"), raw.get("answer") or {},
                                      raw.get("error")))
    result = merge(str(job.get("training_job")), answers)
    return StackPicture(result.job, None, bool(result.silent), result.analysis, result.verdict, fr=result.fr)


def _bundle(folder: Path, found: Evidence) -> None:
    for path in sorted((folder / "stacks").glob("*.json")):
        raw = _json(path)
        rank = int(path.name.split("-")[1]) if path.name.startswith("rank-") else None
        if isinstance(raw, list):
            found.dumps.extend(parse_pyspy_json(raw, str(path), rank))
        elif isinstance(raw, dict):
            found.dumps.extend(parse_capture(raw, str(path)))
    for path in sorted((folder / "flight_recorder").glob("*.json")):
        raw = _json(path)
        if isinstance(raw, dict):
            found.traces.append(RankTrace.from_json(raw))
    found.kinds.append("bundle")


def _folder(folder: Path, found: Evidence) -> None:
    if (folder / _JOB_MARKER).is_file() or (folder / "job.json").is_file():
        found.pictures.append(_job_bundle(folder))
        found.kinds.append("job bundle")
    elif (folder / _BUNDLE_MARKER).is_file():
        _bundle(folder, found)
    elif any(fr_dumps.looks_like_dump(p) for p in folder.iterdir()):
        found.traces.extend(fr_dumps.read(p) for p in sorted(folder.iterdir()) if fr_dumps.looks_like_dump(p))
        found.kinds.append("flight recorder dumps")
    else:
        _each_file(folder, found)


def _each_file(folder: Path, found: Evidence) -> None:
    """A folder of evidence files of any kinds (py-spy text and JSON, timeout logs, RAS reports): each read
    on its own; one that is none of them is named in `skipped`, with why."""
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or path.name == "analysis.json" or path.is_dir():
            if path.is_dir() and not path.name.startswith("."):
                found.skipped.append(f"{path}: a folder inside a folder (name it on its own)")
            continue
        try:
            _file(path, found)
        except (StackFormatError, FlightRecorderError, RasError) as exc:
            found.skipped.append(str(exc) if str(path) in str(exc) else f"{path}: {exc}")


def _file(path: Path, found: Evidence) -> None:
    data = _read(path)
    head = data[:4096]
    stripped = head.lstrip()
    if fr_dumps.starts_like_dump(head):
        found.traces.append(fr_dumps.parse(data, source=str(path)))
        found.kinds.append("flight recorder dump")
    elif nccl_timeouts.looks_like_timeout_log(data[:1 << 20].decode("utf-8", errors="replace")):
        found.timeout_logs.append(data.decode("utf-8", errors="replace"))
        found.kinds.append("nccl timeout log")
    elif b'"communicators"' in head or b"Communicators" in head or head.startswith(b"Job summary"):
        found.ras.append(nccl_ras.parse(data.decode("utf-8", errors="replace")))
        found.kinds.append("ncclras report")
    elif stripped[:1] == b"{" and b'"odd_ranks"' in data:
        found.pictures.append(_job_bundle(path.parent))
        found.kinds.append("job bundle")
    else:
        found.dumps.extend(load_stacks(path))
        found.kinds.append("stacks")


def gather(paths: list[str]) -> Evidence:
    found = Evidence()
    for name in paths:
        path = Path(name)
        if not path.exists():
            raise StackFormatError(f"{path}: no such file or folder")
        try:
            _folder(path, found) if path.is_dir() else _file(path, found)
        except (FlightRecorderError, RasError) as exc:
            raise StackFormatError(f"{path}: {exc}") from None
    return found


def picture_of(found: Evidence, name: str) -> StackPicture:
    fr = fr_dumps.analyze(found.traces) if found.traces else None
    ras = nccl_ras.judge(found.ras[0], found.ras[1] if len(found.ras) > 1 else None) if found.ras else None
    timeouts = nccl_timeouts.parse("\n".join(found.timeout_logs)) if found.timeout_logs else None
    if found.dumps:
        analysis = analyze(found.dumps)
        decided = with_job_evidence(verdict(analysis), fr, ras)
        if timeouts is not None:
            decided = with_notes(decided, [timeouts.summary])
        return StackPicture(name, None, False, analysis, decided, fr=fr, ras=ras, timeouts=timeouts)
    culprits = sorted({*(fr.culprits if fr else ()), *(ras.culprits if ras else ()),
                       *(timeouts.culprits if timeouts else ())})
    notes = [n for n in (timeouts.summary if timeouts else None, fr.summary if fr else None,
                         ras.summary if ras else None) if n]
    # A watchdog timeout is a hang that already happened: the job waited past its collective timeout.
    stuck = bool(fr and fr.culprits) or bool(ras and (ras.stuck or ras.dead or ras.missing)) or \
        bool(timeouts and timeouts.events)
    # The headline from the fields (who, and which evidence names them), never cut out of a sentence.
    sources = [source for source, named in (("NCCL timeout logs", timeouts is not None and timeouts.culprits),
                                             ("Flight Recorder", fr is not None and fr.culprits),
                                             ("NCCL RAS", ras is not None and ras.culprits)) if named]
    who = named_by(culprits, ", ".join(sources)) if culprits else ""
    if stuck:
        headline = (f"the job waits on {who}" if who else
                    "every rank timed out in the same collective: the transport, not a rank (run the doctor)"
                    if timeouts is not None and timeouts.events else "the job is stuck; no rank is named")
        decided = Verdict("hang", Severity.CRITICAL, ". ".join(notes), headline)
    elif ras is not None and ras.behind:
        decided = Verdict("waiting", Severity.WARNING, ". ".join(notes) + ". One RAS report cannot tell a stuck "
                          "rank from a slow one: give two taken a few seconds apart",
                          f"{who or 'a rank'} behind the others in one RAS report")
    else:
        decided = Verdict("no_stall", None, ". ".join(notes) or "nothing to analyse", "no rank named")
    analysis = Analysis((), tuple(f"rank {r}" for r in culprits), ". ".join(notes), 0)
    return StackPicture(name, None, False, analysis, decided, fr=fr, ras=ras, timeouts=timeouts)


def cmd_analyze(args: argparse.Namespace) -> int:
    found = gather(args.paths)
    for skipped in found.skipped:
        error(f"skipped {skipped}")
    name = args.paths[0] if len(args.paths) == 1 else f"{len(args.paths)} paths"
    pictures = list(found.pictures)
    jobs = sorted({d.job for d in found.dumps})
    if len(jobs) > 1:  # never one verdict over unrelated processes: each job (or program) on its own
        more = f", and {len(jobs) - 8} more" if len(jobs) > 8 else ""
        named = ", ".join(job or "unnamed" for job in jobs[:8]) + more
        error(f"these stacks come from {len(jobs)} different jobs or programs ({named}): each is analysed on its own")
        pictures += [picture_of(Evidence(dumps=[d for d in found.dumps if d.job == job]), f"{name}: {job or 'unnamed'}")
                     for job in jobs]
        found = Evidence(traces=found.traces, ras=found.ras, timeout_logs=found.timeout_logs)
    if found.dumps or found.traces or found.ras or found.timeout_logs:
        pictures.append(picture_of(found, name))
    if not pictures:
        error("nothing to analyse in " + ", ".join(args.paths))
        return EXIT_FAILURE
    print_pictures(pictures, args.json)
    return EXIT_OK
