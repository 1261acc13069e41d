"""Triggering PyTorch's Flight Recorder dump through its debug pipe (a real FIFO, a real process)."""

from __future__ import annotations

import os
from pathlib import Path

from tests.conftest import python_target
from watchdog.sample.ranks import RankDiscovery
from watchdog.stacks.flight_recorder import FlightRecorder, trigger


def trigger_for(env: dict[str, str], tmp_path: Path) -> FlightRecorder:
    """Start a real process with this environment and trigger its Flight Recorder."""
    with python_target("queue", tmp_path, env) as process:
        rank = RankDiscovery().describe(process.pid)
        assert rank is not None
        return trigger(rank)


def pipe_env(stem: str, rank: int = 0, buffer: str = "10") -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": "4", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": stem,
            "TORCH_NCCL_TRACE_BUFFER_SIZE": buffer}


def test_writes_to_the_ranks_pipe_and_says_where_the_dump_goes(tmp_path: Path) -> None:
    stem = str(tmp_path / "fr_")
    os.mkfifo(f"{stem}3.pipe")
    reader = os.open(f"{stem}3.pipe", os.O_RDONLY | os.O_NONBLOCK)  # what ProcessGroupNCCL holds open
    try:
        result = trigger_for({**pipe_env(stem, 3, "2000"), "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "trace_")},
                             tmp_path)
        assert result.result == "triggered"
        assert result.dump_path == str(tmp_path / "trace_3")
        assert os.read(reader, 16) == b"1\n"
    finally:
        os.close(reader)


def test_explains_what_is_missing(tmp_path: Path) -> None:
    assert trigger_for({"RANK": "0", "WORLD_SIZE": "2"}, tmp_path).result == "not_configured"
    assert trigger_for(pipe_env(str(tmp_path / "p_"), buffer="0"), tmp_path).result == "disabled"
    assert trigger_for(pipe_env(str(tmp_path / "none_")), tmp_path).result == "no_pipe"


def test_a_pipe_nobody_reads_is_not_waited_on(tmp_path: Path) -> None:
    stem = str(tmp_path / "fr_")
    os.mkfifo(f"{stem}0.pipe")
    assert trigger_for(pipe_env(stem), tmp_path).result == "not_listening"


def test_never_writes_to_a_regular_file(tmp_path: Path) -> None:
    stem = str(tmp_path / "fr_")
    Path(f"{stem}0.pipe").write_text("precious")
    assert trigger_for(pipe_env(stem), tmp_path).result == "failed"
    assert Path(f"{stem}0.pipe").read_text() == "precious"
