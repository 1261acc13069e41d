"""Which activity a rank's stack shows: a collective (and which), checkpoint I/O, data loading, ...

Each rank's main-thread stack is classified into an activity by the rules in ACTIVITY_RULES (first
rule that any frame matches wins, so a collective inside an evaluation is a collective).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from watchdog.vocabulary.stack_model import Frame, ThreadStack

# -- activities ----------------------------------------------------------------------------------------
COLLECTIVE = "collective"
CHECKPOINT_IO = "checkpoint_io"
DATA_LOADING = "data_loading"
GENERATION = "generation"
EVALUATION = "evaluation"
COMPILE = "compile"
BACKWARD = "backward"
FORWARD = "forward"
IDLE_WAIT = "idle_wait"
UNKNOWN = "unknown"

# Collective kind -> the function names that enter it (the last dotted part of a frame's name).
COLLECTIVE_KINDS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("all_reduce", "allreduce", "all_reduce_coalesced", "_all_reduce", "inference_all_reduce"),
    "broadcast": ("broadcast", "_broadcast", "broadcast_object_list", "_broadcast_coalesced"),
    "all_gather": ("all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_coalesced",
                   "all_gather_object", "allgather", "allgather_into_tensor_coalesced"),
    "reduce_scatter": ("reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base",
                       "reduce_scatter_coalesced"),
    "all_to_all": ("all_to_all", "all_to_all_single", "alltoall"),
    "barrier": ("barrier", "monitored_barrier"),
    "send/recv": ("send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list",
                  "recv_object_list"),
    "reduce": ("reduce",),
    "gather": ("gather", "gather_object"),
    "scatter": ("scatter", "scatter_object_list"),
    "synchronize": ("synchronize",),
    "wait": ("wait",),
}
_KIND_OF = {name: kind for kind, names in COLLECTIVE_KINDS.items() for name in names}
# Files where those names mean a collective. A frame with no file (a digest, a built-in) counts only
# for names that cannot mean anything else.
_COMM_FILES = re.compile(r"torch/distributed/|deepspeed/comm/|c10d|nccl|torch/cuda/(__init__|streams)\.py|"
                         r"deepspeed/runtime/pipe/p2p\.py|_functional_collectives")
_UNAMBIGUOUS = {"all_reduce", "allreduce", "broadcast", "all_gather", "all_gather_into_tensor",
                "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "barrier", "send", "recv",
                "all_gather_coalesced", "_all_gather_base", "_reduce_scatter_base", "isend", "irecv"}
_BUILTIN = re.compile(r"built-in method (\w+)")


def _name(frame: Frame) -> str:
    match = _BUILTIN.search(frame.function)
    return match.group(1) if match else frame.function.rsplit(".", 1)[-1]


def collective_kind(frame: Frame) -> str | None:
    name = _name(frame)
    kind = _KIND_OF.get(name)
    if kind is None:
        return None
    if _COMM_FILES.search(frame.file) or (not frame.file and (name in _UNAMBIGUOUS or _BUILTIN.search(frame.function))):
        return kind
    return None


@dataclass(frozen=True)
class Rule:
    activity: str
    functions: re.Pattern[str] | None  # searched in the frame's full name ("FakeLoader.__next__")
    files: re.Pattern[str] | None  # matched against the file path; None: any file
    why: str


def _re(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


# First rule any frame of the main thread matches decides the activity (collectives are checked first,
# separately, by collective_kind).
ACTIVITY_RULES: tuple[Rule, ...] = (
    Rule(CHECKPOINT_IO, _re(r"(^|\.)(save|_save|save_file|save_checkpoint|_save_checkpoint|save_pretrained|"
                            r"save_state|save_model|_save_zero_checkpoint|save_16bit_model|write_data)$"),
         _re(r"torch/serialization\.py|safetensors|deepspeed/|torch/distributed/checkpoint|megatron/.*checkpoint|"
             r"transformers/|accelerate/|lightning|checkpoint"), "torch.save, safetensors, DeepSpeed/FSDP/HF save"),
    Rule(CHECKPOINT_IO, None, _re(r"torch/distributed/checkpoint/"), "torch.distributed.checkpoint"),
    Rule(DATA_LOADING, None, _re(r"torch/utils/data/|dataloader|datasets/|webdataset|streaming/"),
         "a DataLoader or dataset"),
    Rule(DATA_LOADING, _re(r"(^|\.)(_next_batch|get_batch|get_batch_pipe|_exec_load_micro_batch|__next__)$"),
         _re(r"deepspeed/runtime/(pipe|dataloader)|megatron"), "fetching the next batch"),
    Rule(DATA_LOADING, _re(r"(Loader|Dataset|DataIter|Prefetcher)\w*\.(__next__|__getitem__|__iter__)$"), None,
         "a data loader's next batch"),
    Rule(GENERATION, None, _re(r"vllm/|sglang/|transformers/generation/"), "vLLM, SGLang or HF generate"),
    Rule(EVALUATION, _re(r"(^|\.)(evaluate|eval_batch|evaluation_loop|prediction_step|validate|validation_step|"
                         r"evaluate_and_print_results|_evaluate|eval_step)$"), None, "an evaluation loop"),
    Rule(COMPILE, None, _re(r"torch/_dynamo/|torch/_inductor/|triton/"), "torch.compile"),
    Rule(BACKWARD, _re(r"(^|\.)(backward|_engine_run_backward|run_backward)$"),
         _re(r"torch/|autograd|deepspeed/|accelerate/"), "autograd backward"),
    Rule(FORWARD, _re(r"(^|\.)(forward|_call_impl|_wrapped_call_impl)$"), None, "a module's forward"),
    Rule(IDLE_WAIT, _re(r"(^|\.)(get|wait|acquire|select|poll|recv|recv_bytes|_recv|_poll|sleep|join|"
                        r"_wait_for_tstate_lock|dequeue|acquire_read|wait_for|accept|read)$"),
         _re(r"queue\.py|threading\.py|selectors\.py|multiprocessing/|socket\.py|asyncio/|shm_broadcast|"
             r"concurrent/|subprocess\.py|^$"), "a queue, lock or socket"),
)


@dataclass(frozen=True)
class Activity:
    name: str
    collective: str | None = None  # the collective's kind when name is COLLECTIVE
    anchor: int | None = None  # index of the frame that decided it
    why: str = ""

    @property
    def key(self) -> str:
        return f"{self.name}:{self.collective}" if self.collective else self.name

    @property
    def text(self) -> str:
        return self.collective if self.collective else self.name.replace("_", " ")


def classify(thread: ThreadStack | None) -> Activity:
    if thread is None or not thread.frames:
        return Activity(UNKNOWN)
    for position, frame in enumerate(thread.frames):
        kind = collective_kind(frame)
        if kind is not None:
            return Activity(COLLECTIVE, kind, position, "torch.distributed / NCCL")
    for rule in ACTIVITY_RULES:
        # The outermost matching frame: "DataLoader.__next__", not the queue it ends in.
        for position in range(len(thread.frames) - 1, -1, -1):
            frame = thread.frames[position]
            if (rule.functions is None or rule.functions.search(frame.function)) and (
                    rule.files is None or rule.files.search(frame.file)):
                return Activity(rule.activity, None, position, rule.why)
    return Activity(UNKNOWN)


_PREFIX = re.compile(r"^.*?/(site-packages|dist-packages|lib/python\d\.\d+)/")


def normalized(thread: ThreadStack | None) -> tuple[tuple[str, str], ...]:
    """What two ranks must share to be in one group: functions and files, not lines or install paths."""
    if thread is None:
        return ()
    return tuple((_name(f), _PREFIX.sub("", f.file)) for f in thread.frames)


def where_text(thread: ThreadStack | None, activity: Activity) -> str:
    """'DataLoader.__next__ -> queue.get', 'broadcast (megatron/mpu/data.py:50)'."""
    if thread is None or not thread.frames:
        return activity.text
    frames = thread.frames
    if activity.anchor is None:  # unknown: say where it is
        return _at(frames[0])
    if activity.name == COLLECTIVE:
        # The call site: the first frame outside the communication library.
        for frame in frames[activity.anchor + 1:]:
            if not _COMM_FILES.search(frame.file) and collective_kind(frame) is None:
                return f"{activity.collective} ({_PREFIX.sub('', frame.where)})"
        return activity.collective or COLLECTIVE
    anchor = frames[activity.anchor]
    inner = next((f for f in frames if not f.file.endswith("threading.py")), frames[0])
    if inner is anchor:
        return _at(anchor)
    return f"{anchor.short} -> {inner.short}"


def _at(frame: Frame) -> str:
    where = _PREFIX.sub("", frame.where)
    return f"{frame.short} ({where})" if where else frame.short
