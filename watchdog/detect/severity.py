"""One severity for an episode, decided once from all the evidence: the telemetry signature, the host
progress of the ranks, the stacks' verdict when there is one, how long it has lasted, and the pauses
this job has already shown it recovers from. What this returns is the episode's state: /metrics, the
alerts, the bundle and the report all read it.

    busy_spin  every GPU spins: critical. Stacks that show a rank busy on the host (waiting) or the
               culprit on another node (remote) make it a warning until critical_after_seconds.
    zero_util  every GPU idle with memory held:
               stacks show a hang, or the ranks are still on the host for progress_still_seconds -> critical
               the ranks move on the host (a checkpoint, an evaluation) -> held back for
               job.busy_pause_quiet_seconds, then a warning
               telemetry alone -> warning; critical once the pause outlasts what the job has recovered
               from (x recovered_pause_margin_ratio, not before critical_min_seconds) or critical_after_seconds
    waiting    the odd rank's stacks show it blocked, or its GPU is idle and its process still -> critical;
               otherwise a warning (held back while the odd rank is busy on the host, for
               job.busy_pause_quiet_seconds) until the stall outlives critical_after_seconds
               (critical_after_busy_seconds once an odd GPU was seen at work during it: a writer)
A zero_util or waiting pause that comes no sooner after the job's last one than it has ever paused again
and lasts no longer than its recovered pauses (x the margin) is held back (detect/pauses.py): it stays
suspect, so the job's every checkpoint does not raise a warning again, while a pause that comes sooner is
alerted at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from watchdog.config import Config, EpisodeTiming, WaitingConfig, ZeroUtilConfig
from watchdog.detect.pauses import PauseMemory
from watchdog.vocabulary.model import Finding, Progress, Severity, Signature, Verdict
from watchdog.vocabulary.words import duration_text, plural

PAUSES = (Signature.ZERO_UTIL, Signature.WAITING)  # what a healthy job also shows for a while
STACK_SIGNATURES = (Signature.BUSY_SPIN, Signature.ZERO_UTIL, Signature.WAITING)  # worth a look at the stacks


@dataclass(frozen=True)
class Judgement:
    severity: Severity
    reason: str  # why this severity, in one clause a person reads after the verdict


def judge(finding: Finding, onset: float, elapsed: float, timing: EpisodeTiming, config: Config,
          stacks: Verdict | None, pauses: PauseMemory, culprits_busy: bool = False) -> Judgement | None:
    """The episode's severity now; None to hold it back (a pause of a length the job has recovered from).
    `timing` is the signature's own section (the tracker's, which a reload replaces); `culprits_busy`
    whether a culprit GPU has been seen at work during this stall."""
    sig = finding.signature
    if sig not in STACK_SIGNATURES:
        return Judgement(finding.severity, "")
    job, d = config.job, config.detectors
    if stacks is not None and stacks.kind == "hang":
        return Judgement(Severity.CRITICAL, "the stacks show the ranks blocked" + (
            ", twice, with nothing moving between" if stacks.confirmed else ""))
    still, moving = finding.progress is Progress.STILL, finding.progress is Progress.MOVING
    ranks = len(finding.gpus)  # a rank a GPU: the words agree with how many
    if sig is Signature.BUSY_SPIN:
        if stacks is not None and stacks.kind in ("waiting", "remote"):
            if elapsed >= d.waiting.critical_after_seconds:
                return Judgement(Severity.CRITICAL, f"still spinning after {duration_text(elapsed)}")
            return Judgement(Severity.WARNING, "the stacks say the ranks wait on work that is still running")
        return Judgement(Severity.CRITICAL, "a collective that will not finish")
    if sig is Signature.ZERO_UTIL:
        if still:
            return Judgement(Severity.CRITICAL, f"{plural(ranks, 'the rank has', 'the ranks have')} not moved on "
                                                f"the host for {duration_text(finding.still_seconds)}")
        if pauses.expected(onset, elapsed, job.recovered_pause_margin_ratio):
            return None
        if moving and elapsed < job.busy_pause_quiet_seconds:
            return None
        if moving or (stacks is not None and stacks.kind == "waiting"):
            return Judgement(Severity.WARNING, f"{plural(ranks, 'the rank is', 'the ranks are')} busy on the "
                                               f"host: a checkpoint or evaluation; critical if "
                                               f"{plural(ranks, 'it stops', 'they stop')} moving")
        zero = timing if isinstance(timing, ZeroUtilConfig) else d.zero_util
        limit = zero.critical_after_seconds
        recovered_pause = pauses.longest
        if recovered_pause is not None:
            limit = min(limit, max(zero.critical_min_seconds,
                                   job.recovered_pause_margin_ratio * recovered_pause))
        if elapsed >= limit:
            return Judgement(Severity.CRITICAL, f"longer than this job's pauses ({duration_text(limit)})")
        return Judgement(Severity.WARNING, f"a checkpoint or evaluation is plausible; critical after "
                                           f"{duration_text(limit)}")
    # waiting
    waiting = timing if isinstance(timing, WaitingConfig) else d.waiting
    critical_after = waiting.critical_after_busy_seconds if culprits_busy else waiting.critical_after_seconds
    odd = len(finding.culprit_gpus)
    if still:
        return Judgement(Severity.CRITICAL, plural(odd, "the odd rank's GPU is idle and its process has",
                                                   "the odd ranks' GPUs are idle and their processes have")
                         + f" not moved for {duration_text(finding.still_seconds)}")
    if elapsed >= critical_after:
        return Judgement(Severity.CRITICAL, "longer than a checkpoint or evaluation should take")
    if pauses.expected(onset, elapsed, job.recovered_pause_margin_ratio):
        return None
    if moving and elapsed < job.busy_pause_quiet_seconds:
        return None
    busy = plural(odd, " (its process is busy on the host)", " (their processes are busy on the host)") if moving \
        else ""
    return Judgement(Severity.WARNING, f"a checkpoint or evaluation on the odd {plural(odd, 'GPU')} is plausible"
                                       f"{busy}; critical after {duration_text(critical_after)}")
