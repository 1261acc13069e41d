"""Where is every rank, and who is the odd one out.

Each rank's main-thread stack is classified into an activity by the rules in ACTIVITY_RULES (first
rule that any frame matches wins, so a collective inside an evaluation is a collective). Identical
stacks (line numbers and install prefixes aside) are grouped; the outliers are the ranks the others
wait on: the ones outside any collective while most ranks sit in one, the few still in a collective
while most have moved on, or those in a different collective than a clear majority. The result is one
sentence a person can act on, and a verdict: hang (critical), waiting (warning), or not a stall.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from watchdog.model import Frame, Severity, StackDump, ThreadStack
from watchdog.sample.ranks import HostActivity

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


# -- the picture ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Group:
    members: tuple[str, ...]
    count: int  # processes, counting the ones a dump stands for
    activity: Activity
    where: str
    state: str | None
    frames: tuple[Frame, ...]


@dataclass(frozen=True)
class Analysis:
    groups: tuple[Group, ...]
    outliers: tuple[str, ...]
    summary: str
    total: int
    member_activity: Mapping[str, Activity] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {
            "groups": [{
                "members": list(g.members), "count": g.count, "activity": g.activity.name,
                "collective": g.activity.collective, "where": g.where, "state": g.state,
                "frames": [{"function": f.function, "file": f.file, "line": f.line} for f in g.frames],
            } for g in self.groups],
            "outliers": list(self.outliers),
            "summary": self.summary,
        }


def _plural(count: int, total: int, noun: str) -> str:
    return f"{count} of {total} {_nouns(noun)}" if total > 1 else f"the {noun}"


def _nouns(noun: str) -> str:
    return noun + ("es" if noun.endswith("s") else "s")


def analyze(dumps: Sequence[StackDump], idle_seconds: Mapping[str, float] | None = None) -> Analysis:
    """Group the ranks' main-thread stacks and name the outliers."""
    by_key: dict[tuple[tuple[str, str], ...], list[StackDump]] = {}
    for dump in dumps:
        by_key.setdefault(normalized(dump.main_thread), []).append(dump)
    groups = []
    activity_of: dict[str, Activity] = {}
    for members in by_key.values():
        thread = members[0].main_thread
        activity = classify(thread)
        for m in members:
            activity_of[m.member] = activity
        groups.append(Group(tuple(m.member for m in members), sum(m.count for m in members), activity,
                            where_text(thread, activity), thread.state if thread else None,
                            thread.frames if thread else ()))
    groups.sort(key=lambda g: -g.count)
    total = sum(g.count for g in groups)
    weight = {d.member: d.count for d in dumps}
    outliers = _outliers(groups, total)
    noun = "rank" if any(d.rank is not None for d in dumps) else "process"
    return Analysis(tuple(groups), outliers, _sentence(groups, outliers, total, noun, activity_of, weight,
                                                       idle_seconds or {}, dumps), total, activity_of)


def _outliers(groups: Sequence[Group], total: int) -> tuple[str, ...]:
    in_collective = [g for g in groups if g.activity.name == COLLECTIVE]
    outside = [g for g in groups if g.activity.name != COLLECTIVE]
    n_in = sum(g.count for g in in_collective)
    n_out = total - n_in
    if in_collective and outside:
        # The side that is smaller is the one the others wait on: the few outside any collective, or
        # the few still in one after the rest moved on.
        odd = outside if n_out < n_in else in_collective if n_in < n_out else []
        return tuple(m for g in odd for m in g.members)
    by_kind: Counter[str] = Counter()
    for g in groups:
        by_kind[g.activity.key] += g.count
    if len(by_kind) < 2:
        return ()
    (top, top_count), = by_kind.most_common(1)
    if top_count * 2 <= total:
        return ()  # no clear majority: e.g. pipeline stages legitimately in different collectives
    return tuple(m for g in groups if g.activity.key != top for m in g.members)


def _sentence(groups: Sequence[Group], outliers: Sequence[str], total: int, noun: str,
              activity_of: Mapping[str, Activity], weight: Mapping[str, int], idle: Mapping[str, float],
              dumps: Sequence[StackDump]) -> str:
    if not groups:
        return "no stacks"
    odd = set(outliers)
    main = [g for g in groups if not odd & set(g.members)]
    label = {d.member: _member_label(d) for d in dumps}
    parts = []
    if main:
        count = sum(g.count for g in main)
        lead = main[0]
        verb = "wait in" if lead.activity.name == COLLECTIVE else "are in"
        sites = {g.where for g in main}
        more = f" and {len(sites) - 1} other call site{'s' if len(sites) > 2 else ''}" if len(sites) > 1 else ""
        parts.append(f"{_plural(count, total, noun)} {verb} {lead.where}{more}")
    for g in groups:
        for member in g.members:
            if member not in odd:
                continue
            state = f", {g.state}" if g.state else ""
            if member in idle:
                state += f" for {idle[member]:.0f} s"
            parts.append(f"{label[member]}{' x' + str(weight[member]) if weight[member] > 1 else ''} "
                         f"is in {g.where}{state}")
    if not odd and len(main) > 1 and main[0].activity.key != main[1].activity.key:
        split = ", ".join(f"{g.count} in {g.where}" for g in main[:4])
        return f"{total} {_nouns(noun)} split with no clear odd one out: {split}"
    return "; ".join(parts)


def _member_label(dump: StackDump) -> str:
    bits = []
    if dump.rank is not None and dump.pid is not None:
        bits.append(f"pid {dump.pid}")
    if dump.gpus:
        bits.append(f"GPU {', '.join(map(str, dump.gpus))}")
    return f"{dump.member} ({', '.join(bits)})" if bits else dump.member


# -- verdict -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    kind: str  # "hang" | "waiting" | "remote" | "no_stall"
    severity: Severity | None
    sentence: str

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind, "severity": self.severity.value if self.severity else None,
                "sentence": self.sentence}


_PROGRESS_BYTES = 64 * 1024  # written during the observation: a checkpoint writer makes progress
_PROGRESS_CPU = 0.2  # CPU seconds per second: real host work (compute on the host, decoding, copying)
_IDLE_ACTIVITIES = {DATA_LOADING, IDLE_WAIT, UNKNOWN}


def verdict(analysis: Analysis, host: Mapping[str, HostActivity] | None = None, observed_seconds: float = 1.0,
            spans_other_nodes: bool = False) -> Verdict:
    """Refine a stall with the stacks: a rank making host progress in a checkpoint or evaluation is a
    wait (warning); a rank idle in a queue or lock, or every rank in one collective, is a hang."""
    host = host or {}
    groups = analysis.groups
    odd = set(analysis.outliers)

    def progressing(member: str) -> bool:
        delta = host.get(member)
        if delta is None:
            return False
        return (delta.write_bytes or 0) >= _PROGRESS_BYTES or delta.cpu_seconds >= _PROGRESS_CPU * observed_seconds

    if odd:
        one = len(odd) == 1
        odd_activities = {analysis.member_activity[m].name for m in odd}
        busy = [m for m in odd if progressing(m)]
        if busy and len(busy) == len(odd) and not odd_activities & _IDLE_ACTIVITIES - {UNKNOWN}:
            written = sum(host[m].write_bytes or 0 for m in busy)
            cpu = sum(host[m].cpu_seconds for m in busy)
            evidence = f"wrote {written / 2**20:.1f} MiB" if written >= _PROGRESS_BYTES else f"used {cpu:.1f} CPU s"
            return Verdict("waiting", Severity.WARNING,
                           f"{analysis.summary}. The odd {'rank is' if one else 'ranks are'} busy on the host "
                           f"({evidence} in {observed_seconds:.1f} s): the others wait on {'it' if one else 'them'}")
        if odd_activities == {COLLECTIVE}:
            return Verdict("hang", Severity.CRITICAL,
                           f"{analysis.summary}. The odd {'rank is' if one else 'ranks are'} in another collective "
                           "than the rest: the two will never match")
        still = f" (no CPU or I/O progress in {observed_seconds:.1f} s)" if host else ""
        return Verdict("hang", Severity.CRITICAL,
                       f"{analysis.summary}. Nothing on the odd {'rank' if one else 'ranks'} is moving{still}: "
                       "the others will wait forever")
    collectives = [g for g in groups if g.activity.name == COLLECTIVE]
    if collectives and sum(g.count for g in collectives) == analysis.total:
        kinds = {g.activity.collective for g in collectives}
        if spans_other_nodes:
            return Verdict("remote", Severity.WARNING,
                           f"{analysis.summary}. Every local rank waits, and the job has ranks on other nodes: the "
                           "culprit is likely there; look at the other nodes' verdicts")
        if len(kinds) == 1:
            return Verdict("hang", Severity.CRITICAL,
                           f"{analysis.summary}. Every rank is in the same collective and none returns: a peer "
                           "never arrived (network, P2P or a rank stuck in C code; py-spy --native shows more)")
        return Verdict("hang", Severity.CRITICAL, f"{analysis.summary}. Every rank waits in a collective")
    return Verdict("no_stall", None, f"{analysis.summary}. The stacks show no rank waiting on another")

