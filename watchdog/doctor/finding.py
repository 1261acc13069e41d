"""A doctor's finding: the check's name, how bad it is, the evidence and the fix in one sentence."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Level(str, enum.Enum):
    """How bad a doctor's finding is (a scale of its own: a node fact is not an episode's severity)."""

    OK = "ok"
    INFO = "info"
    UNKNOWN = "unknown"
    WARNING = "warning"
    ERROR = "error"


OK, INFO, UNKNOWN, WARNING, ERROR = Level.OK, Level.INFO, Level.UNKNOWN, Level.WARNING, Level.ERROR
ORDER = {ERROR: 0, WARNING: 1, UNKNOWN: 2, INFO: 3, OK: 4}

# GPUs on which P2P is reported available but hangs in practice (NCCL_P2P_DISABLE=1 is the known fix).
KNOWN_P2P_TROUBLE = ("H20", "L20", "RTX 4090", "RTX 3090")


@dataclass(frozen=True)
class DoctorFinding:
    check: str
    severity: Level
    evidence: str
    fix: str = ""

    def to_json(self) -> dict[str, str]:
        return {"check": self.check, "severity": self.severity.value, "evidence": self.evidence, "fix": self.fix}


def model_short(name: str | None) -> str:
    return (name or "unknown").replace("NVIDIA ", "")


# -- node checks -----------------------------------------------------------------------------------
