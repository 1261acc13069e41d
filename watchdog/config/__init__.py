"""Typed configuration: the one home of every default, threshold and unit, split by what each part configures.

    schema.py       what a section is: annotated fields with defaults, limits and descriptions, validated strictly
    base.py         the units (seconds, ratios), the URL rule, the base section
    detectors.py    each rule's thresholds and how long its evidence must last
    sampling.py     the source, the sample loop, the job, the stacks, the kubelet
    outputs.py      the metrics endpoint, dumps, incident bundles, alerts and receivers
    actions.py      what may be done about a confirmed hang, and its guards
    coordinator.py  `stall-watchdog coordinate`, the job-wide service
    loading.py      the whole Config, loading and checking it, the generated example and reference

Everything is imported from here (`from watchdog.config import Config, StacksConfig`).
"""

from watchdog.config.actions import (
    ACTION_NAMES,
    ActionsConfig,
    FleetConfig,
    KubernetesActionConfig,
    SlurmActionConfig,
)
from watchdog.config.base import SCENARIO_NAMES, Interval, Ratio, Seconds, SecondsOrZero
from watchdog.config.coordinator import DAEMON_SCRAPE_JOB, JOB_LABELS, CoordinatorConfig, KubernetesLookupConfig
from watchdog.config.detectors import (
    BusySpinConfig,
    DetectorsConfig,
    EpisodeTiming,
    GpuHealthConfig,
    GpuLostConfig,
    StragglerConfig,
    ThrottleConfig,
    UnderuseConfig,
    WaitingConfig,
    ZeroUtilConfig,
)
from watchdog.config.loading import Config, ConfigError, example_yaml, load_config, parse_config, reference_markdown
from watchdog.config.outputs import AlertsConfig, BundlesConfig, DumpConfig, ExportConfig, ReceiverConfig
from watchdog.config.sampling import JobConfig, KubernetesConfig, SampleConfig, SourceConfig, StacksConfig

__all__ = [
    "ACTION_NAMES", "DAEMON_SCRAPE_JOB", "JOB_LABELS", "SCENARIO_NAMES", "ActionsConfig", "AlertsConfig",
    "BundlesConfig", "KubernetesLookupConfig",
    "BusySpinConfig", "Config", "ConfigError", "CoordinatorConfig", "DetectorsConfig", "DumpConfig",
    "EpisodeTiming", "ExportConfig", "FleetConfig", "GpuHealthConfig", "GpuLostConfig", "Interval", "JobConfig",
    "KubernetesActionConfig", "KubernetesConfig", "Ratio", "ReceiverConfig", "SampleConfig", "Seconds",
    "SecondsOrZero", "SlurmActionConfig", "SourceConfig", "StacksConfig", "StragglerConfig", "ThrottleConfig",
    "UnderuseConfig", "WaitingConfig", "ZeroUtilConfig", "example_yaml", "load_config", "parse_config",
    "reference_markdown",
]
