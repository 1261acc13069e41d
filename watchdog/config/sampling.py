"""Where readings come from and what is read of the ranks: the source, the sample loop, the job, the
stacks, the kubelet."""

from __future__ import annotations

from typing import Annotated, Literal

from watchdog.config.base import SCENARIO_NAMES, Interval, Ratio, Seconds, SecondsOrZero, _Section
from watchdog.config.schema import Field, LaxKeys


class JobConfig(_Section):
    memory_min_bytes: Annotated[int, Field(ge=0)] = Field(
        2**30,
        description="A GPU belongs to the running job when it holds at least this much memory (a bare "
        "CUDA context holds ~0.5 GiB) or runs a kernel.",
    )
    progress_cpu_min_ratio: Ratio = Field(
        0.2, description="Host progress: the processes on a GPU that use at least this many CPU seconds per "
        "second are moving (computing on the host).")
    progress_io_min_bytes_per_second: Annotated[float, Field(ge=0)] = Field(
        65536.0, description="Host progress: ... or that read and write at least this many bytes per second "
        "(a checkpoint writer).")
    progress_still_seconds: Seconds = Field(
        30.0, description="Processes that have not moved for this long are still: a pause whose ranks are still "
        "is a hang, not a checkpoint.")
    busy_pause_quiet_seconds: SecondsOrZero = Field(
        300.0, description="A pause (zero_util, waiting) whose ranks are busy on the host (writing a checkpoint, "
        "evaluating) is not alerted before it lasts this long; critical as soon as they stop moving.")
    relapse_seconds: SecondsOrZero = Field(
        600.0, description="After a critical stall episode ends on evidence of recovery (work resumed, memory "
        "released), a stall on the same GPUs within this long is the same episode continuing: one page, one "
        "bundle. Its resolve is sent once this long has passed without one.")
    recovered_pause_margin_ratio: Annotated[float, Field(ge=1.0)] = Field(
        1.5, description="A pause (zero_util, waiting) no longer than this multiple of the longest pause this job "
        "has already recovered from is not alerted again.")


class SampleConfig(_Section):
    interval_seconds: Interval = Field(1.0, description="Sampling period of the live source (0.05 s to 1 h).")
    nvml_call_timeout_seconds: Seconds = Field(
        2.0, description="An NVML call that takes longer marks the GPU hung; the loop goes on."
    )
    evaluate_interval_seconds: Interval = Field(
        1.0, description="Detectors run at most this often (traces sampled faster are still all ingested)."
    )
    batch_seconds: Annotated[float, Field(ge=0, le=60, allow_inf_nan=False)] = Field(
        10.0, description="While no stall is suspected or warned of (none open below critical), the live loop hands "
        "the detectors the ticks of this many seconds at once: the verdicts are those of judging each tick, a new "
        "sign of a hang is seen up to this much later, and the detectors cost about an eighth of judging every "
        "tick. A stall that is suspected is judged every tick until it is critical or ends, and a tick where a GPU "
        "is lost, hung or back is judged as it comes; while every open episode is critical, one and a half times "
        "this (its end is seen up to that much later). 0: every tick.")


class StacksConfig(_Section):
    """Capturing the ranks' Python stacks with py-spy."""

    py_spy_command: list[str] | None = Field(
        None, description="How to start py-spy, as an argv list; null: the py-spy installed with stall-watchdog, "
        "else the one on PATH.")
    timeout_seconds: Seconds = Field(5.0, description="A capture still running after this long is killed.")
    native: bool = Field(
        False, description="Add C/C++ frames (NCCL, CUDA). Needs a blocking read: pauses each rank for milliseconds.")
    max_parallel: Annotated[int, Field(ge=1, le=256)] = Field(16, description="Captures running at once.")
    observe_seconds: Annotated[float, Field(ge=0)] = Field(
        1.0, description="How long to watch each rank's CPU time and I/O around the capture.")
    flight_recorder: bool = Field(
        True, description="Ask PyTorch to dump its NCCL Flight Recorder when a rank enables the debug pipe.")
    recheck_seconds: Seconds = Field(
        60.0, description="While a stall episode is open and not critical, look at the stacks again this often "
        "(a rank that stopped moving between two looks makes it critical).")
    confirm_seconds: Annotated[float, Field(ge=0, le=60)] = Field(
        3.0, description="When the first look at a stall's stacks shows a hang, look again this long after it: the "
        "same ranks in the same places, with no host progress on a rank the others wait for in between, confirm "
        "the hang and make the episode critical before its for_seconds (see confirm_min_seconds). 0: one look only.")
    confirm_min_seconds: Annotated[float, Field(ge=0, le=600)] = Field(
        15.0, description="A hang the second look confirmed is critical before its signature's for_seconds only "
        "once the stall has lasted this long (a rank can wait seconds on a slow data loader or a subprocess), and "
        "not when it is a pause of a length this job has recovered from.")
    flight_recorder_wait_seconds: Annotated[float, Field(ge=0, le=120)] = Field(
        5.0, description="How long to wait for the Flight Recorder dumps asked for before reading what came.")
    nccl_ras: bool = Field(
        True, description="Ask NCCL's RAS service (NCCL 2.24+, localhost:28028 or the ranks' NCCL_RAS_ADDR) for "
        "every rank's collective counts across the job, twice, and name the ranks behind.")
    nccl_ras_gap_seconds: Annotated[float, Field(ge=0, le=60)] = Field(
        3.0, description="Time between the two RAS queries: counts unchanged across it mean stuck.")
    nccl_ras_timeout_seconds: Annotated[float, Field(gt=0, le=60)] = Field(
        5.0, description="How long RAS may gather the job's data for one query.")
    sample_rate_hz: Annotated[int, Field(ge=0, le=50)] = Field(
        16, description="Straggler sampling: stack samples per second of each rank's main thread, taken all the time "
        "with py-spy record --nonblocking (the rank is never paused), to tell which rank its peers wait for; a whole "
        "number (py-spy's --rate takes no other). 0: off.")
    sample_seconds: Annotated[float, Field(ge=2, le=300)] = Field(
        15.0, description="Straggler sampling: the length of one py-spy record; its counts reach the detectors when "
        "it ends.")
    sample_learn_seconds: Annotated[float, Field(ge=0, le=86400)] = Field(
        120.0, description="Straggler sampling: the first this-long of a rank's samples are kept apart as how it "
        "was before: a rank slow since then is uneven work, not a rank that became slow.")


class SourceConfig(_Section):
    """Where `run` reads the GPUs from."""

    kind: Literal["nvml", "sim"] = Field("nvml", description="nvml: the real GPUs; sim: a built-in scenario played in "
                                         "real time (tests, demos).")
    scenario: Literal[SCENARIO_NAMES] = Field(  # type: ignore[valid-type]
        "spin_hang", description="With kind sim: the scenario; `stall-watchdog replay --help` lists each and when "
        "its hang starts (spin_hang's at 300 s: start_offset_seconds 280 shows it within a minute).")
    start_offset_seconds: Annotated[float, Field(ge=0)] = Field(
        0.0, description="With kind sim: start this far into the scenario.")
    pids: dict[Annotated[int, LaxKeys], list[int]] = Field(  # a GPU's index as YAML or JSON writes a key
        default_factory=dict, description="With kind sim: real processes to treat as running on each simulated GPU "
        "(GPU index -> pids), so stacks can be captured.")




class KubernetesConfig(_Section):
    """On Kubernetes: which pod and container each rank is, from the kubelet's pod-resources API."""

    pod_resources_socket: str = Field(
        "/var/lib/kubelet/pod-resources/kubelet.sock", description="The kubelet's pod-resources socket, asked which "
        "pod holds each GPU. Not there (not a Kubernetes node, or not mounted): pods are named from each rank's "
        "cgroup and HOSTNAME instead. Empty: never ask.")
    refresh_seconds: Seconds = Field(30.0, description="Ask the kubelet again after this long (sooner, at most once a "
                                     "second, for a GPU its last answer did not name).")
    timeout_seconds: Seconds = Field(2.0, description="A pod-resources call still unanswered after this long fails.")
