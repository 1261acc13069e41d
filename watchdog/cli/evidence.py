"""What `analyze` reads: every path given (a file, a folder, a bundle, a paste on standard input), each file
recognised by its content, within one budget of bytes for the whole run, into one Evidence.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from watchdog.boundary import rank_files, untrusted_data
from watchdog.coordinate import job_bundle
from watchdog.pasted import crash_log, kernel_log, smi_table
from watchdog.stacks import fr_dumps, fr_text, nccl_timeouts, progress_log, ras_report
from watchdog.stacks.formats import MAX_DUMP_BYTES, StackFormatError, from_json, parse_capture, parse_pyspy_json
from watchdog.stacks.fr_dumps import FlightRecorderError, RankTrace
from watchdog.stacks.paste import pasted
from watchdog.stacks.picture import StackPicture
from watchdog.stacks.pyspy_text import looks_like_pyspy, parse_text
from watchdog.stacks.ras_report import RasError, RasStatus
from watchdog.vocabulary.stack_model import StackDump

_BUNDLE_MARKER = ".stall-watchdog-bundle"
# Inside a folder, these are its notes (a README, a SOURCES.md), not what a job left: read only when named
_DOCUMENTS = (".md", ".markdown", ".rst", ".html", ".pdf")
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
    smi_tables: list[list[smi_table.SmiGpu]] = field(default_factory=list)  # nvidia-smi's tables, in order
    gpu_events: list[kernel_log.GpuEvent] = field(default_factory=list)  # Xid lines, GPUs lost, PCIe errors
    crashes: list[crash_log.Crash] = field(default_factory=list)  # the error each rank died of
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
        if path.suffix.lower() in _DOCUMENTS and path.is_file():
            found.skipped.append(f"{path}: a document ({path.suffix}), not evidence: name it on its own to read it")
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
    timeout_log = nccl_timeouts.looks_like_timeout_log(text)
    if timeout_log:
        found.timeout_lines.extend(nccl_timeouts.read_lines(text) or [""])  # read, if only to say so
        found.kinds.append("nccl timeout log")
        read = True
    if ras_report.looks_like_report(text) or text.lstrip().startswith(("Job summary", "NCCL version")):
        _add_ras(path, text, found)
        read = True
    if fr_text.looks_like(text):
        found.fr_text.append(fr_text.parse(text))
        found.kinds.append("flight recorder analyzer output")
        read = True
    read = _pasted(text, found, timeout_log) or read
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
            found.doubts.append(f"{steps}, but the log also says {trouble}" if trouble else
                                f"{steps}, beside the evidence above")
        else:
            found.progress.append(steps)
        read = True
    if not read:
        raise StackFormatError(f"{path}: none of the formats `analyze` reads (py-spy text or JSON, NCCL watchdog "
                               "timeout log, ncclras report, Flight Recorder dump or analyzer output, a training "
                               "log's step counter)")


def _pasted(text: str, found: Evidence, timeout_log: bool) -> bool:
    """What people paste beside stacks and timeouts: nvidia-smi's table, the kernel's GPU lines, a crash
    (`timeout_log`: the text is also a timeout log, whose own traceback and abort are no crash)."""
    read = False
    tables = smi_table.tables(text) if smi_table.looks_like(text) else []
    if tables:
        found.smi_tables.extend(tables)
        found.kinds.append("nvidia-smi table")
        read = True
    events = kernel_log.events(text) if kernel_log.looks_like(text) else []
    if events:
        found.gpu_events.extend(events)
        found.kinds.append("kernel log")
        read = True
    crashes = crash_log.crashes(text, generic=not timeout_log) if crash_log.looks_like(text) else []
    if crashes:
        found.crashes.extend(crashes)
        found.kinds.append("crash log")
        read = True
    return read


def _add_ras(path: Path, text: str, found: Evidence) -> None:
    """The RAS reports in a text; one given twice (the same file under two names) counts once: two copies of
    one report are not two queries whose counts did not move."""
    digest = hash(text)
    if digest in found.ras_seen:
        found.skipped.append(f"{path}: the same RAS report as one given before (counted once)")
        return
    found.ras_seen.add(digest)
    found.ras.extend(ras_report.parse_all(text))
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
