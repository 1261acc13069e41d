"""py-spy's text, as people paste it into issues: `Process N:` / `Thread T (idle): "MainThread"` headers and
`    function (file:line)` frames, including the grouped form where several `Thread` headers share one frame list
("4 in: ..."), code fences and prose around it, per-node digests of top frames, and bare frame lists.

Frames are innermost first. A line that is none of these is prose and is ignored.
"""

from __future__ import annotations

import re

from watchdog.vocabulary.stack_model import Frame, StackDump, ThreadStack, member_id

# What one dump keeps, however it was read
MAX_THREADS = 256
MAX_FRAMES = 128  # per thread: the innermost 96 and the outermost 32 (where the hang is, and whose code)
MAX_NAME = 256
MAX_FRAMES_TOTAL = 4096  # per process: past it, each further thread keeps its innermost 8 frames

# Each pattern matches at the start of a line, its repetitions bounded or unambiguous: no line makes one backtrack
# (a frame, whose parts are found from its ends, is read without a pattern).
_PROCESS = re.compile(r"^Process (\d{1,10}):(.*)$")  # bounded digits: a longer number is prose, not a pid
_THREAD = re.compile(r"\s{0,64}Thread (0x[0-9A-Fa-f]{1,16}|\d{1,19}) \(([\w+]{1,20})\)")
_BARE_FRAME = re.compile(r"^\s+([A-Za-z_<][\w.<>]*)\s*$")
_DIGEST_HOST = re.compile(r"^([A-Za-z][\w.-]*)\s*$")
_LOCALS = re.compile(r"^\s+(Arguments|Locals):\s*$")
_GROUP = re.compile(r"^\s*(\d{1,9}) (?:processes |ranks |procs )?(?:are )?in:?\s*$")
_PYSPY_MARK = re.compile(r"^\s{0,8}(?:Thread (?:0x[0-9A-Fa-f]{1,16}|\d{1,19}) \([\w+]{1,20}\)|Process \d{1,10}: )",
                         re.MULTILINE)


def looks_like_pyspy(text: str) -> bool:
    """Whether a text holds py-spy's dump: a `Thread N (idle)` or `Process N:` header."""
    return _PYSPY_MARK.search(text) is not None


def program(command: str) -> str:
    """What a command line runs, the same for every rank of a job: the script (`train.py`) or module
    (`-m vllm.entrypoints.api_server`), else the program; '' for none. Arguments (a rank's own
    --local-rank among them) are left out."""
    words = "".join(c if c.isprintable() else " " for c in command[:4096]).split()  # a terminal prints it
    for i, word in enumerate(words):
        if word == "-m" and i + 1 < len(words):
            return "-m " + words[i + 1][:200]
        if word.endswith(".py"):
            return word.rsplit("/", 1)[-1][:200]
    return words[0].rsplit("/", 1)[-1][:200] if words else ""


def _header(line: str) -> tuple[int, int | None, str, str | None, bool] | None:
    """A `Thread N (state): "name"` line: (id, the OS thread id where py-spy printed one (in decimal; a pthread id
    is hex), state, name, whether the name's quote closes on this line). The name is the process's to choose and
    py-spy prints it as it is: one holding a new line goes on over the next lines, which are name, not dump."""
    match = _THREAD.match(line)
    if match is None:
        return None
    rest = line[match.end():].rstrip()
    if rest and not rest.startswith(': "'):
        return None
    pthread = match.group(1).lower().startswith("0x")
    tid, state = int(match.group(1), 16 if pthread else 10), match.group(2).split("+")[0]  # "active+gil": GIL holder
    os_tid = None if pthread else tid
    name = rest[3:] if rest else None
    closed = name is None or (len(name) > 0 and name.endswith('"'))
    if not closed and '"' in (name or ""):
        return None  # words after the closing quote: a person's note on a header, not py-spy's line
    return tid, os_tid, state, name[:-1] if name and closed else name, closed


def _frame(line: str) -> Frame | None:
    """`    function (file:line)`: indented, the function up to the first ` (`, the file (and `:line`) up to the
    last `)`. Read from its two ends, never by a pattern that could backtrack."""
    body = line.strip()
    cut = body.find(" (")
    if not line[:1].isspace() or cut < 1 or not body.endswith(")"):
        return None
    where = body[cut + 2:-1]
    file, colon, number = where.rpartition(":")
    numbered = bool(colon) and number.isascii() and number.isdigit() and len(number) <= 9
    return Frame(body[:cut].rstrip()[:MAX_NAME], (file if numbered else where)[:MAX_NAME],
                 int(number) if numbered else None)


MAX_CLAIMED = 64  # processes one count line ("6 processes are in:", a person's digest of a node) may stand for


def parse_text(text: str, source: str = "") -> list[StackDump]:
    """py-spy text output, grouped or not, or a digest of top frames per host."""
    dumps: list[StackDump] = []
    process_pid: int | None = None
    process_threads: list[ThreadStack] = []
    headers: list[tuple[int, int | None, str, str | None]] = []  # Thread lines waiting for their frames
    frames: list[Frame] = []
    digest_host: str | None = None
    digest_count = 0
    in_locals = False
    group_size = 0  # "6 processes are in:" before a group of headers
    process_program = ""  # what the "Process N: COMMAND" line says it runs
    naming: str | None = None  # a thread's name that goes on past its header's line
    digest: set[int] = set()  # dumps read in the digest form (id), and the lines that were (a weak form: _dense)
    digest_lines = lines = 0

    def flush_threads() -> None:
        nonlocal headers, frames, group_size
        # One header under "6 processes are in:" stands for all six. A count line is a person's summary: inside a
        # process py-spy printed (it never prints one) it stands for nothing, elsewhere for at most MAX_CLAIMED.
        claimed = min(group_size, MAX_CLAIMED) if process_pid is None else 0
        extra = max(0, claimed - len(headers)) if headers else 0
        group_size = 0
        for position, (tid, os_tid, state, name) in enumerate(headers):
            weight = 1 + (extra if position == 0 else 0)
            thread = ThreadStack(tid, name, state if state in ("active", "idle") else None, tuple(frames), os_tid)
            if process_pid is not None:
                process_threads.append(thread)
            elif name == "MainThread" or not dumps:
                # No "Process N:" line: a main thread's id is its process id on Linux.
                pid = tid if name == "MainThread" else None
                dumps.append(StackDump(member_id(pid, None) if pid else f"thread {tid}", (thread,), pid=pid,
                                       source=source, count=weight))
            else:
                last = dumps[-1]
                dumps[-1] = StackDump(last.member, last.threads + (thread,), last.pid, source=source)
        headers, frames = [], []

    def flush_process() -> None:
        nonlocal process_pid, process_threads
        flush_threads()
        if process_pid is not None and process_threads:
            dumps.append(StackDump(member_id(process_pid, None), tuple(process_threads), process_pid,
                                   source=source, job=process_program))
        process_pid, process_threads = None, []

    for raw in text.splitlines():
        line = raw.rstrip()
        lines += bool(line)
        if naming is not None:  # the name's lines until the one its closing quote ends
            naming = (naming + "\n" + line)[:MAX_NAME + 1]
            if line.endswith('"'):
                tid, os_tid, state, _ = headers[-1]
                headers[-1] = (tid, os_tid, state, naming.removesuffix('"')[:MAX_NAME])
                naming = None
            continue
        if (match := _GROUP.match(line)) is not None:
            if frames:
                flush_threads()
            group_size = int(match.group(1))
            continue
        if (match := _PROCESS.match(line)) is not None:
            flush_process()
            process_pid, process_program = int(match.group(1)), program(match.group(2))
            digest_host = None
            continue
        if (header := _header(line)) is not None:
            if frames:
                flush_threads()
            tid, os_tid, state, name, closed = header
            headers.append((tid, os_tid, state, name[:MAX_NAME] if name is not None else None))
            naming = None if closed else name
            in_locals = False
            continue
        if headers:
            if _LOCALS.match(line):
                in_locals = True
                continue
            if (frame := _frame(line)) is not None and not (in_locals and raw.startswith(" " * 8)):
                in_locals = False
                frames.append(frame)
                continue
            if in_locals and raw.startswith(" " * 8):
                continue  # a local variable under --locals
            if frames and line.endswith('"'):
                # The tail of a name that holds new lines and a quote: py-spy closes every name with one, so the
                # frame-shaped lines read since the header were the name's (a thread that names itself
                # `x"` + `\n    all_reduce (...)` is not in all_reduce); its own frames follow.
                frames = []
                continue
            if frames:
                flush_threads()
            continue
        # Digest form: a host name alone on a line, then one top frame per rank, indented.
        if (match := _DIGEST_HOST.match(line)) is not None and not line.startswith(" "):
            digest_host, digest_count = match.group(1), 0
            continue
        if digest_host is not None and (match := _BARE_FRAME.match(line)) is not None:
            thread = ThreadStack(None, None, None, (Frame(match.group(1)),))
            dumps.append(StackDump(f"{digest_host}#{digest_count}", (thread,), source=source))
            digest.add(id(dumps[-1]))
            digest_lines += 1 + (digest_count == 0)
            digest_count += 1
            continue
    flush_process()
    if digest and not _dense(digest_lines, lines):
        dumps = [d for d in dumps if id(d) not in digest]
    return dumps or _rank_digest(text, source) or _frame_lists(text, source)


def _dense(read: int, lines: int) -> bool:
    """Whether stacks read in a weak form (a digest's bare names, frames with no py-spy header) are what the text
    is about: a tenth of its lines at least. A few lines that random bytes or prose happen to shape are not."""
    return read * 10 >= lines


_SOURCE_FILE = re.compile(r"\.py\b|^<|\.so\b|/")
# A person's digest of many ranks' stacks, keyed by the ranks: `DP0,3,5,7:  broadcast  (distributed_c10d.py:2841)`,
# `Rank 1 (waiting): recv (socket.py:9)`, `ranks 3..7: ...`, then the outer frames indented below
_RANK_KEY = re.compile(r"^\s{0,4}(?P<kind>DP|TP|PP|EP|CP|[Rr]anks?\s?)?(?P<ranks>\d{1,6}(?:\s{0,2}(?:,|\.\.|-)\s{0,2}"
                       r"\d{1,6}){0,255})\s{0,2}(?:\([^()\n]{0,40}\))?:\s+(?P<frame>\S.{0,400})$")
_COMMENT = re.compile(r"\s+(?:<-|#|//).{0,200}$")  # a reporter's note after a frame
_PID_HEADER = re.compile(r"\bpid[= ](\d{1,10})\b")


def _frame_lists(text: str, source: str) -> list[StackDump]:
    """Stacks pasted without py-spy's headers: blocks of two or more `function (file.py:line)` lines (a fenced
    fragment, a `pid=N (MainThread ...):` line before it), or one sample per line with frames joined by `|`.
    Each block is one process, innermost frame first, as py-spy prints them."""
    blocks: list[tuple[int | None, list[Frame]]] = []
    frames: list[Frame] = []
    pid: int | None = None
    lines = 0

    def frame(piece: str) -> Frame | None:
        found = _frame(piece if piece.startswith((" ", "\t")) else " " + piece)
        return found if found is not None and _SOURCE_FILE.search(found.file) else None

    def close() -> None:
        nonlocal frames
        if len(frames) >= 2:
            blocks.append((pid, frames))
        frames = []

    for raw in text.splitlines()[:200_000]:
        line = raw.rstrip()[:4096]
        lines += bool(line)
        if "|" in line and line.count("(") >= 2:
            sample = [f for f in (frame(p.strip()) for p in line.split("|")) if f is not None]
            if len(sample) >= 2:
                close()
                blocks.append((pid, sample))
                continue
        found = frame(line)
        if found is not None:
            frames.append(found)
            continue
        close()
        header = _PID_HEADER.search(line)
        pid = int(header.group(1)) if header else None
    close()
    if not _dense(sum(len(block) for _, block in blocks), lines):
        return []
    return [StackDump(member_id(pid, None) if pid is not None else f"stack {n + 1}",
                      (ThreadStack(None, "MainThread", None, tuple(block[:MAX_FRAMES])),), pid, source=source)
            for n, (pid, block) in enumerate(blocks[:MAX_THREADS])]


def _rank_numbers(text: str) -> list[int]:
    """`0,3,5,7` -> [0, 3, 5, 7]; `3..7` or `3-7` -> [3, 4, 5, 6, 7] (at most MAX_THREADS in all)."""
    found: list[int] = []
    for part in re.split(r"\s{0,2},\s{0,2}", text):
        low, _, high = re.sub(r"\s{0,2}(?:\.\.|-)\s{0,2}", "-", part.strip(), count=1).partition("-")
        if high.isdigit() and low.isdigit() and int(low) <= int(high):
            found.extend(range(int(low), min(int(high), int(low) + MAX_THREADS) + 1))
        elif low.isdigit():
            found.append(int(low))
    return list(dict.fromkeys(found))[:MAX_THREADS]


def _rank_digest(text: str, source: str) -> list[StackDump]:
    """A digest keyed by ranks (module constant _RANK_KEY): one dump per rank named, each with the frames its line
    and the indented lines under it give, innermost first, and the rank kept as the reporter named it."""
    groups: list[tuple[list[int], str, list[Frame]]] = []
    lines = 0
    for raw in text.splitlines()[:200_000]:
        line = _COMMENT.sub("", raw.rstrip()[:4096])
        lines += bool(line.strip())
        key = _RANK_KEY.match(line)
        first = _frame(" " + key["frame"].strip()) if key else None
        if key and first is not None and _SOURCE_FILE.search(first.file):
            groups.append((_rank_numbers(key["ranks"]), (key["kind"] or "").strip(), [first]))
            continue
        found = _frame(line) if groups else None
        if found is not None and _SOURCE_FILE.search(found.file):
            groups[-1][2].append(found)
    if len(groups) < 2 or not _dense(sum(len(f) for _, _, f in groups), lines):
        return []
    dumps = []
    for ranks, _, frames in groups:
        thread = ThreadStack(None, "MainThread", None, tuple(frames[:MAX_FRAMES]))
        dumps += [StackDump(member_id(None, rank), (thread,), rank=rank, source=source) for rank in ranks]
    return dumps[:MAX_THREADS]
