"""What is said about one episode, kept as fields, and the one renderer that writes its sentence.

An episode's sentence has parts that come from different places at different times: the detectors' summary
(the headline, why this severity, the telemetry, the stacks' verdict), the doctor's top finding (once the
incident is investigated), what the investigation could not gather (notes), and what the responder did
(once the actions policy decided). The incident keeps them as fields and every reader's words are rendered
here from them: the alert's summary (webhook, Alertmanager, command, the Slack line) and the bundle's
`verdict` (and so the report page). No reader patches a sentence another reader already wrote, so they cannot tell
one episode in different words.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Telling:
    summary: str  # the detectors' sentence for the event at hand (EpisodeEvent.summary)
    doctor: str = ""  # the doctor's top finding: its evidence, then its fix ("...; set NCCL_P2P_DISABLE=1")
    notes: tuple[str, ...] = ()  # what the investigation could not gather ("stopping: stacks not captured")
    action: str = ""  # what the responder did, one clause per job ("ACTED: terminated ranks 0-3 ... of hang")
    evidence: str = ""  # where the evidence an action stood on is kept (the bundle), said with the action

    def sentence(self) -> str:
        """The one sentence: the action first where there is one (it is what changed), then the episode, the
        doctor's finding and the notes. No closing full stop: each reader ends its own line."""
        said = self.summary.rstrip(". ")
        if self.doctor:
            said += f". Doctor: {self.doctor}"
        if self.notes:
            said += f". Not seen: {'; '.join(self.notes)}"
        if self.action:
            said = f"{self.action}{f'; evidence: {self.evidence}' if self.evidence else ''}. {said}"
        return said.rstrip(". ")

    def to_json(self) -> dict[str, object]:
        return {"summary": self.summary, "doctor": self.doctor, "notes": list(self.notes), "action": self.action,
                "evidence": self.evidence}
