"""The detectors' sections: each rule's thresholds and how long its evidence must last."""

from __future__ import annotations

from typing import Annotated

from watchdog.config.base import Ratio, Seconds, SecondsOrZero, _Section
from watchdog.config.schema import Field


class EpisodeTiming(_Section):
    """How long a condition must hold before it fires, and be absent before it resolves."""

    enabled: bool = Field(True, description="Run this detector.")
    for_seconds: SecondsOrZero = Field(30.0, description="Condition must hold this long before firing.")
    clear_seconds: Seconds = Field(
        10.0, description="Condition must be absent this long before an episode resolves (hysteresis)."
    )


class BusySpinConfig(EpisodeTiming):
    """Utilization pinned at 100% while the GPU does no real work (a collective spinning on a flag)."""

    window_seconds: Seconds = Field(20.0, description="Trailing window the legs are computed over.")
    utilization_min_ratio: Ratio = Field(
        0.995,
        description="Half the window samples must be at or above this utilization. A spinning kernel is "
        "resident every sample period (reads 100%); real work leaves gaps (97-99%).",
    )
    idle_power_max_multiple: Annotated[float, Field(gt=1)] = Field(
        2.5,
        description="Leg power_near_idle: median power at most this multiple of the GPU's idle power "
        "(H100: 150 W vs 70 W idle; V100: 70 W vs 40 W).",
    )
    default_idle_power_ratio: Ratio = Field(
        0.12,
        description="Idle power assumed, as a fraction of the power limit, until this GPU has been "
        "seen idle.",
    )
    busy_power_max_ratio: Ratio = Field(
        0.5,
        description="Leg power_below_busy: median power at most this fraction of the power this GPU drew "
        "while it was doing real work earlier.",
    )
    power_flat_max_ratio: Ratio = Field(
        0.05, description="Leg power_flat: interquartile range of power at most this fraction of its median."
    )
    power_flat_min_watts: Annotated[float, Field(ge=0)] = Field(
        5.0, description="Leg power_flat also holds when the interquartile range is within this many watts (the "
        "sensor noise of small GPUs: a T4 reads +-4 W).")
    fell_max_ratio: Ratio = Field(
        0.75, description="Leg power_fell (weak): median power at most this fraction of the power this GPU drew "
        "doing real work. It counts only when every GPU of the job is pinned at 100% with it (a T4 spins at "
        "60-65% of its busy power).")
    memory_utilization_max_ratio: Ratio = Field(
        0.05,
        description="Leg memory_idle: memory-controller utilization at most this over the window. Above it "
        "vetoes the spin (a spinning kernel moves no memory).",
    )
    sm_activity_max_ratio: Ratio = Field(
        0.2,
        description="Leg sm_activity_low (GPM, Hopper and later): SM activity at most this. Above it vetoes.",
    )
    clock_min_ratio: Ratio = Field(
        0.5, description="SM clock below this fraction of its maximum vetoes the spin (throttled, not spinning)."
    )
    min_legs: Annotated[int, Field(ge=1, le=5)] = Field(
        2, description="Legs that must fire, at least one of them other than power_flat."
    )


class ZeroUtilConfig(EpisodeTiming):
    """Utilization 0 with the job's memory still held, not growing and not released."""

    for_seconds: SecondsOrZero = Field(45.0, description="Condition must hold this long before firing.")
    window_seconds: Seconds = Field(15.0, description="Trailing window the condition is computed over.")
    utilization_max_ratio: Ratio = Field(
        0.02, description="At least half the window's samples at or below this utilization."
    )
    blip_max_ratio: Ratio = Field(
        0.05, description="The other samples at or below this: an idle GPU with a context shows brief 1-4% "
        "blips now and then, which neither end nor restart a pause.")
    memory_growth_max_bytes: Annotated[int, Field(ge=0)] = Field(
        256 * 2**20, description="Memory growing by more than this over the window is start-up, not a hang."
    )
    critical_after_seconds: Seconds = Field(
        540.0, description="Telemetry alone (no process seen on the GPUs): a pause is a warning, critical once it "
        "lasts this long, or sooner once it outlasts the pauses this job has recovered from "
        "(job.recovered_pause_margin_ratio), but never before critical_min_seconds.")
    critical_min_seconds: Seconds = Field(
        300.0, description="Telemetry alone: never critical before this (checkpoints of large models take minutes).")


class WaitingConfig(EpisodeTiming):
    """Most of the job's GPUs spin while the others do something else: they wait on those others."""

    critical_after_seconds: Seconds = Field(
        540.0,
        description="Escalate to critical once the wait on idle GPUs outlives what a checkpoint or evaluation "
        "plausibly takes (critical_after_busy_seconds instead while an odd GPU works).",
    )
    critical_after_busy_seconds: Seconds = Field(
        900.0, description="The same while an odd GPU has been seen at work on something else during the wait (a "
        "checkpoint writer's copies read 5-7% util): rank 0 writing a large checkpoint takes longer.")


class UnderuseConfig(EpisodeTiming):
    """A running job that keeps its GPUs mostly idle (warning, never a page)."""

    for_seconds: SecondsOrZero = Field(1800.0, description="Condition must hold this long before firing.")
    clear_seconds: Seconds = Field(120.0, description="Condition must be absent this long to resolve.")
    window_seconds: Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False)] = Field(
        600.0, description="Trailing window for the mean utilization (at most an hour: the detectors keep every "
        "sample of it; for_seconds says how long under-use must last).")
    utilization_max_ratio: Ratio = Field(0.5, description="Mean utilization at or below this is under-use.")
    utilization_min_ratio: Ratio = Field(
        0.05, description="Mean utilization below this is not a running job (zero_util's case)."
    )


class ThrottleConfig(EpisodeTiming):
    """Clocks pulled down by thermal, power-brake or hardware slowdown (warning)."""


class GpuLostConfig(EpisodeTiming):
    """The GPU stopped answering NVML (fell off the bus) or an NVML call on it hung."""

    for_seconds: SecondsOrZero = Field(
        10.0, description="Condition must hold this long before firing: one sample that says the GPU is lost (a "
        "cell of a log, a call that failed once) is not a lost GPU.")
    hung_for_seconds: Seconds = Field(
        30.0, description="NVML calls on the GPU that do not return within sample.nvml_call_timeout_seconds count "
        "only once they have not returned for this long: one slow call (driver lock contention) is a slow reading, "
        "not a lost GPU.")


class GpuHealthConfig(EpisodeTiming):
    """A GPU reporting a fault: a hardware Xid, uncorrected or climbing ECC errors, a memory repair pending or
    failed, NVLink or PCIe errors climbing, a PCIe link trained down (warning)."""

    for_seconds: SecondsOrZero = Field(0.0, description="Condition must hold this long before firing.")
    clear_seconds: Seconds = Field(
        60.0, description="Condition must be absent this long before an episode resolves (hysteresis).")
    xid_hold_seconds: Seconds = Field(
        600.0, description="A hardware Xid keeps its GPU's episode open this long after it was reported.")
    window_seconds: Seconds = Field(
        3600.0, description="Climbing counters (corrected ECC, NVLink and PCIe replay errors) are counted over "
        "this trailing window.")
    corrected_ecc_rise: Annotated[int, Field(ge=1)] = Field(
        100, description="Corrected ECC errors within window_seconds that make a warning (a few are routine).")
    nvlink_errors_rise: Annotated[int, Field(ge=1)] = Field(
        100, description="NVLink CRC, replay and recovery errors within window_seconds that make a warning.")
    pcie_replays_rise: Annotated[int, Field(ge=1)] = Field(
        100, description="PCIe replays within window_seconds that make a warning.")
    busy_min_ratio: Ratio = Field(
        0.5, description="A PCIe link below its maximum generation counts only while the GPU is at least this "
        "busy (links train down at idle to save power); a narrower link always counts.")
    hang_lookback_seconds: Seconds = Field(
        900.0, description="A hang's verdict names the Xids its GPUs reported within this long before it.")


class StragglerConfig(EpisodeTiming):
    """One rank of a job that its peers wait for in every step (warning): its GPU computes at clocks its working
    peers do not, or its stack samples show it waiting in collectives less than its job's other ranks do."""

    for_seconds: SecondsOrZero = Field(60.0, description="Condition must hold this long before firing.")
    clear_seconds: Seconds = Field(
        60.0, description="Condition must be absent this long before an episode resolves (hysteresis).")
    window_seconds: Seconds = Field(
        120.0, description="Trailing window over which a GPU's median SM clock is compared with its peers'.")
    wait_window_seconds: Annotated[float, Field(gt=0, le=900, allow_inf_nan=False)] = Field(
        60.0, description="Trailing window over which each rank's share of stack samples spent waiting in a "
        "collective or a sync is compared with its job's other ranks' (stacks.sample_rate_hz); the rule also looks "
        "over four times it, where a smaller gap stands out of chance (at most 15 minutes: the records of four "
        "times it are kept and walked at every judgement).")
    wait_gap_ratio: Annotated[float, Field(gt=0, lt=1)] = Field(
        0.05, description="A rank that waits at least this share of its time less than the median of its job's "
        "other ranks on the node, beyond chance, is the one they wait for, once the job runs at least this much "
        "slower for it (its peers' waits against their first look; between 0 and 1).")
    wait_sigmas: Annotated[float, Field(ge=1, le=20)] = Field(
        5.0, description="Beyond chance: the gap is at least this many standard errors of the two shares.")
    wait_min_samples: Annotated[int, Field(ge=10, le=100000)] = Field(
        100, description="Stack samples a rank needs in the window to be compared.")
    clock_deficit_ratio: Annotated[float, Field(gt=0, lt=1)] = Field(
        0.1, description="A GPU whose median SM clock is at least this fraction below the median of its working "
        "peers' is a straggler (between 0 and 1).")
    busy_min_ratio: Ratio = Field(
        0.5, description="The GPUs compared are those at least this busy (utilization), each over its own busy "
        "samples.")
    min_gpus: Annotated[int, Field(ge=2, le=4096)] = Field(
        3, description="Working GPUs a tick needs for one of them to be called slower than its peers.")


class DetectorsConfig(_Section):
    busy_spin: BusySpinConfig = BusySpinConfig()
    zero_util: ZeroUtilConfig = ZeroUtilConfig()
    waiting: WaitingConfig = WaitingConfig()
    underuse: UnderuseConfig = UnderuseConfig()
    throttle: ThrottleConfig = ThrottleConfig()
    gpu_lost: GpuLostConfig = GpuLostConfig()
    gpu_health: GpuHealthConfig = GpuHealthConfig()
    straggler: StragglerConfig = StragglerConfig()
