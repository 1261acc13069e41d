"""The readers of what people paste beside stacks and timeouts (watchdog/pasted), on real items of the field corpus
(bench/evidence/field: public repository files, labelled before the readers were written) and on what a hostile
paste can make them do."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from watchdog.cli import main as cli
from watchdog.pasted import crash_log, kernel_log, smi_table

FIELD = Path(__file__).resolve().parents[2] / "bench" / "evidence" / "field" / "items"


def analyzed(path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert cli(["analyze", "--json", str(path)]) == 0
    [picture] = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    return picture


def test_a_table_of_two_gpus_at_100_percent_near_idle_power_is_a_suspected_spin(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Two RTX 4090s at 100% drawing 83 W and 76 W of 450 W, 19.8 GB held each: a spin, suspected from one look."""
    item = FIELD / "nvidia_smi" / "tf115-mpiexec-2x4090-hang-100pct.txt"
    [table] = smi_table.tables(item.read_text())
    assert [(g.index, g.util, g.power_w, g.cap_w, g.used_mib) for g in table] == [
        (0, 100, 83.0, 450.0, 19854), (1, 100, 76.0, 450.0, 19880)]
    verdict = analyzed(item, capsys)["verdict"]
    assert verdict["kind"] == "hang" and verdict["severity"] == "warning"  # type: ignore[index]
    assert "GPUs 0, 1 spin at 100% near idle power" in verdict["headline"]  # type: ignore[index]
    assert "One table is one look" in verdict["sentence"]  # type: ignore[index]


def test_one_gpu_holding_little_memory_is_not_called_a_hang(capsys: pytest.CaptureFixture[str]) -> None:
    """One A100 at 100% and 69 W holding 437 MiB: no job's memory, so no verdict either way."""
    verdict = analyzed(FIELD / "nvidia_smi" / "mle-a100-one-sm-spin-kernel-100pct.txt", capsys)["verdict"]
    assert verdict["kind"] == "unknown"  # type: ignore[index]


@pytest.mark.parametrize(("item", "what", "rank"), [
    ("alcf-thetagpu-megatron-ds-illegal-memory-access-tabbed.txt", "an illegal memory access", None),
    ("jz-nccl-unhandled-system-error-barrier.txt", "a NCCL error", None),
    ("vila-torchrun-out-of-dram-sigkill.txt", "SIGKILL (the host's out-of-memory killer, or a person)", "rank 0"),
])
def test_a_crash_is_said_as_one_with_its_rank_and_cause(item: str, what: str, rank: str | None,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = FIELD / "crash_log" / item
    [crash] = crash_log.crashes(path.read_text())
    assert (crash.what, crash.rank) == (what, rank)
    picture = analyzed(path, capsys)
    assert picture["verdict"]["kind"] == "crash" and picture["verdict"]["severity"] == "critical"  # type: ignore[index]
    assert picture["outliers"] == ([rank] if rank else [])


def test_an_xid_is_named_with_its_gpu_and_what_it_means(capsys: pytest.CaptureFixture[str]) -> None:
    """Xid 31 (an MMU fault) is the program's fault on the GPU, not the hardware's: a crash, as a warning."""
    path = FIELD / "crash_log" / "modal-a100-xid31-illegal-memory-access.txt"
    [event] = kernel_log.events(path.read_text())
    assert (event.bus, event.xid) == ("0000:00:06", 31)
    verdict = analyzed(path, capsys)["verdict"]
    assert verdict["kind"] == "crash" and verdict["severity"] == "warning"  # type: ignore[index]
    assert "GPU memory page fault" in verdict["sentence"]  # type: ignore[index]


def test_a_crash_after_a_timeout_is_the_timeout_s_consequence_not_a_crash() -> None:
    """A collective's timeout ends in an exception and a kill: with the timeout in the text, a generic exception
    or a SIGKILL is not read as a crash of its own; a cause of its own (out of memory) still is."""
    timeout = ("[rank1]:[E1101 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective operation timeout: "
               "WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600010 "
               "milliseconds before timing out.\n")
    after = "[rank1]: RuntimeError: NCCL communicator was aborted on rank 1.\n  exitcode  : -9 (pid: 5)\n"
    assert crash_log.crashes(timeout + after, generic=False) == []
    oom = "[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    [crash] = crash_log.crashes(timeout + oom + after, generic=False)
    assert (crash.what, crash.rank) == ("CUDA out of memory", "rank 3")


def test_hostile_pastes_cost_bounded_work() -> None:
    """Thirty MB of one table row, 400,000 Xid lines: the readers keep at most their bounds (1,000 tables, 10,000
    events), counted, not timed."""
    row = ("|   0  Tesla V100-PCIE...  On   | 00000000:3B:00.0 Off |                    0 |\n"
           "| N/A   48C    P0    47W / 250W |  30765MiB / 32510MiB |    100%   E. Process |\n")
    tables = smi_table.tables(row * 200_000)
    assert len(tables) == 1000 and all(len(t) == 1 for t in tables)
    events = kernel_log.events("NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.\n" * 400_000)
    assert len(events) == 10_000
    finding = kernel_log.judge(events)
    assert finding is not None and finding.named == ("GPU 0000:3b:00",) and len(finding.reason) < 1000
    # 10,000 events each of its own GPU and Xid: judged in one pass (each looked up among all: 3.6 CPU s before)
    distinct = kernel_log.events("".join(f"NVRM: Xid (PCI:0000:{n // 256:02x}:{n % 256:02x}): {13 + n % 900}, "
                                         "pid=1, name=x, y\n" for n in range(20_000)))
    started = time.process_time()
    judged_all = kernel_log.judge(distinct)
    assert judged_all is not None and len(judged_all.named) == 10_000 and time.process_time() - started < 1
    many = "".join(f"[rank{n}]: RuntimeError: CUDA error: an illegal memory access was encountered\n"
                   for n in range(5000))
    judged = crash_log.judge(crash_log.crashes(many))
    assert judged is not None and len(judged.named) == 16 and "and 4994 more" in judged.reason
    assert smi_table.tables(("|" + " " * 100_000 + "\n") * 300) == []  # cells of spaces: no table, no backtracking


def test_a_digest_keyed_by_ranks_keeps_the_ranks_it_names(capsys: pytest.CaptureFixture[str]) -> None:
    """`DP0,3,5,7:  broadcast (...)`, `DP2,4,6: all_gather_into_tensor (...)`, `DP1: init_forward_metadata (...)` with
    its outer frames below (and a reporter's `<- note`): eight ranks, and rank 1 is the one the others wait on."""
    picture = analyzed(FIELD / "pyspy_multi" / "sglang-pd-mtp-8dp-dp1-never-arrives.txt", capsys)
    assert picture["outliers"] == ["rank 1"]
    assert picture["verdict"]["kind"] == "hang" and picture["verdict"]["severity"] == "warning"  # type: ignore[index]
    members = sorted(m for g in picture["groups"] for m in g["members"])  # type: ignore[attr-defined]
    assert members == [f"rank {n}" for n in range(8)]
    assert "7 of 8 ranks wait in broadcast" in picture["verdict"]["sentence"]  # type: ignore[index]


def test_words_that_only_look_like_a_crash_or_trouble_are_not_one() -> None:
    """Found by a new user's trial: `WorkNCCL error docs` on a [rankN]: line was "rank 3 crashed: a NCCL error";
    `exitcode -9` in prose a SIGKILL; and harmless words in a healthy Trainer log (ddp_timeout=, a mean squared
    error, "exchange", a NCCL plugin warning) took its NO_STALL away."""
    from watchdog.stacks import progress_log

    assert crash_log.crashes("[rank3]: see WorkNCCL error docs\n") == []
    assert crash_log.crashes("rank Watchdog exitcode -9 loss NCCL\n") == []
    assert [c.what for c in crash_log.crashes("RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:825, unhandled\n")] \
        == ["a NCCL error"]
    for harmless in ("ddp_timeout=1800,", "'eval_mean_squared_error': 0.31", "Dataset exchange rates loaded",
                     "NCCL WARN NET/Plugin: Failed to find ncclNetPlugin_v8 symbol."):
        assert progress_log.trouble(harmless) is None, harmless
    for trouble in ("the job hangs at step 30", "RuntimeError: x", "Watchdog caught collective operation timeout"):
        assert progress_log.trouble(trouble) is not None, trouble


def test_a_gpu_that_reads_err_is_named() -> None:
    table = ("|   1  NVIDIA A100-SXM4-80GB          On  | 00000000:10:1D.0 Off |                    0 |\n"
             "| N/A   29C    P0            ERR! / 400W |  77001MiB / 81920MiB |     ERR!     Default |\n")
    [[gpu]] = smi_table.tables(table)
    assert gpu.unreadable and gpu.util is None and gpu.power_w is None
    finding = smi_table.judge([[gpu]])
    assert finding is not None and finding.named == ("GPU 1 (00000000:10:1D.0)",) and "ERR!" in finding.headline
