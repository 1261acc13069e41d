"""Reading dumps: py-spy text and JSON, grouped and digest forms, the real dumps in ../shared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REALDATA, realdata
from watchdog.stacks.formats import StackFormatError, load, parse_pyspy_json
from watchdog.stacks.pyspy_text import parse_text
from watchdog.vocabulary.stack_model import Frame

PYSPY_TEXT = """Process 4711: python train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 4711 (idle): "MainThread"
    wait (threading.py:327)
    get (queue.py:171)
    __next__ (torch/utils/data/dataloader.py:630)
    train (train.py:42)
Thread 4790 (active): "pin_memory"
    _pin_memory_loop (torch/utils/data/_utils/pin_memory.py:51)
        Arguments:
            device_id: 0
        Locals:
            data: None

Process 4712: python train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 0x7F2A (active+gil): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:2050)
    train (train.py:40)
"""


def test_pyspy_text_processes_threads_and_locals() -> None:
    first, second = parse_text(PYSPY_TEXT, "x.txt")
    assert (first.member, first.pid, len(first.threads)) == ("pid 4711", 4711, 2)
    main = first.main_thread
    assert main is not None and main.state == "idle"
    assert main.frames[:2] == (Frame("wait", "threading.py", 327), Frame("get", "queue.py", 171))
    assert len(first.threads[1].frames) == 1  # Arguments/Locals lines are not frames
    assert second.pid == 4712 and second.threads[0].thread_id == 0x7F2A
    assert second.threads[0].frames[0].function == "all_reduce"


def test_grouped_headers_share_one_frame_list() -> None:
    text = ("3 in:\n```\nThread 11 (active): \"MainThread\"\nThread 12 (active): \"MainThread\"\n"
            "Thread 13 (active): \"MainThread\"\n    broadcast (torch/distributed/distributed_c10d.py:1191)\n```\n"
            "Some prose between the groups.\n"
            "6 processes are in:\nThread 20 (idle): \"MainThread\"\n    train (megatron/training.py:915)\n")
    dumps = parse_text(text)
    assert [(d.member, d.count) for d in dumps] == [("pid 11", 1), ("pid 12", 1), ("pid 13", 1), ("pid 20", 6)]
    assert all(d.main_thread.frames[0].function == "broadcast" for d in dumps[:3])  # type: ignore[union-attr]


def test_pyspy_json_from_a_live_capture_shape() -> None:
    data = [{"pid": 7, "thread_id": 1, "thread_name": "MainThread", "os_thread_id": 7, "active": False,
             "owns_gil": False, "frames": [{"name": "Queue.get", "filename": "/usr/lib/python3.11/queue.py",
                                            "module": None, "short_filename": "queue.py", "line": 171,
                                            "locals": None}]}]
    (dump,) = parse_pyspy_json(data, rank=3, gpus=(3,))
    assert (dump.member, dump.pid, dump.rank, dump.gpus) == ("rank 3", 7, 3, (3,))
    assert dump.main_thread.state == "idle" and dump.main_thread.frames[0].short == "Queue.get"  # type: ignore[union-attr]


@pytest.mark.parametrize("content", ["", "just prose\nno stacks here\n", "[1, 2", '{"a": 1}'])
def test_unreadable_dumps_say_so(tmp_path: Path, content: str) -> None:
    path = tmp_path / ("d.json" if content.startswith(("[", "{")) else "d.txt")
    path.write_text(content)
    with pytest.raises(StackFormatError, match=str(path)):
        load(path)


def real_dump_files() -> list[str]:
    folder = REALDATA / "hang_stacks"
    if not folder.is_dir():
        return ["(no ../shared/realdata)"]
    return sorted(p.name for p in folder.iterdir() if p.name != "SOURCES.md")


@pytest.mark.parametrize("name", real_dump_files())
def test_every_real_dump_parses(name: str) -> None:
    path = realdata("hang_stacks", name)
    dumps = load(path)
    assert dumps and all(d.main_thread is not None and d.main_thread.frames for d in dumps)
    if path.suffix == ".json":
        facts = json.loads(path.read_text())
        expected = sum(len(p["threads"]) for p in facts["processes"])
        assert sum(len(d.threads) for d in dumps) == expected


@pytest.mark.parametrize(("name", "members"), [
    ("bigscience-tr11-176B-chronicles-2022-04-30-node48.txt", 8),
    ("bigscience-tr11-176B-chronicles-2022-04-30-node49.txt", 8),
    ("bigscience-tr11-176B-chronicles-2022-05-18-all-nodes-summary.txt", 40),
    ("bigscience-tr11-176B-hang-debug-nodes0-1.txt", 8),
])
def test_real_multi_rank_pictures_count_every_rank(name: str, members: int) -> None:
    dumps = load(realdata("hang_stacks", name))
    assert sum(d.count for d in dumps) == members


def test_a_thread_name_that_forges_frames_in_a_text_dump_is_read_as_a_name() -> None:
    """A rank stuck in queue.get names its main thread `Main"` + new line + an all_reduce frame line + `"`: py-spy
    prints the name as it is, so the text shows a closed header, a frame-shaped line and a line ending in the
    name's closing quote before the real frames. It was read as in all_reduce."""
    text = ('Process 100: python train.py\n'
            'Thread 100 (idle): "Main"\n'
            '    all_reduce (torch/distributed/distributed_c10d.py:9)\n'
            '    more (x.py:1)"\n'
            '    get (queue.py:171)\n'
            '    __next__ (train.py:9)\n')
    (dump,) = parse_text(text, "paste.txt")
    assert [f.function for f in dump.threads[0].frames] == ["get", "__next__"]


def test_a_stack_repeated_across_ranks_is_read_once_and_as_trimmed() -> None:
    """The same stack in many ranks' py-spy JSON is read into one tuple of Frames, equal to what the trimmed
    JSON says; a stack with names past MAX_NAME is read (cut) every time and never kept, so a hostile rank
    cannot fill the memo with long text; a frame of the wrong shape is left out as before."""
    from watchdog.stacks import formats
    from watchdog.stacks.pyspy_text import MAX_NAME

    frames = [{"name": "all_reduce", "filename": "torch/distributed/distributed_c10d.py", "line": 2050},
              {"name": "train_step", "filename": "train.py", "line": 7}]
    dumps = [formats.parse_pyspy_json([{"pid": 100 + r, "thread_id": 1, "active": True, "frames": frames}], rank=r)[0]
             for r in range(3)]
    assert dumps[0].threads[0].frames is dumps[2].threads[0].frames
    trimmed = formats.trim_pyspy_json([{"pid": 100, "thread_id": 1, "active": True, "frames": frames}])
    assert [(f.function, f.file, f.line) for f in dumps[0].threads[0].frames] == \
        [(f["name"], f["filename"], f["line"]) for f in trimmed[0]["frames"]]
    before = len(formats._STACKS)
    long = [{"name": "x" * (MAX_NAME + 5), "filename": "f.py", "line": 1}, "not a frame", {"name": ["a list"]}]
    read = formats.parse_pyspy_json([{"pid": 1, "frames": long}])[0].threads[0].frames
    assert [(f.function, f.file) for f in read] == [("x" * MAX_NAME, "f.py"), ("", "")]
    assert len(formats._STACKS) == before
