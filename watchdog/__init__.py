"""stall-watchdog: catch stalled multi-GPU training jobs from GPU telemetry."""

__version__ = "0.1.0"
