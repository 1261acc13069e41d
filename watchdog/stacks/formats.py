"""Reading stack dumps in the forms people have them:

- py-spy's JSON (`py-spy dump --json`): a list of threads, each with its pid;
- py-spy's text, as pasted into issues (read by stacks/pyspy_text.py);
- the JSON fact files of ../shared/realdata/hang_stacks (`{"processes": [{"pid", "threads": [...]}]}`).

Frames are innermost first everywhere. A line that is none of these is prose and is ignored.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from watchdog.boundary import rank_files, untrusted_data
from watchdog.stacks.pyspy_text import MAX_FRAMES, MAX_FRAMES_TOTAL, MAX_NAME, MAX_THREADS, parse_text
from watchdog.vocabulary.stack_model import Frame, StackDump, ThreadStack, member_id

MAX_DUMP_BYTES = 64 * 2**20  # a saved dump, as a person hands it to `analyze` or `stacks analyze`


class StackFormatError(Exception):
    """A dump that cannot be read; the message names the file (and line)."""




def _frames(raw: object, key_function: str, key_file: str) -> tuple[Frame, ...]:
    if not isinstance(raw, list):
        return ()
    return tuple(Frame(_name(f.get(key_function)), _name(f.get(key_file)), _small_int(f.get("line")))
                 for f in raw if isinstance(f, dict))


def _name(value: object) -> str:
    """A name py-spy printed (a rank chooses its function, file and thread names): one line, bounded."""
    return untrusted_data.one_line(value[:MAX_NAME]) if isinstance(value, str) else ""


def _frame(function: str, file: str, line: int | None) -> Frame:
    """One Frame for each distinct frame: a job's ranks run the same code, so a 4,096-node job's answers name
    a few hundred frames millions of times (made once each, and held once). Bounded: cleared when full."""
    key = (function, file, line)
    found = _FRAMES.get(key)
    if found is None:
        if len(_FRAMES) >= _MAX_FRAMES_KEPT:
            _FRAMES.clear()
        found = _FRAMES[key] = Frame(function, file, line)
    return found


_FRAMES: dict[tuple[str, str, int | None], Frame] = {}
_MAX_FRAMES_KEPT = 1 << 16


def _small_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63 else None


def _bounded(data: object) -> Iterator[tuple[dict[str, Any], list[Any]]]:
    """py-spy's threads as they are read: at most MAX_THREADS threads of at most MAX_FRAMES frames
    (MAX_FRAMES_TOTAL in all, then 8 per thread); each thread with the frames kept of it."""
    if not isinstance(data, list):
        return
    total = 0
    for thread in data[:MAX_THREADS]:
        if not isinstance(thread, dict):
            continue
        raw_frames = thread.get("frames")
        frames: list[Any] = raw_frames if isinstance(raw_frames, list) else []
        if len(frames) > MAX_FRAMES:
            frames = frames[:MAX_FRAMES - 32] + frames[-32:]
        if total + len(frames) > MAX_FRAMES_TOTAL:
            frames = frames[:8]
        total += len(frames)
        yield thread, frames


def trim_pyspy_json(data: object) -> list[dict[str, Any]]:
    """py-spy's JSON as it is kept (bundles, answers) and read: the threads and frames _bounded keeps, names
    cut at MAX_NAME characters, only the fields py-spy writes with their types. Whatever a rank makes py-spy
    print, what is kept of it is bounded (about 3 MB of JSON at worst, against a few hundred KB for a real
    training rank)."""
    return [{"pid": _small_int(thread.get("pid")), "thread_id": _small_int(thread.get("thread_id")),
             "os_thread_id": _small_int(thread.get("os_thread_id")),
             "thread_name": _name(thread.get("thread_name")) or None,
             **({"active": bool(thread["active"])} if "active" in thread else {}),
             "frames": [{"name": _name(f.get("name")), "filename": _name(f.get("filename")),
                         "line": _small_int(f.get("line"))} for f in frames if isinstance(f, dict)]}
            for thread, frames in _bounded(data)]


def _stack(frames: list[Any]) -> tuple[Frame, ...]:
    """A thread's frames as Frames, made once for each distinct stack: a job's ranks mostly stand in the same
    few places, so the answers of a 4,096-node job repeat a few stacks tens of thousands of times. Keyed on
    the frames as they came (a stack whose names are longer than MAX_NAME, or not text, is made every time,
    so that what is kept stays bounded); cleared when full."""
    try:
        key = tuple([(f["name"], f["filename"], f["line"]) for f in frames])
        found = _STACKS.get(key)
    except (TypeError, KeyError):  # a frame that is not py-spy's shape, or a name that is not text
        key, found = None, None
    if found is not None:
        return found
    made = tuple(_frame(_name(f.get("name")), _name(f.get("filename")), _small_int(f.get("line")))
                 for f in frames if isinstance(f, dict))
    if key is not None and all(isinstance(n, str) and isinstance(f, str) and len(n) <= MAX_NAME
                               and len(f) <= MAX_NAME for n, f, _ in key):
        if len(_STACKS) >= _MAX_STACKS_KEPT:
            _STACKS.clear()
        _STACKS[key] = made
    return made


_STACKS: dict[tuple[tuple[object, object, object], ...], tuple[Frame, ...]] = {}
_MAX_STACKS_KEPT = 1 << 12


def parse_pyspy_json(data: object, source: str = "", rank: int | None = None,
                     gpus: tuple[int, ...] = ()) -> list[StackDump]:
    """`py-spy dump --json`: threads, each naming its pid. Threads group into one dump per pid. What is read
    of it is what trim_pyspy_json keeps."""
    by_pid: dict[int | None, list[ThreadStack]] = {}
    for thread, frames in _bounded(data):
        state = "active" if thread.get("active") else "idle" if "active" in thread else None
        by_pid.setdefault(_small_int(thread.get("pid")), []).append(
            ThreadStack(_small_int(thread.get("thread_id")), _name(thread.get("thread_name")) or None, state,
                        _stack(frames), _small_int(thread.get("os_thread_id"))))
    return [StackDump(member_id(pid, rank), tuple(threads), pid, rank, gpus, source)
            for pid, threads in by_pid.items()]


def parse_fact_json(data: dict[str, Any], source: str = "") -> list[StackDump]:
    """The hang_stacks fact files: {"processes": [{"pid", "threads": [{"thread_id", "name", "state",
    "frames": [{"function", "file", "line"}]}]}]}."""
    dumps = []
    processes = data.get("processes")
    for number, process in enumerate(processes[:MAX_THREADS] if isinstance(processes, list) else []):
        if not isinstance(process, dict):
            continue
        raw_threads = process.get("threads")
        threads = tuple(ThreadStack(_small_int(t.get("thread_id")), _name(t.get("name")) or None,
                                    t.get("state") if t.get("state") in ("active", "idle") else None,
                                    _frames(t.get("frames"), "function", "file"))
                        for t in (raw_threads[:MAX_THREADS] if isinstance(raw_threads, list) else [])
                        if isinstance(t, dict))
        pid = _small_int(process.get("pid"))
        member = member_id(pid, None) if pid is not None else f"{Path(source).stem or 'process'}#{number}"
        dumps.append(StackDump(member, threads, pid, source=source))
    return dumps


def parse_capture(data: dict[str, Any], source: str = "") -> list[StackDump]:
    """A file written by `stall-watchdog stacks dump --out`: py-spy's JSON with the rank it belongs to."""
    gpus = data.get("gpus")
    job = data.get("training_job")
    dumps = parse_pyspy_json(data.get("threads"), source, _small_int(data.get("rank")),
                             tuple(g for g in gpus[:64] if _small_int(g) is not None) if isinstance(gpus, list) else ())
    return [replace(d, job=job[:200]) for d in dumps] if isinstance(job, str) and job else dumps


def _parse_json(data: object, source: str) -> list[StackDump] | None:
    """A JSON dump by its shape; None when it is none of the known ones."""
    if isinstance(data, list):
        return parse_pyspy_json(data, source)
    if isinstance(data, dict) and "processes" in data:
        return parse_fact_json(data, source)
    if isinstance(data, dict) and "threads" in data:
        return parse_capture(data, source)
    return None


def from_json(data: object, source: str) -> list[StackDump]:
    """A dump already parsed from JSON, by its shape; StackFormatError naming `source` when it is none."""
    if isinstance(data, dict) and "outliers" in data:
        raise StackFormatError(f"{source}: an analysis written by stall-watchdog, not a dump; analyze the "
                               "rank-*.json / pid-*.json files beside it (or the folder)")
    try:
        parsed = _parse_json(data, source)
    except (TypeError, AttributeError, KeyError, ValueError, OverflowError, RecursionError) as exc:
        raise StackFormatError(f"{source}: JSON of the wrong shape for a py-spy dump ({type(exc).__name__}: "
                               f"{str(exc)[:80]})") from None
    if parsed is None:
        raise StackFormatError(f"{source}: JSON, but not a py-spy dump (expected a list of threads)")
    return parsed


def load(path: str | Path) -> list[StackDump]:
    """Any of the forms above, told apart by content. A folder written by `stacks dump --out` is read
    as all the rank dumps in it."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.glob("*.json") if p.name != "analysis.json")
        if not files:
            raise StackFormatError(f"{path}: no dumps in this folder")
        return [dump for file in files for dump in load(file)]
    try:
        text = rank_files.read_given(path, MAX_DUMP_BYTES).decode("utf-8", errors="replace")
    except rank_files.RankFileError as exc:
        raise StackFormatError(str(exc)) from None
    stripped = text.lstrip()
    if stripped.startswith(("[", "{")):
        try:
            data = untrusted_data.loads_json(text, str(path))
        except untrusted_data.TooMuchData as exc:
            raise StackFormatError(str(exc)) from None
        except json.JSONDecodeError as exc:
            raise StackFormatError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        except ValueError as exc:  # an integer past Python's digit limit
            raise StackFormatError(f"{path}: not a dump ({str(exc)[:80]})") from None
        except RecursionError:
            raise StackFormatError(f"{path}: JSON nested too deeply to be a dump") from None
        dumps = from_json(data, str(path))
    else:
        dumps = parse_text(text, str(path))
    if not dumps:
        raise StackFormatError(f"{path}: no stack found (expected py-spy output: 'Thread N (idle): ...')")
    return dumps
