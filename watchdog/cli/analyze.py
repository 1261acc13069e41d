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
import sys
from dataclasses import dataclass, field
from pathlib import Path

from watchdog import rank_files, untrusted_data
from watchdog.cli.common import EXIT_FAILURE, EXIT_OK, error
from watchdog.cli.stacks import print_pictures
from watchdog.coordinate import job_bundle
from watchdog.model import Severity, Verdict
from watchdog.stack_model import StackDump
from watchdog.stacks import fr_dumps, fr_text, nccl_ras, nccl_timeouts, progress_log
from watchdog.stacks.analysis import Analysis, analyze
from watchdog.stacks.formats import MAX_DUMP_BYTES, StackFormatError, from_json, parse_capture, parse_pyspy_json
from watchdog.stacks.fr_dumps import FlightRecorderError, RankTrace
from watchdog.stacks.nccl_ras import RasError, RasStatus
from watchdog.stacks.paste import pasted
from watchdog.stacks.picture import StackPicture, named_by, with_job_evidence, with_notes
from watchdog.stacks.pyspy_text import looks_like_pyspy, parse_text
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
    timeout_lines: list[str] = field(default_factory=list)  # of the timeout logs, what their reader can use
    fr_text: list[fr_text.FrText] = field(default_factory=list)  # torchfrtrace / fr_trace output
    progress: list[str] = field(default_factory=list)  # a training log's counter rising: "iteration went from 1 to 9"
    doubts: list[str] = field(default_factory=list)  # a counter that rose in a log that also shows trouble
    ras_seen: set[int] = field(default_factory=set)  # the RAS texts read, so that a copy is not a second query
    skipped: list[str] = field(default_factory=list)  # "path: why", said on stderr, never dropped silently
    read_bytes: int = 0  # what this run has read, against MAX_TOTAL_BYTES


def _read(path: Path) -> bytes:
    """Every file `analyze` reads: a regular file of at most MAX_DUMP_BYTES (a FIFO or /dev/zero is an
    error, never a wait or an endless read)."""
    if str(path) == STDIN:
        data = sys.stdin.buffer.read(MAX_DUMP_BYTES + 1)
        if len(data) > MAX_DUMP_BYTES:
            raise StackFormatError(f"-: standard input over the {MAX_DUMP_BYTES // 2**20} MiB cap; {_TAIL_HINT}")
        return data
    try:
        return rank_files.read_given(path, MAX_DUMP_BYTES)
    except rank_files.RankFileError as exc:
        hint = f"; {_TAIL_HINT}" if "cap" in str(exc) else ""
        raise StackFormatError(str(exc) + hint) from None


STDIN = "-"  # `analyze -`: a paste on standard input
MAX_TOTAL_BYTES = 128 * 2**20  # what one run reads in all, whatever a folder holds: its memory stays bounded


def _charge(path: Path, found: Evidence) -> None:
    """A file's size charged to the run's total before it is read; StackFormatError (the file left out, said
    on stderr) when it would take the run past MAX_TOTAL_BYTES."""
    try:
        size = MAX_DUMP_BYTES if str(path) == STDIN else path.stat().st_size
    except OSError:
        size = 0  # the read says why
    if found.read_bytes + size > MAX_TOTAL_BYTES:
        raise StackFormatError(f"{path}: left out: this run read {found.read_bytes / 2**20:.0f} MiB, and one run "
                               f"reads at most {MAX_TOTAL_BYTES // 2**20} MiB in all; analyze it on its own")
    found.read_bytes += size
_TAIL_HINT = "give its last part instead (`tail -c 32M FILE > part.log`): a hang is at the end of a log"


def _json(path: Path, found: Evidence) -> object:
    """A JSON file of a bundle, charged to the run's total like any file."""
    _charge(path, found)
    try:
        return untrusted_data.loads_json(_read(path).decode("utf-8", errors="replace"), str(path))
    except untrusted_data.TooMuchData as exc:
        raise StackFormatError(str(exc)) from None
    except ValueError as exc:
        raise StackFormatError(f"{path}: not valid JSON ({str(exc)[:120]})") from None
    except RecursionError:
        raise StackFormatError(f"{path}: JSON nested too deeply") from None


def _job_bundle(folder: Path, found: Evidence) -> StackPicture:
    job = _json(folder / "job.json", found)
    if not isinstance(job, dict):
        raise StackFormatError(f"{folder}/job.json: not a job verdict")
    result = job_bundle.read(job, [_json(node, found) for node in sorted((folder / "nodes").glob("*.json"))
                                   if not node.is_symlink()])
    return StackPicture(result.job, None, bool(result.silent), result.analysis, result.verdict, fr=result.fr)


def _bundle(folder: Path, found: Evidence) -> None:
    for path in sorted((folder / "stacks").glob("*.json")):
        raw = _json(path, found)
        rank = int(path.name.split("-")[1]) if path.name.startswith("rank-") else None
        if isinstance(raw, list):
            found.dumps.extend(parse_pyspy_json(raw, str(path), rank))
        elif isinstance(raw, dict):
            found.dumps.extend(parse_capture(raw, str(path)))
    for path in sorted((folder / "flight_recorder").glob("*.json")):
        raw = _json(path, found)
        if isinstance(raw, dict):
            found.traces.append(RankTrace.from_json(raw))
    found.kinds.append("bundle")


def _folder(folder: Path, found: Evidence, depth: int = 0) -> None:
    if (folder / _JOB_MARKER).is_file() or (folder / "job.json").is_file():
        found.pictures.append(_job_bundle(folder, found))
        found.kinds.append("job bundle")
    elif (folder / _BUNDLE_MARKER).is_file():
        _bundle(folder, found)
    elif any(fr_dumps.looks_like_dump(p) for p in folder.iterdir()):
        for path in sorted(folder.iterdir()):
            if fr_dumps.looks_like_dump(path):
                try:
                    _charge(path, found)
                    found.traces.append(fr_dumps.read(path))
                except (FlightRecorderError, StackFormatError) as exc:  # one cut or foreign dump: the others count
                    _skip(found, path, exc)
        found.kinds.append("flight recorder dumps")
    else:
        _each_file(folder, found, depth)


def _each_file(folder: Path, found: Evidence, depth: int = 0) -> None:
    """A folder of evidence files of any kinds (py-spy text and JSON, timeout logs, RAS reports): each read
    on its own; one that is none of them is named in `skipped`, with why. Its folders are read too, one level
    down (`stacks dump --out` writes one per job when it found several)."""
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or path.name == "analysis.json":
            continue
        if path.is_symlink():
            found.skipped.append(f"{path}: a symbolic link, not followed inside a folder (name its target)")
            continue
        if path.is_dir():
            if depth == 0:
                _folder(path, found, depth + 1)
            else:
                found.skipped.append(f"{path}: a folder two levels down (name it on its own)")
            continue
        try:
            _file(path, found)
        except (StackFormatError, FlightRecorderError, RasError) as exc:
            _skip(found, path, exc)


def _file(path: Path, found: Evidence) -> None:
    """One file, by its content: a Flight Recorder dump, JSON (a RAS report or event, a job verdict, py-spy's
    JSON), or text, which may hold several kinds at once (a log with a RAS report after it, a timeout with the
    stacks pasted below): each kind it holds is read."""
    _charge(path, found)
    data = _read(path)
    head = data[:4096]
    if fr_dumps.starts_like_dump(head):
        found.traces.append(fr_dumps.parse(data, source=str(path)))
        found.kinds.append("flight recorder dump")
        return
    first = data[:1 << 20].decode("utf-8", errors="replace")  # judged on its first MiB, before all of it is decoded
    if b"\x00" in data[:1 << 20] or first.count("\ufffd") > 0.02 * len(first):
        raise StackFormatError(f"{path}: binary data, none of the formats `analyze` reads")
    text = pasted(data.decode("utf-8", errors="replace"))
    del data  # the bytes of a 64 MiB file are not kept while its text is read
    if text.lstrip().startswith(("{", "[")) and _json_file(path, text, found):
        return
    read = False
    if nccl_timeouts.looks_like_timeout_log(text):
        found.timeout_lines.extend(nccl_timeouts.read_lines(text) or [""])  # read, if only to say so
        found.kinds.append("nccl timeout log")
        read = True
    if nccl_ras.looks_like_report(text) or text.lstrip().startswith(("Job summary", "NCCL version")):
        _add_ras(path, text, found)
        read = True
    if fr_text.looks_like(text):
        found.fr_text.append(fr_text.parse(text))
        found.kinds.append("flight recorder analyzer output")
        read = True
    if looks_like_pyspy(text) or not read:
        dumps = parse_text(text, str(path))
        if dumps:
            found.dumps.extend(dumps)
            found.kinds.append("stacks")
            read = True
    steps = progress_log.steps(text)
    if steps:
        # A counter that rose is progress only in a log that shows nothing wrong: every hung job's log shows its
        # steps rising before the hang.
        trouble = None if read else progress_log.trouble(text)
        if read or trouble:
            found.doubts.append(f"{steps}, then {trouble or 'the evidence above'}")
        else:
            found.progress.append(steps)
        read = True
    if not read:
        raise StackFormatError(f"{path}: none of the formats `analyze` reads (py-spy text or JSON, NCCL watchdog "
                               "timeout log, ncclras report, Flight Recorder dump or analyzer output, a training "
                               "log's step counter)")


def _add_ras(path: Path, text: str, found: Evidence) -> None:
    """The RAS reports in a text; one given twice (the same file under two names) counts once: two copies of
    one report are not two queries whose counts did not move."""
    digest = hash(text)
    if digest in found.ras_seen:
        found.skipped.append(f"{path}: the same RAS report as one given before (counted once)")
        return
    found.ras_seen.add(digest)
    found.ras.extend(nccl_ras.parse_all(text))
    found.kinds.append("ncclras report")


def _json_file(path: Path, text: str, found: Evidence) -> bool:
    """A JSON file by its shape; False when it is not JSON (a log whose first line starts with '[')."""
    try:
        data = untrusted_data.loads_json(text, str(path))
    except untrusted_data.TooMuchData as exc:
        if not untrusted_data.starts_as_json(text):
            return False  # a log whose first line begins with '['
        raise StackFormatError(str(exc)) from None
    except (ValueError, RecursionError):
        return False
    if isinstance(data, dict) and ("communicators" in data or data.get("event") == "PEER_DEAD"):
        _add_ras(path, text, found)
    elif isinstance(data, dict) and "odd_ranks" in data:
        if path.name != "job.json":  # its nodes are read from its folder: only a bundle's own job.json names one
            raise StackFormatError(f"{path}: a job verdict not named job.json; give its job bundle's folder")
        found.pictures.append(_job_bundle(path.parent, found))
        found.kinds.append("job bundle")
    else:
        dumps = from_json(data, str(path))
        if not dumps:
            raise StackFormatError(f"{path}: no stack found (expected py-spy output: 'Thread N (idle): ...')")
        found.dumps.extend(dumps)
        found.kinds.append("stacks")
    return True


def _skip(found: Evidence, path: Path, exc: Exception) -> None:
    """A path not read, said once with why (the error's own message names the path, or is given it)."""
    found.skipped.append(str(exc) if str(path) in str(exc) else f"{path}: {exc}")


def gather(paths: list[str]) -> Evidence:
    """Everything the paths hold. A path that cannot be read is named in `skipped` with why, and the others
    are still read: one bad file among many never costs the verdict on the rest."""
    found = Evidence()
    for name in paths:
        path = Path(name)
        if name == STDIN:
            try:
                _file(path, found)
            except StackFormatError as exc:
                found.skipped.append(str(exc))
            continue
        if not path.exists() and not path.is_symlink():
            found.skipped.append(f"{path}: no such file or folder")
            continue
        try:
            _folder(path, found) if path.is_dir() else _file(path, found)
        except (StackFormatError, FlightRecorderError, RasError) as exc:
            _skip(found, path, exc)
    return found


def _ras(found: Evidence) -> nccl_ras.RasFinding | None:
    """The RAS reports given, judged: the first and the last as two queries when there are several."""
    if not found.ras:
        return None
    return nccl_ras.judge(found.ras[0], found.ras[-1] if len(found.ras) > 1 else None)


def picture_of(found: Evidence, name: str) -> StackPicture:
    """One verdict over everything read. A hang where any evidence shows one; NO_STALL only on positive
    evidence of progress (RAS counts that moved between two reports, a training log's counter rising) with
    nothing stuck; otherwise UNKNOWN, saying what was read and what it cannot tell."""
    fr = fr_dumps.analyze(found.traces) if found.traces else None
    ras = _ras(found)
    timeouts = nccl_timeouts.parse_lines(found.timeout_lines) if found.timeout_lines else None
    frt = fr_text.FrText(tuple(m for f in found.fr_text for m in f.mismatches),
                         tuple(sorted({r for f in found.fr_text for r in f.behind_in_table})),
                         tuple(e for f in found.fr_text for e in f.entries)) if found.fr_text else None
    notes = [n for n in (timeouts.summary if timeouts else None, fr.summary if fr else None,
                         ras.summary if ras else None, frt.summary if frt else None) if n]
    if found.dumps:
        analysis = analyze(found.dumps)
        decided = with_job_evidence(verdict(analysis), fr, ras)
        others = _stuck_elsewhere(timeouts, fr, ras, frt)
        if decided.kind in ("unknown", "no_stall") and others:
            decided = Verdict("hang", Severity.CRITICAL, decided.sentence, _headline(found, timeouts, fr, ras, frt))
        decided = with_notes(decided, [n for n in notes if n not in decided.sentence])
        return StackPicture(name, None, False, analysis, decided, fr=fr, ras=ras, timeouts=timeouts)
    culprits = _culprits(timeouts, fr, ras, frt)
    stuck = _stuck_elsewhere(timeouts, fr, ras, frt)
    headline = _headline(found, timeouts, fr, ras, frt)
    if stuck:
        decided = Verdict("hang", Severity.CRITICAL, ". ".join(notes), headline)
    elif ras is not None and ras.behind:
        why = ("One RAS report cannot tell a stuck rank from a slow one: give two taken a few seconds apart"
               if ras.queries == 1 else "The counts moved between the two reports: a slow rank, not a stuck one")
        decided = Verdict("waiting", Severity.WARNING, ". ".join(notes) + ". " + why, headline)
    elif found.progress or (ras is not None and ras.moving):
        moved = found.progress + (["the RAS counts moved between the two reports"] if ras and ras.moving else [])
        decided = Verdict("no_stall", None, ". ".join(notes + [f"Progress: {'; '.join(moved)}"]),
                          "the job was making progress: " + moved[0])
    else:
        decided = Verdict("unknown", None, ". ".join(notes + [f"Steps: {d}" for d in found.doubts] +
                                                     [_cannot_tell(found, timeouts, ras, frt)]),
                          "cannot tell: " + _read_what(found))
    analysis = Analysis((), tuple(f"rank {r}" for r in culprits), ". ".join(notes), 0)
    return StackPicture(name, None, False, analysis, decided, fr=fr, ras=ras, timeouts=timeouts)


def _culprits(timeouts: nccl_timeouts.TimeoutFinding | None, fr: fr_dumps.FlightRecorderAnalysis | None,
              ras: nccl_ras.RasFinding | None, frt: fr_text.FrText | None) -> list[int]:
    return sorted({*(fr.culprits if fr else ()), *(ras.culprits if ras else ()),
                   *(timeouts.culprits if timeouts else ()), *(frt.culprits if frt else ())})


def _stuck_elsewhere(timeouts: nccl_timeouts.TimeoutFinding | None, fr: fr_dumps.FlightRecorderAnalysis | None,
                     ras: nccl_ras.RasFinding | None, frt: fr_text.FrText | None) -> bool:
    """Whether evidence beyond the stacks shows the job stuck: a watchdog timeout (the job waited past its
    collective timeout), a Flight Recorder mismatch, a rank RAS declared dead, missing or stuck."""
    return bool(timeouts and timeouts.read) or bool(fr and (fr.culprits or fr.stuck)) or \
        bool(ras and (ras.stuck or ras.broken)) or bool(frt and frt.culprits)


def _headline(found: Evidence, timeouts: nccl_timeouts.TimeoutFinding | None,
              fr: fr_dumps.FlightRecorderAnalysis | None, ras: nccl_ras.RasFinding | None,
              frt: fr_text.FrText | None) -> str:
    """Who the job waits on and which evidence names them, from the fields; else what the evidence shows."""
    sources = [source for source, named in (("NCCL timeout logs", timeouts is not None and timeouts.culprits),
                                             ("Flight Recorder", fr is not None and fr.culprits),
                                             ("NCCL RAS", ras is not None and ras.culprits),
                                             ("Flight Recorder analyzer", frt is not None and frt.culprits)) if named]
    culprits = _culprits(timeouts, fr, ras, frt)
    if culprits:
        side = " (ahead of the others)" if ras and ras.behind and all(b.ahead for b in ras.behind) else ""
        return f"the job waits on {named_by(culprits, ', '.join(sources))}{side}"
    if timeouts is not None and timeouts.group_suspects:
        return "the job waits on " + timeouts.group_suspects[0]
    if ras is not None and (ras.dead or ras.unreached):
        return "a process of the job is dead or unreachable (NCCL RAS); no rank is named"
    if timeouts is not None and timeouts.events:
        ranks = {e.rank for e in timeouts.events}
        if len(ranks) == 1:
            return f"{timeouts.events[0].who()} timed out; the others' logs are not here: which rank never arrived " \
                   "is in theirs"
        if timeouts.silent:
            return f"{len(ranks)} ranks timed out at the same work; no line from the others here: look at theirs"
        return f"all {len(ranks)} ranks that logged timed out at the same work: the transport, or a rank not in " \
               "this log (run the doctor)"
    if timeouts is not None and timeouts.stuck_watchdogs:
        return "a rank's watchdog thread hung (a CUDA or NCCL call that never returned)"
    return "the job is stuck; no rank is named"


def _read_what(found: Evidence) -> str:
    kinds = sorted(set(found.kinds)) or ["nothing"]
    return ", ".join(kinds) + " read, none shows a rank stuck or the job moving"


def _cannot_tell(found: Evidence, timeouts: nccl_timeouts.TimeoutFinding | None, ras: nccl_ras.RasFinding | None,
                 frt: fr_text.FrText | None) -> str:
    why = []
    if timeouts is not None and not timeouts.read:
        why.append("the timeout log's lines could not be read" + (f" ({timeouts.unread} named the watchdog)"
                                                                  if timeouts.unread else ""))
    if ras is not None and not ras.behind and not ras.broken:
        why.append("one RAS report with no rank behind cannot tell a job at work from one whose ranks all wait in "
                   "the same collective" if ras.queries == 1 else "the RAS counts did not move between the reports")
    if frt is not None and not frt.culprits:
        why.append("the Flight Recorder output names no missing rank")
    return "Cannot tell: " + ("; ".join(why) if why else "nothing read shows progress or a hang")


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
        found = Evidence(traces=found.traces, ras=found.ras, timeout_lines=found.timeout_lines, fr_text=found.fr_text,
                         progress=found.progress, doubts=found.doubts, kinds=[k for k in found.kinds if k != "stacks"])
    if found.dumps or found.traces or found.ras or found.timeout_lines or found.fr_text or found.progress or \
            found.doubts:
        pictures.append(picture_of(found, name))
    if not pictures:
        error("nothing to analyse in " + ", ".join(args.paths))
        return EXIT_FAILURE
    print_pictures(pictures, args.json)
    return EXIT_OK
