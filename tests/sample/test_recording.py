from __future__ import annotations

import io
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from watchdog.sample import recording, sim
from watchdog.sample.errors import SkipLog, TraceError
from watchdog.sample.lines import MAX_GPUS
from watchdog.vocabulary.model import HEALTH_COUNTERS, GpuHealth, GpuSample, NodeSnapshot, SnapshotBlock, each_snapshot

HEAD = recording.header("test", "2026-01-01T00:00:00+00:00")


def roundtrip(snapshots: list[NodeSnapshot]) -> list[NodeSnapshot]:
    buf = io.StringIO()
    recording.write(buf, HEAD, snapshots)
    buf.seek(0)
    return list(recording.read(buf, "rec.jsonl"))


ratio = st.none() | st.floats(0, 1, allow_nan=False)
watts = st.none() | st.floats(0, 2000, allow_nan=False)
gpu_samples = st.builds(
    GpuSample,
    index=st.integers(0, 63),
    uuid=st.none() | st.text(max_size=20),
    name=st.none() | st.text(max_size=30),
    health=st.sampled_from(list(GpuHealth)),
    utilization_ratio=ratio, memory_utilization_ratio=ratio, power_watts=watts, power_limit_watts=watts,
    sm_clock_hertz=st.none() | st.floats(0, 3e9, allow_nan=False), sm_clock_max_hertz=watts,
    memory_used_bytes=st.none() | st.integers(0, 2**40), memory_total_bytes=st.none() | st.integers(0, 2**40),
    temperature_celsius=st.none() | st.floats(0, 150, allow_nan=False), energy_joules=watts,
    clock_event_reasons=st.none() | st.integers(0, 0x1FF), sm_activity_ratio=ratio,
    host_cpu_ratio=st.none() | st.floats(0, 64, allow_nan=False),
    host_io_bytes_per_second=st.none() | st.floats(0, 1e10, allow_nan=False),
    pids=st.lists(st.integers(1, 2**22), max_size=3).map(tuple),
    errors=st.lists(st.tuples(st.sampled_from(["power_watts", "nvml"]), st.text(max_size=10)),
                    max_size=2, unique_by=lambda e: e[0]).map(tuple),
    xids=st.lists(st.integers(1, 200), max_size=3).map(tuple),
    rank_waits=st.just(()) | st.lists(st.integers(0, 2**40), min_size=7, max_size=7).map(tuple),
    nccl_waits=st.just(()) | st.lists(st.integers(0, 2**40), min_size=7, max_size=7).map(tuple),
    **{name: st.none() | st.integers(0, 2**40) for name in HEALTH_COUNTERS},
)


times = st.floats(0, 2e9, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(times, st.lists(gpu_samples, min_size=1, max_size=8, unique_by=lambda g: g.index)),
                max_size=5))
def test_roundtrip_keeps_every_field(raw: list[tuple[float, list[GpuSample]]]) -> None:
    snapshots = [NodeSnapshot(t, tuple(gpus)) for t, gpus in sorted(raw, key=lambda r: r[0])]
    assert roundtrip(snapshots) == snapshots


def test_simulated_trace_roundtrips() -> None:
    snapshots = list(sim.run(sim.SCENARIOS["gpu_lost"]))[:400]
    assert roundtrip(snapshots) == snapshots


def _line(**columns: object) -> str:
    """A snapshot line of GPU 0 (unless `index` says otherwise) with these columns."""
    return json.dumps({"t": 2, "gpus": {"index": [0], **columns}})


@pytest.mark.parametrize(("line", "message"), [
    ("{nope", "rec.jsonl:3: not valid JSON"),
    ('{"t": "x", "gpus": {"index": [0]}}', "rec.jsonl:3: not a snapshot: expected a number, got text, at t"),
    ('{"t": NaN, "gpus": {"index": [0]}}', "rec.jsonl:3: not valid JSON (invalid character (byte 6))"),
    ('{"t": 1e400, "gpus": {"index": [0]}}', "Number out of range, at t"),
    ('{"t": 1e16, "gpus": {"index": [0]}}', "not a snapshot: expected a number < 1000000000000000.0, at t"),
    ('{"t": 2, "gpus": {"index": [0], "power_watts": [Infinity]}}', "not valid JSON"),
    ('{"t": 2, "gpus": {"index": [0], "power_watts": [-5]}}',
     "not a snapshot: expected a number >= 0.0, at gpus.power_watts[0]"),
    ('{"t": 2, "gpus": {"index": [0, 0]}}', "the same GPU index twice in one sample"),
    ('{"t": 2, "gpus": {"index": ' + "[" * 100_000 + "]" * 100_000 + '}}', "rec.jsonl:3: "),
    ('{"t": 2, "gpus": [{"index": 0}]}', "rec.jsonl:3: not a snapshot: expected an object, got a list, at gpus"),
    ('{"t": 2}', "rec.jsonl:3: Object missing required field `gpus`"),
    ('{"t": 2, "gpus": {"index": [0], "xids": [[-79]]}}',
     "not a snapshot: expected a whole number >= 0, at gpus.xids[0][0]"),
    ('{"t": 2, "gpus": {"index": [0], "xids": [[79.5]]}}',
     "not a snapshot: expected a whole number, got a number, at gpus.xids[0][0]"),
    ('{"t": 2, "gpus": {"index": [0], "rank_waits": [[7, 1, -5, 0, 0, 0, 0]]}}',
     "not a snapshot: expected a whole number >= 0, at gpus.rank_waits[0][2]"),
    ('{"t": 2, "gpus": {"index": [0], "rank_waits": [["7"]]}}', "got text, at gpus.rank_waits[0][0]"),
    ('{"t": 2, "gpus": {"index": [0], "nccl_waits": [[7, 1, 1.5, 0, 0, 0, 0]]}}',
     "not a snapshot: expected a whole number, got a number, at gpus.nccl_waits[0][2]"),
    ('{"t": 2, "gpus": {"index": [0], "ecc_uncorrected": [1e16]}}', "at gpus.ecc_uncorrected[0]"),
    ('{"t": 2, "gpus": {"index": [0], "pcie_link_gen": ["4"]}}', "got text, at gpus.pcie_link_gen[0]"),
    ('{"t": 2, "gpus": {"index": [0], "power_watts": ["150"]}}',
     "not a snapshot: expected a number or null, got text, at gpus.power_watts[0]"),
    ('{"t": 2, "gpus": {"index": [0], "power_watts": [true]}}', "got true or false, at gpus.power_watts[0]"),
    ('{"t": 2, "gpus": {"index": [0, 1], "power_watts": [1.0]}}',
     "'power_watts' must be a list with one entry per GPU (2)"),
    ('{"t": 2, "gpus": {"index": [0], "watts": [1.0]}}', "unknown GPU field `watts`"),
    ('{"t": 2, "gpus": {"index": [0], "health": ["dead"]}}', "Invalid enum value 'dead', at gpus.health[0]"),
    ('{"t": 2, "gpus": {"index": [0], "pids": [["1"]]}}',
     "not a snapshot: expected a whole number, got text, at gpus.pids[0][0]"),
    ('{"t": 2, "gpus": {"index": [0], "memory_used_bytes": [1.5]}}',
     "not a snapshot: expected a whole number or null, got a number, at gpus.memory_used_bytes[0]"),
    # what one record may hold, and readings no GPU gives (issue 40)
    (_line(index=list(range(MAX_GPUS + 1))), f"length <= {MAX_GPUS}, at gpus.index"),
    (_line(pids=[list(range(1, 2000))]), "length <= 256, at gpus.pids[0]"),
    (_line(pids=[[2**22 + 1]]), "at gpus.pids[0][0]"),
    (_line(xids=[[79] * 1000]), "length <= 256, at gpus.xids[0]"),
    (_line(nccl_waits=[[1] * 300]), "length <= 256, at gpus.nccl_waits[0]"),
    (_line(errors=[{f"f{n}": "e" for n in range(100)}]), "at gpus.errors[0]"),
    (_line(errors=[{"nvml": "e" * 2000}]), "at gpus.errors[0]"),
    (_line(uuid=["GPU-" + "0" * 1000]), "length <= 256, at gpus.uuid[0]"),
    (_line(utilization_ratio=[1e11]), "not a snapshot: expected a number <= 1.0, at gpus.utilization_ratio[0]"),
    (_line(memory_utilization_ratio=[1.5]), "at gpus.memory_utilization_ratio[0]"),
    (_line(sm_activity_ratio=[1.01]), "at gpus.sm_activity_ratio[0]"),
    (_line(power_watts=[20000]), "<= 10000.0, at gpus.power_watts[0]"),
    (_line(sm_clock_hertz=[2e10]), "at gpus.sm_clock_hertz[0]"),
    (_line(temperature_celsius=[540]), "at gpus.temperature_celsius[0]"),
    (_line(memory_used_bytes=[2**43]), "at gpus.memory_used_bytes[0]"),
    (_line(ecc_corrected=[2**41]), "at gpus.ecc_corrected[0]"),
    (_line(clock_event_reasons=[2**64]), "at gpus.clock_event_reasons[0]"),
    (_line(clock_event_reasons=[-8]), "at gpus.clock_event_reasons[0]"),
])
def test_malformed_line_names_the_line(line: str, message: str) -> None:
    text = "\n".join([recording.json.dumps(HEAD), '{"t": 1, "gpus": {"index": [0]}}', line]) + "\n"
    with pytest.raises(TraceError) as info:
        list(recording.read(io.StringIO(text), "rec.jsonl"))
    assert message in str(info.value)


def test_lenient_counts_what_it_skips() -> None:
    text = "\n".join([recording.json.dumps(HEAD), '{"t": 1, "gpus": {"index": [0]}}', "{nope",
                      '{"t": 3, "gpus": {"index": [0]}}']) + "\n"
    skips = SkipLog(lenient=True)
    got = list(recording.read(io.StringIO(text), "rec.jsonl", skips=skips))
    assert [s.time_seconds for s in got] == [1.0, 3.0]
    assert skips.count == 1 and skips.first[0].startswith("rec.jsonl:3:")


@pytest.mark.parametrize("first", ["", "{}", '{"stall_watchdog_recording": 99}', "timestamp, index"])
def test_header_is_required(first: str) -> None:
    with pytest.raises(TraceError, match="rec.jsonl:1:"):
        list(recording.read(io.StringIO(first + "\n"), "rec.jsonl"))


def _text(snapshots: list[NodeSnapshot]) -> str:
    buf = io.StringIO()
    recording.write(buf, HEAD, snapshots)
    return buf.getvalue()


def _cut(lines: int) -> list[int]:
    """The sizes of the blocks a run of `lines` like lines comes in."""
    full, rest = divmod(lines, recording._RUN_LINES)
    return [recording._RUN_LINES] * full + [rest] * bool(rest)


def test_lines_of_the_same_gpus_and_columns_come_as_column_blocks() -> None:
    snapshots = list(sim.run(sim.SCENARIOS["odd_rank"]))  # 1,501 snapshots
    # A GPU lost for a few lines: a column more ("health") and a GPU fewer each break the run.
    lost = [NodeSnapshot(s.time_seconds, (s.gpus[0]._replace(health=GpuHealth.LOST), *s.gpus[1:]))
            for s in snapshots[1100:1103]]
    fewer = [NodeSnapshot(s.time_seconds, s.gpus[1:]) for s in snapshots[1103:1110]]
    stream = [*snapshots[:1100], *lost, *fewer, *snapshots[1110:]]
    items = list(recording.stretches(io.StringIO(_text(stream)), "rec.jsonl"))
    assert list(each_snapshot(items)) == stream
    blocks = [item for item in items if isinstance(item, SnapshotBlock)]
    # At most _RUN_LINES a block; broken where the columns or the GPUs change.
    sizes = [len(item) if isinstance(item, SnapshotBlock) else 1 for item in items]
    assert sizes == [*_cut(1100), 3, 7, *_cut(391)]
    assert blocks[0].layout == tuple(g.index for g in stream[0].gpus)


def test_what_came_before_a_malformed_line_is_handed_on_before_its_error() -> None:
    snapshots = list(sim.run(sim.SCENARIOS["odd_rank"]))[:50]
    lines = _text(snapshots).splitlines()
    lines.insert(31, "{nope")  # the 30th snapshot's line is line 31
    read: list[NodeSnapshot] = []
    with pytest.raises(TraceError, match="rec.jsonl:32: not valid JSON"):
        for item in recording.stretches(io.StringIO("\n".join(lines) + "\n"), "rec.jsonl"):
            read.extend(each_snapshot([item]))
    assert read == snapshots[:30]
    skips = SkipLog(lenient=True)
    assert list(recording.read(io.StringIO("\n".join(lines) + "\n"), "rec.jsonl", skips)) == snapshots
    assert skips.count == 1


def test_a_block_holds_each_repeated_name_uuid_and_process_list_once() -> None:
    snapshots = list(sim.run(sim.SCENARIOS["odd_rank"]))[:recording._RUN_LINES]  # one block's worth
    # A rank restarts on GPU 2 halfway: its process list changes and stays changed.
    half = len(snapshots) // 2
    restarted = [NodeSnapshot(s.time_seconds, tuple(g._replace(pids=(9999,)) if g.index == 2 and n >= half else g
                                                    for g in s.gpus)) for n, s in enumerate(snapshots)]
    items = list(recording.stretches(io.StringIO(_text(restarted)), "rec.jsonl"))
    assert list(each_snapshot(items)) == restarted
    (block,) = items
    assert isinstance(block, SnapshotBlock)
    width = len(block.layout)
    for field in ("uuid", "name", "pids"):
        column = block.columns[GpuSample._fields.index(field)]
        assert column is not None and len(column) == width * len(snapshots)
        # One object for each distinct value, however many lines repeat it.
        assert len({id(value) for value in column}) == len(set(column)), field
    pids = block.columns[GpuSample._fields.index("pids")]
    assert pids is not None and pids[2 + (half - 1) * width] != (9999,) and pids[2 + half * width] == (9999,)


def _new_gpus(lines: int, per_line: int) -> str:
    """A recording each of whose lines names `per_line` GPUs that no line before it named."""
    return "\n".join([json.dumps(HEAD), *(json.dumps({"t": n, "gpus": {"index": list(range(n * per_line,
                                                                                      (n + 1) * per_line))}})
                                          for n in range(lines))]) + "\n"


def test_a_recording_names_at_most_max_gpus() -> None:
    """The detectors keep a column for every GPU a trace ever named: the line that would name the trace's 65th is
    malformed, and under --lenient skipped, each such line at the cost of its own parse."""
    text = _new_gpus(40, 8)
    with pytest.raises(TraceError, match=rf"^rec.jsonl:{2 + MAX_GPUS // 8}: more than {MAX_GPUS} GPUs in one trace"):
        list(recording.read(io.StringIO(text), "rec.jsonl"))
    skips = SkipLog(lenient=True)
    got = list(recording.read(io.StringIO(text), "rec.jsonl", skips))
    assert len(got) == MAX_GPUS // 8 and skips.count == 40 - MAX_GPUS // 8
    assert {g.index for s in got for g in s.gpus} == set(range(MAX_GPUS))


def test_a_gpu_seen_before_is_not_counted_again() -> None:
    """GPUs coming and going (a GPU lost, then back) count once each."""
    lines = [json.dumps({"t": n, "gpus": {"index": list(range(MAX_GPUS))[n % 2:]}}) for n in range(300)]
    got = list(recording.read(io.StringIO("\n".join([json.dumps(HEAD), *lines]) + "\n"), "rec.jsonl"))
    assert len(got) == 300


def test_a_reading_that_is_not_a_number_is_written_null_and_the_recording_reads_back() -> None:
    # A NaN or an infinity from a driver would be written `NaN` or `Infinity` by json.dumps, which no JSON
    # parser (this reader's included) accepts: the whole recording or bundle would be refused at that line.
    odd = NodeSnapshot(1.0, (GpuSample(index=0, power_watts=float("nan"), utilization_ratio=float("inf")),
                             GpuSample(index=1, power_watts=150.0, utilization_ratio=1.0)))
    line = recording.encode(odd)
    assert json.loads(line)["gpus"]["power_watts"] == [None, 150.0]
    (back,) = roundtrip([odd])
    assert back.gpus[0].power_watts is None and back.gpus[0].utilization_ratio is None
    assert back.gpus[1] == odd.gpus[1]


def test_each_field_is_written_as_its_column_only_where_some_gpu_has_it() -> None:
    plain = GpuSample(index=3, power_watts=90.5)
    busy = GpuSample(index=4, health=GpuHealth.LOST, pids=(4711, 4712), xids=(79,), errors=(("power_watts", "lost"),))
    columns = json.loads(recording.encode(NodeSnapshot(2.0, (plain, busy))))["gpus"]
    assert columns == {"index": [3, 4], "health": ["ok", "lost"], "power_watts": [90.5, None],
                       "pids": [[], [4711, 4712]], "errors": [None, {"power_watts": "lost"}], "xids": [[], [79]]}
    assert list(json.loads(recording.encode(NodeSnapshot(2.0, (plain,))))["gpus"]) == ["index", "power_watts"]
