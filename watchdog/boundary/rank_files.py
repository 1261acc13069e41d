"""Files a training rank names (its Flight Recorder pipe and dumps), opened by a daemon that runs as root.

A rank's environment is untrusted input: it may name a FIFO where a dump should be, a path with `..`, a
symlink to a host file, or swap one for the other between two calls. So a path a rank names is:
- resolved inside that rank's own filesystem only: from `/proc/<pid>/root` (an absolute path) or
  `/proc/<pid>/cwd` (a relative one), one component at a time with `O_NOFOLLOW`; `..` and every symlink
  are refused, and there is no fallback to the daemon's own filesystem;
- opened `O_PATH` first (which opens nothing: no device's open runs, no terminal becomes the daemon's), its
  type checked with `fstat` on that descriptor (never `stat` by path and then `open`), and only then that very
  inode reopened to read or write, non-blocking: a dump must be a regular file, a pipe must be a FIFO;
- owned by the rank's own user (the owner of /proc/<pid>): root never reads or writes for a rank a file
  that rank could not reach itself (another user's dump on a shared node, a root-owned file);
- read with a byte cap and a deadline.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20


class RankFileError(Exception):
    """A file a rank names that was not read or written; the message says which and why."""

    def __init__(self, message: str, missing: bool = False):
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class RankFile:
    data: bytes
    mtime: float  # the opened file's modification time (wall clock)


def _parts(path: str) -> list[str]:
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise RankFileError(f"{path}: '..' is refused in a path a rank names")
    if not parts:
        raise RankFileError(f"{path!r}: not a file name")
    if any("\x00" in p for p in parts):
        raise RankFileError(f"{path!r}: holds a NUL byte")
    return parts


def _open(pid: int, path: str, flags: int, proc_root: str | Path) -> int:
    parts = _parts(path)
    base = os.path.join(str(proc_root), str(pid), "root" if path.startswith("/") else "cwd")
    try:
        # The one link followed: /proc/<pid>/root (cwd) is the kernel's handle on the rank's own root.
        directory = os.open(base, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise RankFileError(f"process {pid}: its filesystem cannot be reached ({exc.strerror or exc})",
                            missing=exc.errno in (errno.ENOENT, errno.ESRCH)) from None
    try:
        for part in parts[:-1]:
            try:
                inner = os.open(part, _DIR, dir_fd=directory)
            except OSError as exc:
                raise _error(path, exc) from None
            os.close(directory)
            directory = inner
        try:
            return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory)
        except OSError as exc:
            raise _error(path, exc) from None
    finally:
        os.close(directory)


def _error(path: str, exc: OSError) -> RankFileError:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return RankFileError(f"{path}: a symbolic link (or not a folder) on the way; links are not followed "
                             "in a path a rank names")
    return RankFileError(f"{path}: {exc.strerror or exc}", missing=exc.errno == errno.ENOENT)


def _owner(pid: int, proc_root: str | Path) -> int:
    try:
        return os.stat(os.path.join(str(proc_root), str(pid))).st_uid
    except OSError as exc:
        raise RankFileError(f"process {pid}: gone ({exc.strerror or exc})", missing=True) from None


def _check_owner(path: str, info: os.stat_result, owner: int) -> None:
    if info.st_uid != owner:
        raise RankFileError(f"{path}: owned by uid {info.st_uid}, not by the rank's user (uid {owner}); not used")


def _open_checked(pid: int, path: str, proc_root: str | Path, wanted: Callable[[int], bool],
                  what: str, verb: str, flags: int) -> tuple[int, os.stat_result]:
    """What the rank names, opened `O_PATH` inside its root, that inode checked (its type `wanted`, else "not
    WHAT ...; not VERB", and the rank's own user its owner), and only then that very inode reopened for `flags`,
    non-blocking and never as a terminal. ENXIO there (a pipe nobody reads) is NoReader. The caller closes the
    descriptor."""
    owner = _owner(pid, proc_root)
    held = _open(pid, path, os.O_PATH, proc_root)
    try:
        info = os.fstat(held)
        if not wanted(info.st_mode):
            raise RankFileError(f"{path}: not {what} ({_kind(info.st_mode)}); not {verb}")
        _check_owner(path, info, owner)
        return os.open(f"/proc/self/fd/{held}", flags | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC), info
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise NoReader(f"{path} exists but no process reads it (the rank may be gone)") from None
        raise RankFileError(f"{path}: {exc.strerror or exc}") from None
    finally:
        os.close(held)


def read(pid: int, path: str, max_bytes: int, timeout_seconds: float = 5.0,
         proc_root: str | Path = "/proc") -> RankFile:
    """The whole of a regular file the rank names, at most `max_bytes`, read within `timeout_seconds`."""
    fd, info = _open_checked(pid, path, proc_root, stat.S_ISREG, "a regular file", "read", os.O_RDONLY)
    try:
        if info.st_size > max_bytes:
            raise RankFileError(f"{path}: {info.st_size} bytes, over the {max_bytes}-byte cap; not read")
        return RankFile(_read_capped(fd, path, max_bytes, timeout_seconds), info.st_mtime)
    except OSError as exc:
        raise RankFileError(f"{path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def write_fifo(pid: int, path: str, data: bytes, proc_root: str | Path = "/proc") -> None:
    """Write `data` into a named pipe the rank names, without blocking: the pipe is opened `O_PATH`, its type
    checked on that descriptor, and that very inode reopened for writing. A regular file, a device or a
    link there is refused and never opened for writing. ENXIO (no reader) raises RankFileError with
    `missing` False and the errno in the message."""
    pipe, _ = _open_checked(pid, path, proc_root, stat.S_ISFIFO, "a named pipe", "written", os.O_WRONLY)
    try:
        os.write(pipe, data)
    except OSError as exc:
        raise RankFileError(f"{path}: {exc.strerror or exc}") from None
    finally:
        os.close(pipe)


@dataclass(frozen=True)
class Tail:
    """What a growing log gained since `offset`: whole lines only. `file` is the log's (name, device, inode):
    another file (rotated, recreated) starts again at its beginning; `skipped` bytes were passed over unread
    because more was new than the cap allows."""

    data: bytes
    offset: int  # where the next read starts
    file: tuple[str, int, int]
    skipped: int


def read_tail(pid: int, folder: str, name: str, since: Tail | None, max_bytes: int, timeout_seconds: float = 2.0,
              exact: bool = True, max_entries: int = 4096, proc_root: str | Path = "/proc") -> Tail:
    """The new whole lines of a log in a folder the rank names: the one called `name`, or (not `exact`) the one
    whose name ends with `name`, at most `max_entries` names looked at. The log is opened like any file a rank
    names (_open_checked: inside its root, no link, the rank's user's regular file, checked before it is
    opened to read). With no `since`, nothing is read: the tail starts at the log's end. At most `max_bytes`
    are read, the newest; a line not yet ended waits for the next read."""
    if not exact:
        directory = _open(pid, folder, os.O_RDONLY | os.O_DIRECTORY, proc_root)
        try:
            name = _one_named(directory, folder, name, max_entries)
        finally:
            os.close(directory)
    path = f"{folder}/{name}"
    fd, info = _open_checked(pid, path, proc_root, stat.S_ISREG, "a regular file", "read", os.O_RDONLY)
    try:
        file = (name, info.st_dev, info.st_ino)
        if since is None:
            return Tail(b"", info.st_size, file, 0)
        size = os.fstat(fd).st_size
        start = since.offset if since.file == file and since.offset <= size else 0
        skipped = max(0, size - start - max_bytes)
        data = _read_upto(fd, path, min(max_bytes, size - start), timeout_seconds, start + skipped)
        if skipped:  # begun mid-line: the first line is partial
            cut = data.find(b"\n") + 1 or len(data)
            skipped, data = skipped + cut, data[cut:]
        end = data.rfind(b"\n") + 1
        return Tail(data[:end], start + skipped + end, file, skipped)
    except OSError as exc:
        raise RankFileError(f"{path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _one_named(directory: int, folder: str, suffix: str, max_entries: int) -> str:
    names, looked = [], 0
    with os.scandir(directory) as entries:
        for entry in entries:
            looked += 1
            if looked > max_entries:
                break
            if entry.name.endswith(suffix):
                names.append(entry.name)
    if len(names) == 1:
        return names[0]
    more = f" in the first {max_entries} names (the folder holds more)" if looked > max_entries else ""
    raise RankFileError(f"{folder}: {'no' if not names else len(names)} logs named *{suffix}{more}",
                        missing=not names and not more)


class NoReader(RankFileError):
    """A pipe with nobody reading it."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a file")):
        if test(mode):
            return name
    return "not a file"


def read_given(path: str | Path, max_bytes: int, timeout_seconds: float = 30.0, follow: bool = True) -> bytes:
    """A file a person or the configuration names (`analyze`, a secret file): a regular file of at most
    `max_bytes`, opened non-blocking so that a FIFO or a device (`/dev/zero`) is an error, never a wait or
    an endless read. Links are followed unless `follow` is false (a file inside a folder given: a bundle's)."""
    fd = open_given(path, follow)
    try:
        return _read_capped(fd, str(path), max_bytes, timeout_seconds)
    except OSError as exc:
        raise RankFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def open_given(path: str | Path, follow: bool = True) -> int:
    """The descriptor of a regular file a person names, open to read: non-blocking, so that a FIFO or a device is
    RankFileError (missing=True where nothing is there), never a wait; a link is refused unless `follow`."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise RankFileError(f"{path}: a symbolic link; not followed") from None
        try:  # a socket cannot be opened at all (ENXIO): say what it is, as for a FIFO or a device
            mode = os.stat(path, follow_symlinks=follow).st_mode
        except OSError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode) and exc.errno != errno.ENOENT:
            raise RankFileError(f"{path}: not a regular file ({_kind(mode)})") from None
        raise RankFileError(f"{path}: cannot read: {exc.strerror or exc}",
                            missing=exc.errno == errno.ENOENT) from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        raise RankFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise RankFileError(f"{path}: not a regular file ({_kind(mode)})")
    return fd


def _read_capped(fd: int, path: str, max_bytes: int, timeout_seconds: float) -> bytes:
    """The rest of an open regular file: at most `max_bytes` (one byte more is an error), within
    `timeout_seconds` (checked between chunks)."""
    data = _read_upto(fd, path, max_bytes + 1, timeout_seconds)
    if len(data) > max_bytes:
        raise RankFileError(f"{path}: over the {max_bytes}-byte cap; not read")
    return data


def _read_upto(fd: int, path: str, limit: int, timeout_seconds: float, offset: int | None = None) -> bytes:
    """At most `limit` bytes of an open file, to its end: from where it stands, or from `offset` (pread),
    within `timeout_seconds` (checked between chunks)."""
    deadline = time.monotonic() + timeout_seconds
    chunks: list[bytes] = []
    got = 0
    while got < limit:
        if time.monotonic() > deadline:
            raise RankFileError(f"{path}: not read within {timeout_seconds:g} s")
        want = min(_CHUNK, limit - got)
        chunk = os.read(fd, want) if offset is None else os.pread(fd, want, offset + got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
