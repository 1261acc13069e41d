"""A trace read in a second process while this one detects: `replay` of one long trace uses two cores.

The reading process opens the trace as open_trace does and sends what it reads through a pipe, in order:
the trace's naive-time flag, then its snapshots and column blocks, then what it skipped. A reader
error (a malformed line, a file that cannot be opened) arrives in its place in the stream and is
raised here as the same TraceError, after everything read before it. A reading process that dies
without a word is an error naming its exit code; leaving the context stops it.
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from multiprocessing.connection import Connection
from typing import Any

from watchdog.model import NodeSnapshot, SnapshotBlock
from watchdog.sample.errors import SkipLog, TraceError
from watchdog.sample.replay import Trace, open_trace

_BATCH = 256  # single snapshots sent at once (blocks go one by one)
_AHEAD = 64  # messages read ahead of the detectors: a few seconds of a day-long trace


class ReaderFailed(RuntimeError):
    """The reading process failed other than on the trace's content (a bug, or it was killed)."""


def available() -> bool:
    """Whether traces can be read ahead here: a second core and fork() to start the reader cheaply."""
    return (multiprocessing.cpu_count() or 1) > 1 and "fork" in multiprocessing.get_all_start_methods()


@contextmanager
def open_trace_ahead(spec: str, lenient: bool = False, csv_fields: list[str] | None = None) -> Iterator[Trace]:
    """open_trace(spec, ...), read by a second process."""
    context = multiprocessing.get_context("fork")
    receiving, sending = context.Pipe(duplex=False)
    reader = context.Process(target=_read, args=(sending, spec, lenient, csv_fields), daemon=True,
                             name="stall-watchdog trace reader")
    reader.start()
    sending.close()
    # A thread drains the pipe as fast as the reader fills it, so neither process waits on the other
    # while the work of each varies (a quiet hour detects faster than it reads, a hang slower).
    messages: queue.Queue[bytes | None] = queue.Queue(maxsize=_AHEAD)
    pump = threading.Thread(target=_pump, args=(receiving, messages), daemon=True, name="trace pump")
    pump.start()
    try:
        kind, value = _receive(messages, reader)
        if kind == "error":
            raise TraceError(value)
        skips = SkipLog(lenient=lenient)
        yield Trace(_stretches(messages, reader, skips), naive_time=value, skips=skips)
    finally:
        if reader.is_alive():
            reader.terminate()
        reader.join()
        while pump.is_alive():  # a pump waiting on a full queue: make room until it has seen the end
            with suppress(queue.Empty):
                messages.get(timeout=0.05)
        receiving.close()


def _pump(receiving: Connection, messages: queue.Queue[bytes | None]) -> None:
    try:
        while True:
            messages.put(receiving.recv_bytes())
    except (EOFError, OSError):
        messages.put(None)


def _stretches(messages: queue.Queue[bytes | None], reader: Any, skips: SkipLog
               ) -> Iterator[NodeSnapshot | SnapshotBlock]:
    while True:
        kind, value = _receive(messages, reader)
        if kind == "items":
            yield from value
            continue
        skips.count, skips.first, error = value
        if error is not None:
            raise TraceError(error)
        return


def _receive(messages: queue.Queue[bytes | None], reader: Any) -> tuple[str, Any]:
    message = messages.get()
    if message is None:
        reader.join(timeout=5)
        raise ReaderFailed(f"the trace reader exited without finishing (exit code {reader.exitcode})")
    kind, value = pickle.loads(message)
    if kind == "crash":
        raise ReaderFailed(f"the trace reader failed:\n{value}")
    return kind, value


def _read(sending: Connection, spec: str, lenient: bool, csv_fields: list[str] | None) -> None:
    """The reading process: everything it reads, in order, then what it skipped."""
    try:
        try:
            with open_trace(spec, lenient=lenient, csv_fields=csv_fields) as trace:
                sending.send(("open", trace.naive_time))
                batch: list[NodeSnapshot | SnapshotBlock] = []
                error = None
                try:
                    for item in trace.stretches:
                        batch.append(item)
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
