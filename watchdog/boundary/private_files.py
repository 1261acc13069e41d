"""The one writer of the files the daemon and its verbs leave behind (bundles, reports, dumps, job bundles).

It may run as root in folders other users can write, with contents a training rank chose, so every file is:
- created, never opened through a link: `O_CREAT | O_EXCL | O_NOFOLLOW`; a file that is replaced is written
  under a fresh hidden name and renamed over the old one (a planted symlink is replaced, never followed);
- private: mode 0600 (folders 0700);
- within a budget: a `Budget` is the bytes one bundle may take; a write that would pass it is refused
  before a byte reaches the disk (`OverBudget`), so no input grows the disk past what the operator set. A file
  written a piece at a time (`text_file`) takes each piece from the budget before it is written.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_serial = itertools.count()


class OverBudget(OSError):
    """A write refused because it would pass its budget (its message says how far)."""


class Budget:
    """Bytes that one set of files (a bundle) may still take; shared by the threads that fill it."""

    def __init__(self, limit: int, setting: str = ""):
        self.limit, self.setting = limit, setting  # setting: what sets the limit, named in a refusal
        self.spent = 0
        self._lock = threading.Lock()

    def take(self, size: int, path: Path) -> None:
        with self._lock:
            if self.spent + size > self.limit:
                raise OverBudget(f"{path.name}: {size} bytes would pass the budget of {self.limit} bytes "
                                 f"({self.setting + ', ' if self.setting else ''}{self.spent} spent)")
            self.spent += size

    def give_back(self, size: int) -> None:
        """Bytes taken for a file that was removed again."""
        with self._lock:
            self.spent -= size


def write_bytes(path: str | Path, data: bytes, budget: Budget | None = None, replace: bool = False) -> Path:
    """Write `data` to a new file at `path` (an existing file, or a link, there is an error), or with
    `replace` atomically in place of whatever is there."""
    path = Path(path)
    if budget is not None:
        budget.take(len(data), path)
    target = path.with_name(f".{path.name}.{os.getpid()}.{next(_serial)}.new") if replace else path
    fd = os.open(target, _FLAGS, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if replace:
            os.replace(target, path)
    except BaseException:
        if replace:
            target.unlink(missing_ok=True)
        raise
    return path


class TextFile:
    """A new private file written a piece of text at a time (`text_file`): what is written is never held whole in
    memory, and each piece is taken from the budget before it reaches the disk."""

    def __init__(self, raw: BinaryIO, path: Path, budget: Budget | None):
        self._raw, self._path, self._budget = raw, path, budget
        self.taken = 0  # bytes taken from the budget

    def write(self, text: str) -> int:
        data = text.encode("utf-8")
        if self._budget is not None:
            self._budget.take(len(data), self._path)
            self.taken += len(data)
        self._raw.write(data)
        return len(text)


@contextmanager
def text_file(path: str | Path, budget: Budget | None = None) -> Iterator[TextFile]:
    """A new file at `path` (an existing file, or a link, there is an error), written a piece at a time; it is
    removed again, and what it took given back to the budget, when the writing fails (a budget passed, a disk
    full)."""
    path = Path(path)
    fd = os.open(path, _FLAGS, 0o600)
    file = None
    try:
        with os.fdopen(fd, "wb") as raw:
            file = TextFile(raw, path, budget)
            yield file
    except BaseException:
        path.unlink(missing_ok=True)
        if budget is not None and file is not None:
            budget.give_back(file.taken)
        raise


def write_text(path: str | Path, text: str, budget: Budget | None = None, replace: bool = False) -> Path:
    return write_bytes(path, text.encode("utf-8"), budget, replace)


def write_json(path: str | Path, data: object, budget: Budget | None = None, replace: bool = False) -> Path:
    return write_text(path, json.dumps(data, indent=1, default=str) + "\n", budget, replace)


def make_dir(path: str | Path, parents: bool = False) -> Path:
    """A private folder (0700); an existing one must be a real folder, not a link to one."""
    path = Path(path)
    if parents:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        if path.is_symlink() or not path.is_dir():
            raise NotADirectoryError(f"{path}: not a folder (or a link to one)") from None
    return path


def unique_name(prefix: str) -> str:
    """A name no other writer in this process or another gets: for hidden temporary folders."""
    return f"{prefix}-{os.getpid()}-{next(_serial)}"


def made_here(name: str) -> bool:
    """Whether `name` came from unique_name in this process (a temporary folder still being filled), not
    from another one (a daemon killed mid-write, whose leftovers may be cleaned)."""
    return re.search(rf"-{os.getpid()}-\d+$", name) is not None


def rename_free(temporary: Path, root: Path, name: str) -> Path:
    """Rename a filled folder to `name`, or `name-2`, `name-3`... when another writer took it first (two
    dumps in one second). A bundle is never empty (its marker), so a rename never replaces one."""
    for attempt in range(1, 1000):
        final = root / (name if attempt == 1 else f"{name}-{attempt}")
        if final.exists():
            continue
        try:
            os.rename(temporary, final)
            return final
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    raise FileExistsError(f"{name}: a thousand bundles of that name")
