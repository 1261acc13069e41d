"""`analyze PATH...`: every kind of hang evidence, recognised by its content, read into one picture.

    py-spy text or JSON, `stacks dump --out` folders   the stacks, grouped; the odd ranks named
    incident and dump bundles                          their stacks, Flight Recorder dumps and RAS finding
    Flight Recorder dumps (pickle or JSON) or folders   matched per process group
    ncclras reports (JSON or text; two = stuck test)    the ranks behind
    NCCL watchdog timeout logs (one or many ranks)      the ranks behind by sequence number, the silent ones
    coordinator job bundles                             the job verdict across nodes, re-derived
    nvidia-smi tables                                   GPUs that spin near idle power, or idle holding memory
    kernel logs (Xid, a GPU lost, PCIe AER)             the GPU that failed, and what its Xid means
    crash logs (OOM, illegal access, NCCL error...)     which rank crashed of what: a crash, not a hang
    training logs (step counters, progress bars)        progress, when nothing else shows trouble

The output is `stacks analyze`'s contract: `groups`, `outliers` ("rank N" / "pid N"), `summary`,
`verdict`, plus `flight_recorder` and `nccl_ras` when those were given.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from watchdog.cli.common import EXIT_FAILURE, EXIT_OK, error
from watchdog.cli.evidence import Evidence, gather
from watchdog.cli.stacks import print_pictures
from watchdog.pasted import crash_log, kernel_log, smi_table
from watchdog.pasted.finding import Finding
from watchdog.stacks import fr_matching, fr_text, nccl_timeouts, ras_report, timeout_verdict
from watchdog.stacks.analysis import Analysis, analyze
from watchdog.stacks.confirm import ONE_LOOK
from watchdog.stacks.picture import StackPicture, named_by, with_job_evidence
from watchdog.stacks.verdict import verdict
from watchdog.vocabulary.model import Severity, Verdict


def _ras(found: Evidence) -> ras_report.RasFinding | None:
    """The RAS reports given, judged: the first and the last as two queries when there are several."""
    if not found.ras:
        return None
    return ras_report.judge(found.ras[0], found.ras[-1] if len(found.ras) > 1 else None)


def picture_of(found: Evidence, name: str) -> StackPicture:
    """One verdict over everything read. A hang where any evidence shows one; NO_STALL only on positive
    evidence of progress (RAS counts that moved between two reports, a training log's counter rising) with
    nothing stuck; otherwise UNKNOWN, saying what was read and what it cannot tell."""
    fr = fr_matching.analyze(found.traces) if found.traces else None
    ras = _ras(found)
    timeouts = nccl_timeouts.parse_lines(found.timeout_lines) if found.timeout_lines else None
    frt = fr_text.FrText(tuple(m for f in found.fr_text for m in f.mismatches),
                         tuple(sorted({r for f in found.fr_text for r in f.behind_in_table})),
                         tuple(e for f in found.fr_text for e in f.entries)) if found.fr_text else None
    notes = [n for n in (timeouts.summary if timeouts else None, fr.summary if fr else None,
                         ras.summary if ras else None, frt.summary if frt else None) if n]
    crash = _crash(found, bool(found.dumps) or _stuck_elsewhere(timeouts, fr, ras, frt))
    if crash is not None:
        analysis = Analysis((), crash.named, ". ".join(notes), 0)
        return StackPicture(name, None, False, analysis, crash.verdict().noted(notes), fr=fr, ras=ras,
                            timeouts=timeouts)
    table = smi_table.judge(found.smi_tables)
    if table is not None:
        if not (found.dumps or timeouts or fr or ras or frt or found.progress or found.doubts):
            analysis = Analysis((), table.named, table.reason, 0)
            return StackPicture(name, None, False, analysis, table.verdict())
        notes.append(table.reason)
    if found.dumps:
        analysis = analyze(found.dumps)
        decided = with_job_evidence(verdict(analysis), fr, ras)
        others = _stuck_elsewhere(timeouts, fr, ras, frt)
        if decided.kind in ("unknown", "no_stall") and others:
            decided = Verdict("hang", Severity.CRITICAL, decided.sentence, _headline(found, timeouts, fr, ras, frt))
        elif decided.kind == "hang":  # saved stacks are one look: a hang only with evidence that spans the time
            decided = replace(decided, severity=Severity.CRITICAL) if others else decided.noted([ONE_LOOK])
        decided = decided.noted([n for n in notes if n not in decided.sentence])
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


def _crash(found: Evidence, stuck: bool) -> Finding | None:
    """The crash that explains the evidence, if one does: a GPU the hardware failed always (the ranks that wait
    wait on it); a rank that died of an error it names, also when the others then time out or hang waiting for
    it; a crash with no rank named only when nothing else shows the job stuck."""
    gpu = kernel_log.judge(found.gpu_events)
    if gpu is not None and gpu.kind == "crash" and (gpu.severity is Severity.CRITICAL or not stuck):
        return gpu
    crash = crash_log.judge(found.crashes)
    if crash is not None and (crash.named or not stuck or found.crashes[0].what in crash_log.GPU_FAULTS):
        return crash
    if gpu is not None and not stuck and not found.crashes and not found.smi_tables:
        return gpu  # corrected errors only: said, judged nothing
    return None


def _culprits(timeouts: timeout_verdict.TimeoutFinding | None, fr: fr_matching.FlightRecorderAnalysis | None,
              ras: ras_report.RasFinding | None, frt: fr_text.FrText | None) -> list[int]:
    return sorted({*(fr.culprits if fr else ()), *(ras.culprits if ras else ()),
                   *(timeouts.culprits if timeouts else ()), *(frt.culprits if frt else ())})


def _stuck_elsewhere(timeouts: timeout_verdict.TimeoutFinding | None, fr: fr_matching.FlightRecorderAnalysis | None,
                     ras: ras_report.RasFinding | None, frt: fr_text.FrText | None) -> bool:
    """Whether evidence beyond the stacks shows the job stuck: a watchdog timeout (the job waited past its
    collective timeout), a Flight Recorder mismatch, a rank RAS declared dead, missing or stuck."""
    return bool(timeouts and timeouts.read) or bool(fr and (fr.culprits or fr.stuck)) or \
        bool(ras and (ras.stuck or ras.broken)) or bool(frt and frt.culprits)


def _headline(found: Evidence, timeouts: timeout_verdict.TimeoutFinding | None,
              fr: fr_matching.FlightRecorderAnalysis | None, ras: ras_report.RasFinding | None,
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


def _cannot_tell(found: Evidence, timeouts: timeout_verdict.TimeoutFinding | None, ras: ras_report.RasFinding | None,
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
    if found.doubts and not why:
        why.append("a counter rose, but the log also shows trouble, and progress before it says nothing of after it")
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
                         progress=found.progress, doubts=found.doubts, smi_tables=found.smi_tables,
                         gpu_events=found.gpu_events, crashes=found.crashes,
                         kinds=[k for k in found.kinds if k != "stacks"])
    if found.dumps or found.traces or found.ras or found.timeout_lines or found.fr_text or found.progress or \
            found.doubts or found.smi_tables or found.gpu_events or found.crashes:
        pictures.append(picture_of(found, name))
    if not pictures:
        error("nothing to analyse in " + ", ".join(args.paths))
        return EXIT_FAILURE
    print_pictures(pictures, args.json)
    return EXIT_OK


def cmd_stacks_analyze(args: argparse.Namespace) -> int:
    """The stacks part of `analyze`: the same reading of the same files and folders, the same split into jobs."""
    return cmd_analyze(argparse.Namespace(paths=args.files, json=args.json))
