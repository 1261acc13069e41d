"""A trace read in a second process while this one detects: `replay` of one long trace uses two cores.

The reading process opens the trace as open_trace does and sends what it reads through a pipe, in order:
the trace's naive-time flag, then its snapshots and column blocks, then what it skipped. A reader
error (a malformed line, a file that cannot be opened) arrives in its place in the stream and is
raised here as the same TraceError, after everything read before it. A reading process that dies
without a word is an error naming its exit code; leaving the context stops it.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import traceback
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from multiprocessing.connection import Connection
from typing import Any

from watchdog.plumbing.signals import die_with_parent
from watchdog.sample.errors import SkipLog, TraceError
from watchdog.sample.replay import Trace, open_trace
from watchdog.vocabulary.model import NUMERIC_FIELDS, GpuSample, NodeSnapshot, SnapshotBlock

_BATCH = 256  # single snapshots sent at once (blocks go one by one)
_AHEAD_BYTES = 32 << 20  # messages taken in ahead of the detectors, at most: about half a day of an 8-GPU node
# at 1 Hz, and a bound on memory however many GPUs a block holds
_PIPE_BYTES = 1 << 20  # the pipe's buffer where the system allows it (Linux's usual largest): ten to fourteen
# blocks of an 8-GPU node's trace, so that the reader need not wait for this process to take each one


class ReaderFailed(RuntimeError):
    """The reading process failed other than on the trace's content (a bug, or it was killed)."""


_NUMERIC_SLOTS = {GpuSample._fields.index(name) for name in NUMERIC_FIELDS}


def available() -> bool:
    """Whether traces can be read ahead here: a second core and fork() to start the reader cheaply."""
    return (multiprocessing.cpu_count() or 1) > 1 and "fork" in multiprocessing.get_all_start_methods()


@contextmanager
def open_trace_ahead(spec: str, lenient: bool = False, csv_fields: list[str] | None = None) -> Iterator[Trace]:
    """open_trace(spec, ...), read by a second process."""
    context = multiprocessing.get_context("fork")
    receiving, sending = context.Pipe(duplex=False)
    _widen(receiving)
    reader = context.Process(target=_read, args=(sending, spec, lenient, csv_fields, os.getpid()), daemon=True,
                             name="stall-watchdog trace reader")
    reader.start()
    sending.close()
    try:
        inbox = _Inbox(receiving, reader)
        kind, value = inbox.take()
        if kind == "error":
            raise TraceError(value)
        skips = SkipLog(lenient=lenient)
        yield Trace(_stretches(inbox, skips), naive_time=value, skips=skips)
    finally:
        if reader.is_alive():
            reader.terminate()
        reader.join()
        receiving.close()


def _widen(receiving: Connection) -> None:
    """A larger pipe buffer, where Linux allows it; the usual 64 KiB otherwise."""
    import fcntl  # Unix only, as fork() is

    size = getattr(fcntl, "F_SETPIPE_SZ", None)
    if size is not None:
        with suppress(OSError):
            fcntl.fcntl(receiving.fileno(), size, _PIPE_BYTES)


class _Inbox:
    """The reader's messages, taken from the pipe by this thread. Each time one is wanted, whatever else
    has arrived is taken in too (up to _AHEAD_BYTES), so the reader runs on while the detectors work. There is
    no second thread: one would wait for the interpreter at every read, and the reader on it."""

    def __init__(self, receiving: Connection, reader: Any):
        self._receiving, self._reader = receiving, reader
        self._waiting: deque[bytes] = deque()
        self._held = 0  # bytes waiting
        self._ended = False  # the pipe has closed: what is waiting is all there will be

    def take(self) -> tuple[str, Any]:
        receiving, waiting = self._receiving, self._waiting
        if not self._ended:
            try:
                while self._held < _AHEAD_BYTES and receiving.poll():
                    self._hold(receiving.recv_bytes())
                if not waiting:
                    self._hold(receiving.recv_bytes())
            except (EOFError, OSError):
                self._ended = True
        if not waiting:
            self._reader.join(timeout=5)
            raise ReaderFailed(f"the trace reader exited without finishing (exit code {self._reader.exitcode})")
        message = waiting.popleft()
        self._held -= len(message)
        kind, value = pickle.loads(message)
        if kind == "crash":
            raise ReaderFailed(f"the trace reader failed:\n{value}")
        return kind, value

    def _hold(self, message: bytes) -> None:
        self._waiting.append(message)
        self._held += len(message)


def _stretches(inbox: _Inbox, skips: SkipLog) -> Iterator[NodeSnapshot | SnapshotBlock]:
    while True:
        kind, value = inbox.take()
        if kind == "items":
            yield from value
            continue
        skips.count, skips.first, error = value
        if error is not None:
            raise TraceError(error)
        return


def _as_arrays(block: SnapshotBlock) -> SnapshotBlock:
    """The block with its numeric columns as float64 arrays (a missing reading NaN): converted here, in the
    reading process, they cross the pipe as arrays and reach the detectors as they take them."""
    import numpy as np

    columns: tuple[Any, ...] = tuple(
        np.array(values, dtype=float) if values is not None and slot in _NUMERIC_SLOTS else values
        for slot, values in enumerate(block.columns))
    return SnapshotBlock(block.times, block.layout, columns, block.present)


def _read(sending: Connection, spec: str, lenient: bool, csv_fields: list[str] | None, parent: int) -> None:
    """The reading process: everything it reads, in order, then what it skipped. It dies with the replay's
    process (a replay killed by SIGTERM left it reading an endless input, a FIFO or /dev/urandom, for ever)."""
    die_with_parent(parent)
    try:
        try:
            with open_trace(spec, lenient=lenient, csv_fields=csv_fields) as trace:
                sending.send(("open", trace.naive_time))
                batch: list[NodeSnapshot | SnapshotBlock] = []
                error = None
                try:
                    for item in trace.stretches:
                        batch.append(_as_arrays(item) if isinstance(item, SnapshotBlock) else item)
                        if isinstance(item, SnapshotBlock) or len(batch) >= _BATCH:
                            sending.send(("items", batch))
                            batch = []
                except TraceError as exc:  # a malformed line: after everything read before it
                    error = str(exc)
                sending.send(("items", batch))
                sending.send(("end", (trace.skips.count, trace.skips.first, error)))
        except TraceError as exc:  # the trace could not be opened
            sending.send(("error", str(exc)))
    except BrokenPipeError:
        pass  # the replay stopped reading
    except BaseException:
        with suppress(OSError):
            sending.send(("crash", traceback.format_exc()))
    finally:
        sending.close()
