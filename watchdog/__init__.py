"""stall-watchdog: catch stalled multi-GPU training jobs from GPU telemetry."""

__version__ = "0.1.0"
VERSION_LINE = f"stall-watchdog {__version__}"  # what --version prints
