"""Flight Recorder dumps from real gloo ranks (PyTorch 2.13 records gloo collectives), asked for through
the dump pipe, read back safely and matched: the rank that never reached the collective is named, and
PyTorch's own analyzer agrees where it can run."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, gloo_job
from watchdog.sample.ranks import RankDiscovery
from watchdog.stacks import fr_dumps
from watchdog.stacks.flight_recorder import collect, trigger
from watchdog.stacks.fr_dumps import FlightRecorderError
from watchdog.stacks.fr_matching import analyze, analyze_with_torch


def until_blocked(processes: list[subprocess.Popen[str]], limit: float = 30) -> None:
    """Until no rank has used CPU for half a second: each is blocked in its stall (a loaded machine takes
    longer than gloo_job's pause from "ready" to get there, and a dump taken before shows the rank elsewhere)."""
    watched = [psutil.Process(p.pid) for p in processes]
    deadline, last = time.monotonic() + limit, -1.0
    while time.monotonic() < deadline:
        used = sum(sum(w.cpu_times()[:2]) for w in watched)
        if used == last:
            return
        last = used
        time.sleep(0.5)


def dumps_of(scenario: str, tmp: Path, odd_rank: int = 2) -> list[fr_dumps.RankTrace]:
    with gloo_job(scenario, tmp, odd_rank=odd_rank, flight_recorder=True) as processes:
        until_blocked(processes)
        discovery = RankDiscovery()
        ranks = [r for r in (discovery.describe(p.pid) for p in processes) if r is not None]
        asked_at = time.time()
        asked = [trigger(r) for r in ranks]
        assert [a.result for a in asked] == ["triggered"] * 4, [a.message for a in asked]
        # Returns once all four are written: the limit is for a loaded machine, where the ranks' dump threads
        # (four torch processes beside the suite's other workers) took more than 20 s to write them.
        traces, problems = collect(asked, asked_at, timeout_seconds=90)
    assert not problems and len(traces) == 4
    return traces


def test_the_rank_stuck_in_its_data_loader_never_reached_the_all_reduce(tmp_path: Path) -> None:
    traces = dumps_of("dataloader", tmp_path)
    assert {t.version for t in traces} == {"2.10"}
    found = analyze(traces)
    (group,) = found.groups
    assert group.stuck and group.waiting == (0, 1, 3) and group.op == "gloo:all_reduce"
    assert dict(group.behind) == {2: (group.seq - 1, "gloo:all_reduce")}
    assert found.culprits == (2,)
    assert found.summary == (f"Flight Recorder: process group default_pg (ranks 0, 1, 2, 3): ranks 0, 1, 3 wait in "
                             f"all_reduce #{group.seq}; rank 2 never reached it (its last is all_reduce "
                             f"#{group.seq - 1})")
    pytorch = analyze_with_torch(traces)
    assert pytorch is not None, "PyTorch's analyzer is importable here and must run on these dumps"
    folder = tmp_path / "dumps"  # the dumps as a user keeps them: `analyze` recognises the folder
    folder.mkdir()
    for dump in tmp_path.glob("fr_dump_*"):
        dump.rename(folder / dump.name)
    done = subprocess.run([sys.executable, "-m", "watchdog", "analyze", str(folder), "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    picture = json.loads(done.stdout)
    assert picture["outliers"] == ["rank 2"] and picture["verdict"]["kind"] == "hang"
    assert picture["flight_recorder_analysis"]["culprits"] == [2]
    assert [(c["collective"], c["seq"], c["missing_ranks"]) for c in pytorch] == [("gloo:all_reduce", group.seq, [2])]


def test_the_rank_in_another_collective_is_named(tmp_path: Path) -> None:
    traces = dumps_of("collective", tmp_path, odd_rank=1)
    found = analyze(traces)
    (group,) = found.groups
    assert group.stuck and dict(group.other_op) == {1: "gloo:broadcast"} and found.culprits == (1,)
    assert "rank 1 is in broadcast" in group.sentence()
    pytorch = analyze_with_torch(traces)
    assert pytorch is not None
    (mismatch,) = pytorch
    assert mismatch["seq"] == group.seq and mismatch["mismatch"] == {"1": "gloo:broadcast"}


def test_a_hostile_pickle_is_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Boom:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, (f"touch {marker}",))

    dump = tmp_path / "nccl_trace_rank_0"
    dump.write_bytes(pickle.dumps({"entries": [], "boom": Boom()}))
    with pytest.raises(FlightRecorderError, match="refused to load"):
        fr_dumps.read(dump)
    assert not marker.exists()


@pytest.mark.parametrize("content,why", [(b"\x80\x04K\x01.", "no `entries` list"),
                                         (b"{\"entries\": 3}", "no `entries`"),
                                         (b"hello", "not a Flight Recorder dump")])
def test_not_a_dump_is_a_clear_error(tmp_path: Path, content: bytes, why: str) -> None:
    path = tmp_path / "trace_3"
    path.write_bytes(content)
    with pytest.raises(FlightRecorderError, match=why):
        fr_dumps.read(path)


def test_json_dumps_and_rank_from_the_name() -> None:
    import json

    entry = {"pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": 1,
             "profiling_name": "nccl:all_reduce", "state": "completed", "is_p2p": False}
    trace = fr_dumps.parse(json.dumps({"version": "2.10", "entries": [entry], "pg_config": {}}).encode(),
                           source="/tmp/dumps/nccl_trace_rank_12")
    assert trace.rank == 12 and len(trace.entries) == 1
    found = analyze([trace])
    assert not found.groups[0].stuck and "no process group is stuck" in found.summary


def _trace_json(rank: int, world: int, reached: bool) -> dict[str, object]:
    """A rank's trace as a node's /v1/dump answer carries it: the default group lists every rank of the job."""
    entry = {"record_id": 0, "pg_id": 0, "process_group": ["0", "default_pg"], "profiling_name": "nccl:all_reduce",
             "state": "completed", "retired": True, "is_p2p": False, "input_sizes": [[4096, 4096]],
             "input_dtypes": ["BFloat16"], "time_created_ns": 1}
    entries = [{**entry, "collective_seq_id": seq, "op_id": seq} for seq in range(1, 6)]
    if reached:
        entries.append({**entry, "collective_seq_id": 6, "state": "started", "retired": False})
    return {"rank": rank, "version": "2.10", "entries": entries, "status": {},
            "groups": {"0": list(range(world)), "1": [[0], 1]}}  # "1": an item that is no rank (unhashable)


def test_traces_read_for_matching_share_their_group_lists_and_match_alike() -> None:
    """The coordinator reads thousands of traces that each list the whole job's ranks: for_matching reads a
    list once and keeps it once, keeps only the fields matching reads, and matches as from_json does."""
    raws = [_trace_json(rank, 8, reached=rank != 5) for rank in range(7)]  # rank 7 sent no trace
    shared: fr_dumps.SharedGroups = {}
    matched = [fr_dumps.RankTrace.for_matching(raw, "node-a", shared) for raw in raws]
    full = [fr_dumps.RankTrace.from_json(raw, "node-a") for raw in raws]
    assert all(t.groups["0"] is matched[0].groups["0"] == tuple(range(8)) for t in matched)
    assert [t.groups for t in matched] == [t.groups for t in full]
    assert "input_sizes" not in matched[0].entries[0] and "input_sizes" in full[0].entries[0]
    found = analyze(matched)
    assert found.to_json() == analyze(full).to_json()
    (group,) = found.groups
    assert found.culprits == (5,) and group.missing == (7,) and group.waiting == (0, 1, 2, 3, 4, 6)
    longer = {"rank": 0, "entries": [], "groups": {"0": list(range(fr_dumps.MAX_NODES + 10))}}
    assert fr_dumps.RankTrace.for_matching(longer, "n", shared).groups == fr_dumps.RankTrace.from_json(longer).groups


NVRX = REPO / "tests" / "data" / "nvrx_fr_traces"


@pytest.mark.parametrize("case", sorted(p.name for p in NVRX.iterdir() if p.is_dir()))
def test_nvidias_fault_injected_dumps_name_both_faulty_ranks(case: str) -> None:
    """NVIDIA's own 16-rank dumps, two faults injected each (a GPU error, a rank holding the GIL): exactly the
    injected ranks are named. On gpu_error_1st the second faulty rank waits at the same collective as its peer:
    its work stopped completing 13 collectives before its peer's did."""
    folder = NVRX / case
    log = (folder / "fault_injection.log").read_text()
    injected = tuple(int(r) for r in log.split("Fault ranks: [", 1)[1].split("]", 1)[0].split(","))
    found = analyze(fr_dumps.read(p) for p in sorted(folder.glob("_dump_*")))
    assert found.culprits == injected, found.summary


def _as_sent(traces: list[fr_dumps.RankTrace]) -> list[fr_dumps.RankTrace]:
    """The traces as a node sends them (summarised, to_json) and the coordinator reads them (for_matching)."""
    shared: fr_dumps.SharedGroups = {}
    return [fr_dumps.RankTrace.for_matching(json.loads(json.dumps(t.summarised().to_json())), t.node, shared)
            for t in traces]


@pytest.mark.parametrize("case", sorted(p.name for p in NVRX.iterdir() if p.is_dir()))
def test_a_summarised_trace_matches_as_the_whole_ring(case: str) -> None:
    """NVIDIA's dumps: summarised on the node (per group, its newest collective and its oldest not completed),
    sent and read back, they give the coordinator the same findings as the whole ring, in fewer entries
    (bench/coordinator_scale.py measures a 2,000-entry ring's answer)."""
    traces = [fr_dumps.read(p) for p in sorted((NVRX / case).glob("_dump_*"))]
    sent = _as_sent(traces)
    assert analyze(sent).to_json() == analyze(traces).to_json()
    whole = sum(len(json.dumps(t.to_json())) for t in traces)
    summarised = sum(len(json.dumps(t.summarised().to_json())) for t in traces)
    assert sum(len(t.entries) for t in sent) < sum(len(t.entries) for t in traces) and summarised < whole


def test_random_rings_match_alike_summarised() -> None:
    """Rings made at random (three groups, ranks behind, in another collective, stopped completing early,
    entries repeated under one number): the findings of the summaries are those of the rings."""
    import random

    chance = random.Random(57)
    for _ in range(300):
        world = chance.choice((4, 8, 16))
        traces = []
        for rank in range(world):
            entries = []
            seqs = {"0": 0, "tp": 0, "dp": 0}
            for n in range(chance.randrange(0, 60)):
                group = chance.choice(tuple(seqs))
                seqs[group] += chance.choice((1, 1, 1, 0))
                state = chance.choice(("completed", "completed", "started", "scheduled"))
                entries.append({"record_id": n, "pg_id": group, "process_group": [group, f"{group}_pg"],
                                "collective_seq_id": seqs[group] or 1, "is_p2p": chance.random() < 0.05,
                                "profiling_name": chance.choice(("nccl:all_reduce", "nccl:broadcast")),
                                "state": state, "retired": state == "completed"})
            groups = {"0": tuple(range(world)), "tp": tuple(range(rank - rank % 4, rank - rank % 4 + 4)),
                      "dp": tuple(range(rank % 4, world, 4))}
            traces.append(fr_dumps.RankTrace(rank, "2.10", tuple(entries), groups, {}, "", "node"))
        traces = [t for t in traces if chance.random() < 0.9]  # some ranks sent nothing
        assert analyze(_as_sent(traces)).to_json() == analyze(traces).to_json()


@pytest.mark.parametrize("ranks", [(), (5,), (0, 1, 2, 3), (3, 11, 19, 27), (0, 2, 3, 7, 8, 9, 100),
                                   tuple(range(0, 100_000))])
def test_groups_travel_as_runs(ranks: tuple[int, ...]) -> None:
    trace = fr_dumps.RankTrace(0, "2.10", (), {"g": ranks}, {})
    sent = trace.to_json()
    assert fr_dumps.RankTrace.from_json(json.loads(json.dumps(sent))).groups == {"g": ranks}
    assert len(json.dumps(sent)) < 400


@pytest.mark.parametrize("runs", [[[0, 2**31, 1]], [[0, 10, 0]], [[5, 0, -1]], [[0, 10]], [["0", 10, 1]],
                                  [[-3, 2, 1]], [[0, 2**40, 1]] * 1000, "0-9"])
def test_hostile_runs_are_bounded_or_dropped(runs: object) -> None:
    """A node's runs read within the trace's budget: never expanded past it, nonsense dropped, no traceback."""
    trace = fr_dumps.RankTrace.from_json({"rank": 1, "entries": [], "groups": {"g": {"runs": runs}}})
    assert len(trace.groups.get("g", ())) <= fr_dumps.MAX_NODES
