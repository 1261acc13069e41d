"""Incident bundles: one folder per fired episode holding what an on-call engineer needs at 3 a.m.

    summary.json      the episode, the verdict sentence, where every rank was, what went wrong
    telemetry.jsonl   the node's samples around the onset (the recording format: `replay` reads it)
    stacks.json       the grouped stacks and outliers per job; stacks/<rank>.json: py-spy's raw JSON
    environment.json  each rank's command line and NCCL/CUDA environment
    doctor.json       the doctor's findings for the node and the job at the time of the incident
    report.html       all of it on one self-contained page (`stall-watchdog report BUNDLE` rebuilds it)

Written into a hidden folder of its own and renamed into place (a reader never sees half a bundle), by the
package's private-file writer (watchdog/boundary/private_files.py: folders 0700, files 0600, never through a link,
each bundle within `bundles.max_bundle_bytes`, refused before a byte passes it). A disk budget and a count
limit remove the oldest bundles first. A full or read-only disk, or a bundle over its budget, costs that
one bundle, not the loop.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from watchdog.boundary import private_files
from watchdog.config import BundlesConfig
from watchdog.doctor.finding import DoctorFinding
from watchdog.plumbing import logfmt
from watchdog.plumbing.counters import Counters
from watchdog.sample import recording
from watchdog.sample.ranks import RankInfo
from watchdog.stacks.picture import StackPicture, capture_file_name
from watchdog.vocabulary.model import EpisodeEvent, NodeSnapshot, Severity
from watchdog.vocabulary.telling import Telling
from watchdog.vocabulary.words import iso_time

REWALK_SECONDS = 600.0  # a bundle's files are walked again at least this often (disk_bytes)


@dataclass
class Incident:
    event: EpisodeEvent
    telemetry: Iterable[NodeSnapshot]
    pictures: list[StackPicture] = field(default_factory=list)
    ranks: list[RankInfo] = field(default_factory=list)
    telling: Telling | None = None  # what is said about it (the alert says the same sentence)
    severity: Severity | None = None
    partial: bool = False  # stopped before everything was gathered (shutdown, no time)
    doctor: list[DoctorFinding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self.event.onset_seconds))
        gpus = "-".join(map(str, self.event.gpus[:8])) or "node"
        return f"{stamp}-{self.event.signature.value}-gpu{gpus}"

    def summary(self) -> dict[str, object]:
        told = self.telling or Telling(self.event.summary)
        return {
            "event": self.event.to_json(), "severity": (self.severity or self.event.severity).value,
            "headline": self.event.headline, "verdict": told.sentence(), "telling": told.to_json(),
            "partial": self.partial, "notes": self.notes,
            "ranks": [{"pid": r.pid, "rank": r.rank, "gpus": list(r.gpus), "job": r.job_key,
                       **({"workload": r.workload.to_json()} if r.workload else {})} for r in self.ranks],
            "stacks": [{"job": rep.job, "summary": rep.analysis.summary, "outliers": list(rep.analysis.outliers),
                        "verdict": rep.verdict.to_json()} for rep in self.pictures],
            "written": iso_time(time.time()),
        }


MAX_ACTION_RECORDS = 64  # decisions one bundle records
MARKER = ".stall-watchdog-bundle"  # written first into every bundle: what rotation may remove
_BUNDLE_NAME = re.compile(r"^\d{8}T\d{6}Z-[a-z_]+-gpu[\w-]*$")


class BundleStore:
    def __init__(self, cfg: BundlesConfig, counters: Counters,
                 render_report: Callable[[Path], object] | None = None):
        """`render_report(folder)` writes the bundle's report page from its files (handed in by the
        composition root, so act does not import export)."""
        self.cfg = cfg
        self.counters = counters
        self.render_report = render_report
        self.root = Path(cfg.directory)
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"bundles.directory: {self.root} is a file, not a folder: name a folder (it is made "
                             "if missing)")
        # summary.json is read, changed and replaced by the incident workers (a verdict rewritten) and the
        # responder (an action recorded): one at a time, so that neither writes back a copy without the other's
        self._summary_lock = threading.RLock()
        # Each bundle's size as last walked, by the modification times it had then (_stamp) and when: a bundle is
        # walked again once something in it was written or replaced, and every REWALK_SECONDS whatever happened.
        self._sizes: dict[Path, tuple[tuple[int, int], int, float]] = {}

    def write(self, incident: Incident) -> Path | None:
        def fill(folder: Path, budget: private_files.Budget) -> None:
            private_files.write_json(folder / "summary.json", incident.summary(), budget)
            self._telemetry(folder / "telemetry.jsonl", incident, budget)
            self._pictures(folder, incident.pictures, budget)
            if incident.doctor:
                private_files.write_json(folder / "doctor.json", [d.to_json() for d in incident.doctor], budget)
            if incident.ranks:
                private_files.write_json(folder / "environment.json", [
                    {"pid": r.pid, "rank": r.rank, "gpus": list(r.gpus), "cmdline": list(r.cmdline),
                     "container": r.container, "workload": r.workload.to_json(), "env": dict(r.env),
                     "problems": list(r.problems)}
                    for r in incident.ranks], budget)
            if not self._render(folder):
                incident.partial = True

        path = self._commit(incident.name, fill, incident.event.signature.value)
        if path is not None:
            self.counters.inc("bundles_total", "partial" if incident.partial else "written")
        return path

    def write_dump(self, name: str, summary: dict[str, object], pictures: Sequence[StackPicture]) -> Path | None:
        """A bundle asked for over POST /v1/dump: the same stacks files, and the answer as summary.json."""
        def fill(folder: Path, budget: private_files.Budget) -> None:
            private_files.write_json(folder / "summary.json", summary, budget)
            self._pictures(folder, pictures, budget)
            self._render(folder)

        path = self._commit(name, fill, "dump")
        if path is not None:
            self.counters.inc("bundles_total", "written")
        return path

    def _pictures(self, folder: Path, pictures: Sequence[StackPicture], budget: private_files.Budget) -> None:
        if not pictures:
            return
        private_files.write_json(folder / "stacks.json", [p.to_json() for p in pictures], budget)
        stacks = private_files.make_dir(folder / "stacks")
        for picture in pictures:
            for capture in picture.captures:
                if capture.raw is not None:
                    private_files.write_json(stacks / capture_file_name(capture.target), capture.raw, budget)
        traces = [t for p in pictures for t in p.traces]
        if traces:
            recorded = private_files.make_dir(folder / "flight_recorder")
            for trace in traces:
                private_files.write_json(recorded / f"rank-{trace.rank}.json", trace.to_json(), budget)

    def _render(self, folder: Path) -> bool:
        try:
            if self.render_report is not None:
                self.render_report(folder)
            return True
        except Exception as exc:  # the bundle's data matters more than its page: it is kept, as partial
            logfmt.event("report_failed", level=logfmt.WARNING, error=f"{type(exc).__name__}: {exc}")
            return False

    def _commit(self, name: str, fill: Callable[[Path, private_files.Budget], None], what: str) -> Path | None:
        """Fill a hidden folder of its own (concurrent writers never share one), then rename it into place
        (a reader never sees half a bundle); rotate."""
        final = self.root / name
        temporary = self.root / private_files.unique_name(f".partial-{name}")
        total = self.cfg.max_total_bytes or 1 << 62  # 0: no disk budget
        budget = private_files.Budget(min(self.cfg.max_bundle_bytes, total), "bundles.max_bundle_bytes"
                                      if self.cfg.max_bundle_bytes <= total else "bundles.max_total_bytes")
        try:
            private_files.make_dir(self.root, parents=True)
            private_files.make_dir(temporary)
            private_files.write_json(temporary / MARKER, {"written_by": "stall-watchdog", "pid": os.getpid()})
            fill(temporary, budget)
            final = private_files.rename_free(temporary, self.root, name)
        except OSError as exc:
            shutil.rmtree(temporary, ignore_errors=True)
            self.counters.inc("bundles_total", "failed")
            logfmt.event("bundle_failed", level=logfmt.ERROR, signature=what, directory=str(self.root),
                         error=exc.strerror or str(exc))
            return None
        self.rotate(keep=final)
        return final

    def rewrite_verdict(self, bundle: str, event: EpisodeEvent, telling: Telling) -> None:
        """An escalated (or relapsed, or acted on) episode: the bundle's summary (and page) say the new severity
        and the sentence the alert says, so the bundle never disagrees with the metrics and the alert."""
        self._update_summary(bundle, {"severity": event.severity.value, "headline": event.headline,
                                      "verdict": telling.sentence(), "telling": telling.to_json(),
                                      "event": event.to_json(), event.event.value: iso_time(event.at_seconds)})

    def record_end(self, bundle: str, event: EpisodeEvent) -> None:
        """The episode resolved: the bundle (and its page) say when, and how long it lasted; the verdict
        stays the one it fired (or escalated) with."""
        self._update_summary(bundle, {"resolved": iso_time(event.at_seconds),
                                      "duration_seconds": round(event.at_seconds - event.onset_seconds, 3)})

    def keep_evidence(self, bundle: str, pictures: Sequence[StackPicture]) -> str:
        """The evidence captured just before acting, in a folder of its own in the bundle (before-action-*,
        within the bundle's size budget); its name. OSError when the bundle is gone or the disk refuses:
        then nothing is done."""
        if not os.path.isdir(bundle) or os.path.islink(bundle):
            raise FileNotFoundError(errno.ENOENT, "the incident bundle is gone", bundle)
        folder = Path(bundle) / private_files.unique_name("before-action")
        private_files.make_dir(folder)
        self._pictures(folder, pictures, private_files.Budget(self.cfg.max_bundle_bytes))
        return folder.name

    def record_action(self, bundle: str, record: dict[str, object]) -> None:
        """An actions decision (and each step it took) appended to the summary's `actions`. At most
        MAX_ACTION_RECORDS are kept (a decision that flaps for a week): the first half and the newest, with the
        number left out between them in `actions_left_out`."""
        with self._summary_lock:
            self._record_action(bundle, record)

    def _record_action(self, bundle: str, record: dict[str, object]) -> None:
        summary = json.loads((Path(bundle) / "summary.json").read_text(encoding="utf-8"))
        done = summary.get("actions") if isinstance(summary.get("actions"), list) else []
        changes: dict[str, object] = {"actions": [*done, record]}
        if len(done) >= MAX_ACTION_RECORDS:
            left_out = summary.get("actions_left_out")
            changes = {"actions": [*done[:MAX_ACTION_RECORDS // 2], *done[MAX_ACTION_RECORDS // 2 + 1:], record],
                       "actions_left_out": (left_out if isinstance(left_out, int) else 0) + 1}
        self._update_summary(bundle, changes)

    def _update_summary(self, bundle: str, changes: dict[str, object]) -> None:
        """summary.json with `changes` merged in, replaced atomically, and the page rendered again."""
        folder = Path(bundle)
        with self._summary_lock:
            summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
            summary.update(changes)
            private_files.write_json(folder / "summary.json", summary, replace=True)
            if self.render_report is not None:
                self.render_report(folder)

    def _telemetry(self, path: Path, incident: Incident, budget: private_files.Budget) -> None:
        """The kept telemetry, a line at a time (64 GPUs' 5 minutes are 4-6 MiB of text: never held whole)."""
        head = recording.header("bundle", iso_time(incident.event.onset_seconds), onset=incident.event.onset_seconds)
        with private_files.text_file(path, budget) as f:
            recording.write(f, head, incident.telemetry)

    def _ours(self, path: Path) -> bool:
        """A folder this daemon wrote: the name it gives bundles and its marker inside. Nothing else in a
        shared directory is ever counted, rotated or removed."""
        return path.is_dir() and not path.is_symlink() and (path / MARKER).is_file()

    def bundles(self) -> list[Path]:
        try:
            return sorted(p for p in self.root.iterdir() if _BUNDLE_NAME.match(p.name) and self._ours(p))
        except OSError:
            return []

    def leftovers(self) -> list[Path]:
        """Half-written bundles of a daemon that died mid-write (kill -9, power loss): ours, not in use."""
        try:
            found = [p for p in self.root.iterdir() if p.name.startswith(".partial-") and self._ours(p)]
        except OSError:
            return []
        return [p for p in found if not private_files.made_here(p.name)]

    def disk_bytes(self) -> int:
        """The bytes the bundles and leftovers take. A bundle is walked file by file only when it is new or its
        folder or summary changed since the last walk (every writer here replaces a file or adds one to the
        folder), or REWALK_SECONDS have passed (a file grown or cut in place by hand): twenty bundles of a node
        that hung before cost twenty walks every ten minutes, not every half minute."""
        total, sizes, now = 0, {}, time.monotonic()
        for path in self.bundles():
            stamp = _stamp(path)
            known = self._sizes.get(path)
            if known is not None and stamp is not None and known[0] == stamp and now - known[2] < REWALK_SECONDS:
                sizes[path] = known
                size = known[1]
            else:
                size = _size(path)
                if stamp is not None:
                    sizes[path] = (stamp, size, now)
            total += size
        self._sizes = sizes
        return total + sum(_size(p) for p in self.leftovers())

    def rotate(self, keep: Path | None = None) -> None:
        """Leftovers first, then the oldest bundles, until under the count and the disk budget; the newest
        bundle always stays. Only folders this daemon wrote (see _ours)."""
        for leftover in self.leftovers():
            shutil.rmtree(leftover, ignore_errors=True)
            logfmt.event("bundle_removed", bundle=str(leftover), reason="left half-written by an earlier run")
        bundles = self.bundles()
        sizes = {p: _size(p) for p in bundles}
        total = sum(sizes.values())
        for old in bundles:
            within = not self.cfg.max_total_bytes or total <= self.cfg.max_total_bytes  # 0: no disk budget
            if old == keep or (len(bundles) <= self.cfg.max_count and within):
                continue
            shutil.rmtree(old, ignore_errors=True)
            bundles = [b for b in bundles if b != old]
            total -= sizes[old]
            logfmt.event("bundle_removed", bundle=str(old), reason="disk budget or count")


def _stamp(path: Path) -> tuple[int, int] | None:
    """When the bundle's folder and its summary were last changed (None: gone, or not readable)."""
    try:
        return os.lstat(path).st_mtime_ns, os.lstat(path / "summary.json").st_mtime_ns
    except OSError:
        return None


def _size(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # removed while we looked
                total += os.lstat(os.path.join(folder, name)).st_size
    return total
