"""The odd one out: activity rules, grouping, outliers and verdicts, on real and hand-made pictures."""

from __future__ import annotations

import pytest

from tests.conftest import realdata
from watchdog.sample.proc_counters import HostActivity
from watchdog.stacks.analysis import analyze
from watchdog.stacks.classify import (
    BACKWARD,
    CHECKPOINT_IO,
    COLLECTIVE,
    DATA_LOADING,
    EVALUATION,
    GENERATION,
    IDLE_WAIT,
    UNKNOWN,
    classify,
)
from watchdog.stacks.formats import load
from watchdog.stacks.fr_matching import FlightRecorderAnalysis, GroupFinding
from watchdog.stacks.picture import corroborated, corroborations
from watchdog.stacks.verdict import verdict
from watchdog.vocabulary.model import Severity
from watchdog.vocabulary.stack_model import Frame, StackDump, ThreadStack


def stack(*frames: tuple[str, str]) -> ThreadStack:
    return ThreadStack(1, "MainThread", "idle", tuple(Frame(f, file, 1) for f, file in frames))


TD = "torch/distributed/distributed_c10d.py"


@pytest.mark.parametrize(("frames", "activity", "collective"), [
    ([("all_reduce", TD), ("train_step", "train.py")], COLLECTIVE, "all_reduce"),
    ([("broadcast", TD), ("evaluate", "train.py")], COLLECTIVE, "broadcast"),  # a collective inside eval
    ([("all_gather_into_tensor", TD)], COLLECTIVE, "all_gather"),
    ([("_reduce_scatter_base", TD)], COLLECTIVE, "reduce_scatter"),
    ([("barrier", TD)], COLLECTIVE, "barrier"),
    ([("recv", TD), ("recv", "deepspeed/runtime/pipe/p2p.py")], COLLECTIVE, "send/recv"),
    ([("synchronize", "torch/cuda/__init__.py"), ("fetch_sub_module", "deepspeed/zero.py")], COLLECTIVE,
     "synchronize"),
    ([("<built-in method allreduce of PyCapsule object at remote 0x7f>", "")], COLLECTIVE, "all_reduce"),
    ([("write", "train.py"), ("_save", "torch/serialization.py"), ("save", "torch/serialization.py")],
     CHECKPOINT_IO, None),
    ([("save_file", "safetensors/torch.py")], CHECKPOINT_IO, None),
    ([("Condition.wait", "threading.py"), ("Queue.get", "queue.py"),
      ("_MultiProcessingDataLoaderIter.__next__", "torch/utils/data/dataloader.py")], DATA_LOADING, None),
    ([("Queue.get", "queue.py"), ("BatchLoader.__next__", "train.py")], DATA_LOADING, None),
    ([("generate", "vllm/entrypoints/llm.py")], GENERATION, None),
    ([("eval_batch", "deepspeed/runtime/pipe/engine.py")], EVALUATION, None),
    ([("backward", "torch/autograd/__init__.py")], BACKWARD, None),
    ([("Queue.get", "queue.py"), ("run", "worker.py")], IDLE_WAIT, None),
    ([("wait", "")], IDLE_WAIT, None),  # a digest's bare "wait" is not a collective
    ([("send", "mail.py")], UNKNOWN, None),  # a function called send outside torch.distributed
])
def test_activity_rules(frames: list[tuple[str, str]], activity: str, collective: str | None) -> None:
    result = classify(stack(*frames))
    assert (result.name, result.collective) == (activity, collective)


def dumps(*groups: tuple[int, list[tuple[str, str]]]) -> list[StackDump]:
    out, rank = [], 0
    for count, frames in groups:
        for _ in range(count):
            out.append(StackDump(f"rank {rank}", (stack(*frames),), pid=100 + rank, rank=rank, gpus=(rank,)))
            rank += 1
    return out


WAIT = [("all_reduce", TD), ("train_step", "train.py")]
LOADER = [("Condition.wait", "threading.py"), ("Queue.get", "queue.py"), ("Loader.__next__", "train.py")]
SAVE = [("write", "x.py"), ("save", "torch/serialization.py"), ("checkpoint", "train.py")]


def test_the_rank_outside_the_collective_is_the_outlier() -> None:
    picture = dumps((3, WAIT), (1, LOADER))
    a = analyze(picture, idle_seconds={"rank 3": 312})
    assert a.outliers == ("rank 3",)
    assert a.summary == ("3 of 4 ranks wait in all_reduce (train.py:1); rank 3 (pid 103, GPU 3) is in "
                         "Loader.__next__ -> Queue.get, idle for 312 s")
    assert verdict(a).severity is Severity.WARNING  # one look: a suspicion until a second look agrees


def test_one_look_is_never_a_critical_verdict() -> None:
    """A healthy job spends much of every step inside a collective: one look that finds every rank in
    all_reduce is what a fast healthy job looks like, so it is a suspected hang (a warning), never critical;
    a live look whose ranks moved I/O meanwhile is no hang at all."""
    a = analyze(dumps((2, WAIT)))
    one = verdict(a)
    assert (one.kind, one.severity, one.title) == ("hang", Severity.WARNING, "suspected hang")
    moving = {f"rank {r}": HostActivity(0.9, 60 * 2**20, 60 * 2**20) for r in range(2)}
    live = verdict(a, moving, observed_seconds=1.0)
    assert (live.kind, live.severity) == ("no_stall", None), live.sentence
    assert "moved 120.0 MiB of I/O in 1.0 s" in live.sentence
    still = {f"rank {r}": HostActivity(0.9, 0, 0) for r in range(2)}  # spinning: CPU, no I/O
    assert verdict(a, still, observed_seconds=1.0).severity is Severity.WARNING


def test_a_checkpoint_writer_making_progress_is_a_wait() -> None:
    a = analyze(dumps((1, SAVE), (3, WAIT)))
    assert a.outliers == ("rank 0",)
    progress = {"rank 0": HostActivity(0.1, 0, 8 * 2**20)}
    v = verdict(a, progress, observed_seconds=1.0)
    assert (v.kind, v.severity) == ("waiting", Severity.WARNING) and "wrote 8.0 MiB in 1.0 s" in v.sentence
    stalled = {"rank 0": HostActivity(0.0, 0, 0)}
    assert verdict(a, stalled).kind == "hang"


def test_all_ranks_in_one_collective_is_a_hang_or_a_remote_wait() -> None:
    a = analyze(dumps((4, WAIT)))
    assert a.outliers == ()
    assert verdict(a).kind == "hang"
    assert verdict(a, spans_other_nodes=True).kind == "remote"


def test_a_different_collective_is_named() -> None:
    a = analyze(dumps((3, WAIT), (1, [("broadcast", TD), ("eval", "train.py")])))
    assert a.outliers == ("rank 3",)
    assert "another collective" in verdict(a).sentence


def test_no_clear_majority_names_nobody() -> None:
    a = analyze(dumps((2, WAIT), (2, [("recv", TD), ("stage", "pipe.py")])))
    assert a.outliers == () and "split with no clear odd one out" in a.summary


def test_saved_stacks_never_say_healthy_but_live_progress_does() -> None:
    a = analyze(dumps((4, [("forward", "torch/nn/modules/module.py"), ("train", "train.py")])))
    assert a.outliers == () and verdict(a).kind == "unknown" and "cannot tell" in verdict(a).headline
    working = {f"rank {r}": HostActivity(0.9, 0, 0) for r in range(4)}
    assert verdict(a, working, observed_seconds=1.0).kind == "waiting"  # measured busy: a wait, never unknown
    one = analyze(dumps((1, LOADER)))
    assert verdict(one).kind == "unknown" and "One process's stack shows where it was" in verdict(one).sentence


@pytest.mark.parametrize("outside", [LOADER, [("select", "selectors.py"), ("run_forever", "asyncio/base_events.py")],
                                     SAVE])
def test_a_rank_outside_the_collective_is_named_whatever_the_count(outside: list[tuple[str, str]]) -> None:
    """A rank in a collective waits on the ranks outside it: 1 against 1, 1 against 2, 2 against 1."""
    for inside, out in ((1, 1), (1, 2), (2, 1)):
        a = analyze(dumps((inside, WAIT), (out, outside)))
        assert a.outliers == tuple(f"rank {r}" for r in range(inside, inside + out)), (inside, out)
        # a checkpoint writer in saved stacks may still be writing: a wait, never an all-clear
        assert verdict(a).kind == ("waiting" if outside is SAVE else "hang")


def test_one_stack_in_a_collective_says_its_peers_are_missing() -> None:
    v = verdict(analyze(dumps((1, WAIT))))
    assert v.kind == "hang" and "peers' stacks are not here" in v.headline and "Every rank" not in v.sentence


# -- the real multi-rank pictures from the BLOOM-176B training logs -------------------------------
HANG = "hang_stacks"


def test_bloom_node48_names_the_rank_in_the_dataloader() -> None:
    a = analyze(load(realdata(HANG, "bigscience-tr11-176B-chronicles-2022-04-30-node48.txt")))
    assert a.outliers == ("pid 688514",)
    assert a.member_activity["pid 688514"].name == DATA_LOADING
    assert a.summary.startswith("7 of 8 processes wait in broadcast")
    assert "pid 688514 is in dataloader.__next__ -> queue.get, idle" in a.summary
    assert verdict(a).kind == "hang"


def test_bloom_384_gpu_digest_and_the_deadlocked_rank() -> None:
    digest = load(realdata(HANG, "bigscience-tr11-176B-chronicles-2022-05-18-all-nodes-summary.txt"))
    a = analyze(digest)
    assert a.outliers == ("trace-jean-zay-iam52#8",)  # the one rank at `wait` among 40 in collectives
    culprit = load(realdata(HANG, "bigscience-tr11-176B-chronicles-2022-05-18-deadlocked-rank.txt"))
    b = analyze(digest + culprit)
    assert "pid 1439102" in b.outliers and b.member_activity["pid 1439102"].name == DATA_LOADING


def test_bloom_hang_debug_names_the_two_still_in_broadcast() -> None:
    a = analyze(load(realdata(HANG, "bigscience-tr11-176B-hang-debug-nodes0-1.txt")))
    assert a.outliers == ("pid 835995",)
    assert "pid 835995 x2 is in broadcast" in a.summary


def test_bloom_node49_pipeline_stages_are_not_blamed() -> None:
    a = analyze(load(realdata(HANG, "bigscience-tr11-176B-chronicles-2022-04-30-node49.txt")))
    assert a.outliers == ()
    assert {g.activity.collective for g in a.groups} == {"all_reduce", "send/recv"}


@pytest.mark.parametrize(("name", "activity"), [
    ("ami-data-companion-140-1.json", DATA_LOADING),
    ("DeepSpeed-1969-1.json", COLLECTIVE),
    ("DeepSpeed-851-1.json", COLLECTIVE),
    ("LlamaFactory-7767-1.json", COLLECTIVE),
    ("accelerate-3104-1.json", BACKWARD),
    ("vllm-50835-1.json", GENERATION),
])
def test_real_single_dumps_are_classified(name: str, activity: str) -> None:
    (dump,) = load(realdata(HANG, name))
    assert classify(dump.main_thread).name == activity


def test_one_process_reads_in_the_singular_and_saved_stacks_claim_no_stillness() -> None:
    from watchdog.stacks.pyspy_text import parse_text
    from watchdog.stacks.verdict import verdict

    one = parse_text('Process 7: python train.py\nThread 7 (idle): "MainThread"\n    get (queue.py:171)\n'
                     '    train (train.py:9)\n')
    assert "the process is in" in analyze(one).summary
    four = parse_text("".join(f'Process {p}: python train.py\nThread {p} (active): "MainThread"\n'
                              "    all_reduce (torch/distributed/distributed_c10d.py:2050)\n    step (train.py:9)\n"
                              for p in (1, 2, 3)) +
                      'Process 4: python train.py\nThread 4 (idle): "MainThread"\n    get (queue.py:171)\n'
                      "    next (dataloader.py:630)\n")
    decided = verdict(analyze(four))
    assert "3 of 4 processes wait in" in decided.sentence and "not measured (saved stacks)" in decided.sentence
    assert "is moving" not in decided.sentence


def test_a_remote_culprit_named_by_the_flight_recorder_heads_the_verdict() -> None:
    """Every local rank waits in one collective (the culprit is elsewhere); the Flight Recorder names rank 5:
    the headline says so from its fields, and the finding joins the sentence in full."""
    remote = verdict(analyze(dumps((4, WAIT))), spans_other_nodes=True)
    assert remote.kind == "remote"
    behind = {5: (11, "nccl:all_reduce")}
    fr = FlightRecorderAnalysis((GroupFinding("0", 12, "nccl:all_reduce", (0, 1, 2, 3), (), behind, {}, ()),),
                                (0, 1, 2, 3))
    assert fr.culprits == (5,)
    decided = corroborated(remote, corroborations(fr))
    assert decided.headline == "the job waits on rank 5 (Flight Recorder)"
    assert decided.sentence.endswith(fr.summary)
    assert corroborated(remote, []) == remote
