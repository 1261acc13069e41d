"""A timestamp column read at once (smi_cells.column_times: nvidia-smi's own form as bytes, the rest cell by cell)
gives what parse_timestamp gives each of its cells, or the same error, for any column: stamps of one length or
several, in order or not, with fractions of any length or none, damaged anywhere."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from watchdog.sample.smi_cells import Cells, column_times, parse_timestamp

DIGITS = "0123456789"


@st.composite
def columns(draw: st.DrawFn) -> list[str]:
    start = draw(st.floats(1.5e9, 1.9e9))
    fraction = draw(st.sampled_from([0, 1, 3, 6, 9]))
    moves = draw(st.lists(st.floats(-30, 90), min_size=1, max_size=300))  # seconds on from the row before
    lead = draw(st.sampled_from(["", " "]))
    cells, t = [], start
    for move in moves:
        t = max(t + move, 0.0)
        stamp = datetime.fromtimestamp(t, timezone.utc)
        text = stamp.strftime("%Y/%m/%d %H:%M:%S")
        if fraction:
            text += "." + f"{stamp.microsecond:06d}000"[:fraction]
        cells.append(lead + text)
    for _ in range(draw(st.integers(0, 3))):  # damage: a character replaced, cut or added, anywhere
        row = draw(st.integers(0, len(cells) - 1))
        text = cells[row]
        at = draw(st.integers(0, len(text) - 1))
        change = draw(st.sampled_from(["replace", "cut", "add"]))
        said = draw(st.sampled_from([*DIGITS, ".", ":", "/", "-", " ", "T", "x", "é"]))
        cells[row] = text[:at] + ("" if change == "cut" else said) + text[at + (change != "add"):]
    return cells


def cell_by_cell(cells: list[str]) -> list[float] | str:
    try:
        return [parse_timestamp(cell) for cell in cells]
    except ValueError:
        return "refused"


def at_once(cells: list[str]) -> list[float] | str:
    try:
        return column_times(cells, Cells(parse_timestamp))
    except ValueError:
        return "refused"


@settings(max_examples=400, deadline=None)
@given(columns())
def test_a_column_reads_as_its_cells_do(cells: list[str]) -> None:
    assert at_once(cells) == cell_by_cell(cells)


@pytest.mark.parametrize("cells", [
    ["2025/07/27 00:22:27.858", "2025/07/27 00:22:61.000"],  # no second of a minute
    ["2025/07/27 00:22:27.858", "2025/07/27 00:22:2x.000"],
    ["2025/07/27 00:22:27.858", "2025/07/27 00:22:27,858"],
    ["2025/07/27 00:22:27.858", "2025/02/30 00:22:27.858"],  # no such day
    ["2025/07/27 00:22:27.858", "2025/07/27 00:22:27.8580"],  # one row longer
])
def test_a_damaged_stamp_among_many_reads_as_it_does_alone(cells: list[str]) -> None:
    column = [f"2025/07/26 23:{n // 60:02d}:{n % 60:02d}.{n % 1000:03d}" for n in range(200)] + cells
    assert at_once(column) == cell_by_cell(column)


def test_stamps_of_every_row_read_to_the_millisecond_across_minutes_and_days() -> None:
    column = [f"2025/07/{27 + n // 86400:02d} {n // 3600 % 24:02d}:{n // 60 % 60:02d}:{n % 60:02d}.{n % 997:03d}"
              for n in range(86000, 87000)]
    times = at_once(column)
    assert times == cell_by_cell(column)
    assert times[0] == datetime(2025, 7, 27, 23, 53, 20, tzinfo=timezone.utc).timestamp() + (86000 % 997) / 1000
