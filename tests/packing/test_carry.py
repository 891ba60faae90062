"""Carry buffer: a step's rows (packed ahead, bounded wait) and one row per call; oldest pinned; errors
leave it untouched."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rollmatch.errors import PackingError
from rollmatch.packing.carry import RESERVE_ROWS, CarryBuffer, row_stats
from rollmatch.packing.segment import Segment


def ids(row: list[Segment]) -> list[str]:
    return [s.sample_id for s in row]


def test_rows_pin_the_oldest_and_fill_best(text_segment: Callable[..., Segment]) -> None:
    buffer = CarryBuffer(capacity_tokens=10, max_segments=8)
    first = buffer.next_row([text_segment("a", 6), text_segment("b", 6), text_segment("c", 4)])
    assert ids(first) == ["a", "c"]
    assert ids(list(buffer.waiting)) == ["b"] and len(buffer) == 1 and buffer.depth_tokens == 6
    second = buffer.next_row([text_segment("d", 3), text_segment("e", 4)])
    assert ids(second) == ["b", "e"]  # b (oldest) pinned; 6+4 fills exactly
    assert ids(buffer.drain_rows()[0]) == ["d"]
    assert len(buffer) == 0 and buffer.next_row([]) == []


def test_a_step_takes_rows_until_less_than_the_reserve_waits(text_segment: Callable[..., Segment]) -> None:
    assert RESERVE_ROWS == 3
    buffer = CarryBuffer(capacity_tokens=10, max_segments=16)
    # 46 tokens arrive (4.6 rows' worth): rows leave until less than 3 rows' worth (30 tokens) waits.
    lengths = {"a": 6, "b": 6, "c": 6, "d": 4, "e": 4, "f": 4, "g": 6, "h": 6, "i": 4}
    rows = buffer.take_rows([text_segment(n, length) for n, length in lengths.items()], min_rows=1)
    assert [ids(row) for row in rows] == [["a", "d"], ["b", "e"]]  # oldest pinned, exact fills
    assert buffer.depth_tokens == 26 and ids(list(buffer.waiting)) == ["c", "f", "g", "h", "i"]
    # A step that brings little still trains its one row, from the oldest waiting segments.
    assert [ids(row) for row in buffer.take_rows([text_segment("j", 1)], min_rows=1)] == [["c", "f"]]
    assert [sum(s.length for s in row) for row in buffer.take_rows([], min_rows=0, drain=True)] == [10, 7]
    assert len(buffer) == 0


def test_take_rows_bounds_the_waiting_count_and_drains(text_segment: Callable[..., Segment]) -> None:
    buffer = CarryBuffer(capacity_tokens=100, max_segments=2)
    rows = buffer.take_rows([text_segment(f"s{i}", 1) for i in range(5)], min_rows=0)
    assert len(buffer) <= 2 and sum(len(r) for r in rows) + len(buffer) == 5
    buffer.take_rows([text_segment("x", 1)], min_rows=0)
    drained = buffer.take_rows([], min_rows=0, drain=True)
    assert len(buffer) == 0 and sum(len(r) for r in drained) >= 1
    with pytest.raises(PackingError, match=r"'huge' has 101 tokens"):
        buffer.take_rows([text_segment("huge", 101)], min_rows=1)


def test_overflow_raises_and_leaves_the_buffer_unchanged(text_segment: Callable[..., Segment]) -> None:
    buffer = CarryBuffer(capacity_tokens=10, max_segments=2)
    buffer.next_row([text_segment("a", 9), text_segment("b", 9), text_segment("c", 9)])
    before = (ids(list(buffer.waiting)), buffer.depth_tokens)
    with pytest.raises(PackingError, match=r"training\.carry_buffer_size` = 2") as info:
        buffer.next_row([text_segment("d", 9), text_segment("e", 9)])
    assert "3 segments" in str(info.value)
    assert (ids(list(buffer.waiting)), buffer.depth_tokens) == before
    assert ids(buffer.next_row([])) == ["b"]  # still usable, same order


def test_oversized_segment_is_rejected_by_name(text_segment: Callable[..., Segment]) -> None:
    buffer = CarryBuffer(capacity_tokens=10, max_segments=4)
    buffer.next_row([text_segment("a", 3), text_segment("b", 9)])
    with pytest.raises(PackingError, match=r"'huge' has 11 tokens.*training\.global_max_length` = 10"):
        buffer.next_row([text_segment("c", 2), text_segment("huge", 11)])
    assert ids(list(buffer.waiting)) == ["b"]


def test_invalid_limits() -> None:
    with pytest.raises(PackingError, match="carry_buffer_size"):
        CarryBuffer(capacity_tokens=10, max_segments=0)
    with pytest.raises(PackingError, match="global_max_length"):
        CarryBuffer(capacity_tokens=0, max_segments=3)


def test_streaming_is_deterministic(text_segment: Callable[..., Segment]) -> None:
    lengths = [(i * 37) % 23 + 2 for i in range(60)]

    def run() -> list[list[str]]:
        buffer = CarryBuffer(capacity_tokens=40, max_segments=32)
        rows = [
            ids(buffer.next_row([text_segment(f"s{i + j}", lengths[i + j]) for j in range(3)]))
            for i in range(0, 60, 3)
        ]
        return rows + [ids(row) for row in buffer.drain_rows()]

    first = run()
    assert first == run()
    assert sorted(sample for row in first for sample in row) == sorted(f"s{i}" for i in range(60))


def test_state_dict_round_trip(tmp_path: Path, text_segment: Callable[..., Segment]) -> None:
    buffer = CarryBuffer(capacity_tokens=10, max_segments=4)
    buffer.next_row([text_segment("a", 8, created_step=3), text_segment("b", 7, created_step=4)])
    torch.save(buffer.state_dict(), tmp_path / "carry.pt")

    restored = CarryBuffer(capacity_tokens=10, max_segments=4)
    restored.load_state_dict(torch.load(tmp_path / "carry.pt"))
    (segment,) = restored.waiting
    assert segment.sample_id == "b" and segment.created_step == 4
    assert torch.equal(segment.input_ids, buffer.waiting[0].input_ids)
    assert torch.equal(segment.weights, buffer.waiting[0].weights)

    with pytest.raises(PackingError, match=r"'b' has 7 tokens.*checkpoint's value \(10\)"):
        CarryBuffer(capacity_tokens=6, max_segments=4).load_state_dict(buffer.state_dict())


def test_row_stats(text_segment: Callable[..., Segment]) -> None:
    rows = [[text_segment("a", 6), text_segment("b", 4)], [text_segment("c", 5)], []]
    stats = row_stats(rows, capacity=10, carry_depth=3)
    assert stats == {
        "packing/rows": 2.0,
        "packing/segments_per_row": 1.5,
        "packing/fill_ratio": 0.75,
        "packing/carry_depth": 3.0,
    }
    assert row_stats([], capacity=10)["packing/fill_ratio"] == 0.0
