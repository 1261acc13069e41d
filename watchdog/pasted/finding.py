"""What a pasted-evidence reader found: one verdict's worth, with the members it names."""

from __future__ import annotations

from dataclasses import dataclass

from watchdog.vocabulary.model import Severity, Verdict


@dataclass(frozen=True)
class Finding:
    kind: str  # a Verdict kind: "hang" (a suspicion from one look), "crash", "no_stall", "unknown"
    severity: Severity | None
    reason: str  # what the text shows, in a sentence or two
    headline: str  # the conclusion in one clause
    named: tuple[str, ...] = ()  # "rank 3", "GPU 2 (00000000:3B:00.0)": what the finding blames

    def verdict(self) -> Verdict:
        return Verdict(self.kind, self.severity, self.reason, self.headline)
