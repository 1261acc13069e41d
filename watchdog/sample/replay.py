"""Opens any trace the `replay` verb accepts: an nvidia-smi CSV log, a JSON Lines recording, or
`sim:NAME` for a scripted scenario."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from watchdog.sample import recording, sim
from watchdog.sample.errors import SkipLog, TraceError
from watchdog.sample.lines import TextLines
from watchdog.sample.smi_csv import smi_csv_stretches
from watchdog.vocabulary.model import NodeSnapshot, SnapshotBlock, each_snapshot

SIM_PREFIX = "sim:"
TRACE_SUFFIXES = (".csv", ".jsonl", ".json", ".log", ".txt")  # what a folder given to `replay` contributes


@dataclass
class Trace:
    stretches: Iterator[NodeSnapshot | SnapshotBlock]  # the snapshots, regular stretches as column blocks
    naive_time: bool  # nvidia-smi timestamps carry no offset: print them back without one
    skips: SkipLog = field(default_factory=SkipLog)

    @property
    def snapshots(self) -> Iterator[NodeSnapshot]:
        return each_snapshot(self.stretches)


def scenario(name: str) -> sim.Scenario:
    try:
        return sim.SCENARIOS[name]
    except KeyError:
        raise TraceError(f"unknown scenario {name!r}; choose one of: {', '.join(sim.SCENARIOS)}") from None


@contextmanager
def open_trace(spec: str, lenient: bool = False, csv_fields: list[str] | None = None) -> Iterator[Trace]:
    skips = SkipLog(lenient=lenient)
    if spec.startswith(SIM_PREFIX):
        yield Trace(sim.run(scenario(spec[len(SIM_PREFIX):])), naive_time=False, skips=skips)
        return
    path = Path(spec)
    try:
        stream = path.open("rb")
    except OSError as exc:
        raise TraceError(f"{spec}: cannot open: {exc.strerror or exc}") from None
    with stream:
        first = stream.peek(4)[:4].removeprefix(b"\xef\xbb\xbf")[:1]
        lines = TextLines(stream, spec, skips)
        if first == b"{":
            yield Trace(recording.stretches(lines, spec, skips), naive_time=False, skips=skips)
        else:
            yield Trace(smi_csv_stretches(lines, spec, csv_fields, skips), naive_time=True, skips=skips)
