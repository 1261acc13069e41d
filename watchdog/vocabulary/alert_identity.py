"""One alert per incident: the daemon's own Alertmanager alerts and the shipped Prometheus rules
(deploy/prometheus/rules.yml, fed by the episode_alert_info series) carry the same name and labels, so Alertmanager
holds one alert per incident whichever of the two reports it. Both are built here."""

from __future__ import annotations

from dataclasses import dataclass

from watchdog.vocabulary.model import Severity, Signature, Workload

RUNBOOK_URL = "https://github.com/stall-watchdog/stall-watchdog/blob/main/docs/runbook.md"
# One episode per GPU: `gpu` is a label.
PER_GPU_SIGNATURES = frozenset({Signature.THROTTLE, Signature.GPU_LOST, Signature.GPU_HEALTH, Signature.STRAGGLER})


def alert_name(signature: Signature) -> str:
    """StallWatchdogBusySpin, StallWatchdogZeroUtil, StallWatchdogWaiting, ..."""
    return "StallWatchdog" + "".join(part.title() for part in signature.value.split("_"))


def runbook_url(signature: Signature, base: str = RUNBOOK_URL) -> str:
    """The runbook section of an alert: docs/runbook.md has one heading per alert name."""
    return f"{base}#{alert_name(signature).lower()}"


@dataclass(frozen=True)
class AlertIdentity:
    """What names one incident's alert, fixed when it first fires: its signature then (a zero_util hang
    whose GPUs begin to spin stays the same alert), the node, the training job and its pod or Slurm job.
    Only the severity changes, and a new severity is a new alert (the old one is resolved)."""

    signature: Signature
    node: str
    training_job: str = "unknown"
    workload: Workload = Workload()
    gpu: int | None = None  # per-GPU signatures only

    def labels(self, severity: Severity) -> dict[str, str]:
        labels = {"alertname": alert_name(self.signature), "severity": severity.value,
                  "signature": self.signature.value, "node": self.node, "training_job": self.training_job}
        if self.gpu is not None:
            labels["gpu"] = str(self.gpu)
        return {**labels, **self.workload.label_values()}
