"""Row selection: oldest pinned, exact best fill, older segments preferred, deterministic, bounded wait;
offline plans: every segment once, within capacity, never more rows than the oldest-pinned plan or
best-fit decreasing."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollmatch.errors import PackingError
from rollmatch.packing.binpack import fifo_greedy, plan_rows, select_row


def best_fill_with_oldest(lengths: list[int], capacity: int) -> int:
    """Brute force: the fullest row that contains index 0."""
    best = 0
    rest = range(1, len(lengths))
    for k in range(len(lengths)):
        for combo in itertools.combinations(rest, k):
            total = lengths[0] + sum(lengths[i] for i in combo)
            if total <= capacity:
                best = max(best, total)
    return best


def test_select_row_examples() -> None:
    assert select_row([], 10) == []
    assert select_row([10, 1], 10) == [0]
    assert select_row([5, 3, 4, 2, 7], 10) == [0, 1, 3]  # 5+3+2 fills exactly
    # Ties go to older segments: 6+4 and 6+(1+3) both fill 10; the older 4 wins.
    assert select_row([6, 4, 1, 3], 10) == [0, 1]
    assert select_row([6, 1, 3, 4], 10) == [0, 1, 2]


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=9),
    capacity=st.integers(min_value=40, max_value=90),
)
def test_select_row_is_an_exact_best_fill(lengths: list[int], capacity: int) -> None:
    picked = select_row(lengths, capacity)
    assert picked[0] == 0 and picked == sorted(set(picked))
    total = sum(lengths[i] for i in picked)
    assert total <= capacity
    assert total == best_fill_with_oldest(lengths, capacity)
    assert select_row(lengths, capacity) == picked  # deterministic


def oldest_pinned_plan(lengths: list[int], capacity: int) -> list[list[int]]:
    """Repeated select_row on what is left: the plan the carry buffer's drain makes."""
    remaining = list(range(len(lengths)))
    rows = []
    while remaining:
        picked = select_row([lengths[i] for i in remaining], capacity)
        rows.append([remaining[j] for j in picked])
        remaining = [idx for j, idx in enumerate(remaining) if j not in set(picked)]
    return rows


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Textbook best-fit decreasing, written independently of the module's version."""
    rows: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = [r for r in rows if sum(lengths[j] for j in r) + lengths[i] <= capacity]
        if fits:
            min(fits, key=lambda r: capacity - sum(lengths[j] for j in r)).append(i)
        else:
            rows.append([i])
    return rows


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=50), min_size=0, max_size=40),
    capacity=st.integers(min_value=50, max_value=200),
)
def test_plans_cover_every_segment_once_within_capacity(lengths: list[int], capacity: int) -> None:
    for plan in (plan_rows(lengths, capacity), fifo_greedy(lengths, capacity)):
        assert sorted(i for row in plan for i in row) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in row) <= capacity for row in plan)
    plan = plan_rows(lengths, capacity)
    assert plan == plan_rows(lengths, capacity)  # deterministic
    assert all(row == sorted(row) for row in plan)
    assert [row[0] for row in plan] == sorted(row[0] for row in plan)  # rows in age order
    assert len(plan) >= math.ceil(sum(lengths) / capacity)
    # Never worse than either plan it chooses from (oldest pinned, best-fit decreasing).
    assert len(plan) <= len(oldest_pinned_plan(lengths, capacity))
    assert len(plan) <= len(best_fit_decreasing(lengths, capacity))


@settings(max_examples=80, deadline=None)
@given(
    arrivals=st.lists(
        st.lists(st.integers(min_value=1, max_value=60), min_size=0, max_size=6), min_size=1, max_size=25
    ),
    capacity=st.integers(min_value=60, max_value=150),
)
def test_streamed_rows_pin_the_oldest_and_bound_the_wait(arrivals: list[list[int]], capacity: int) -> None:
    """The carry buffer's use of select_row: one row per step while segments arrive, then drain."""
    waiting: list[tuple[int, int, int]] = []  # (segment id, length, latest step it may leave)
    placed: list[int] = []
    next_id, step = 0, 0
    while step < len(arrivals) or waiting:
        for length in arrivals[step] if step < len(arrivals) else []:
            # Each row takes the oldest, so a segment leaves within as many steps as are queued before it.
            waiting.append((next_id, length, step + len(waiting)))
            next_id += 1
        if waiting:
            picked = select_row([length for _, length, _ in waiting], capacity)
            assert picked[0] == 0
            assert sum(waiting[j][1] for j in picked) <= capacity
            assert all(step <= waiting[j][2] for j in picked)
            placed += [waiting[j][0] for j in picked]
            waiting = [w for j, w in enumerate(waiting) if j not in set(picked)]
        assert all(step < deadline for _, _, deadline in waiting)  # nobody overstays
        step += 1
    assert sorted(placed) == list(range(next_id))


def test_plan_rows_beats_fifo_on_a_known_case() -> None:
    lengths = [6, 6, 4, 4]  # next-fit: [6] [6,4] [4]; best: [6,4] [6,4]
    assert fifo_greedy(lengths, 10) == [[0], [1, 2], [3]]
    assert plan_rows(lengths, 10) == [[0, 2], [1, 3]]


def test_plan_rows_beats_pinning_the_oldest_on_a_known_case() -> None:
    # Oldest pinned: [1,2,2] then each 3 alone (4 rows); largest first pairs each 3 with a 2 or the 1.
    lengths = [1, 3, 2, 3, 2, 3]
    assert len(oldest_pinned_plan(lengths, 5)) == 4
    assert plan_rows(lengths, 5) == [[0, 5], [1, 2], [3, 4]]


@pytest.mark.parametrize(
    ("lengths", "capacity", "match"),
    [
        ([5, 11], 10, r"segment 1 has 11 tokens.*training.global_max_length"),
        ([0], 10, "segment 0 has length 0"),
        ([3], 0, "training.global_max_length"),
    ],
)
def test_bad_lengths_raise(lengths: list[int], capacity: int, match: str) -> None:
    for fn in (select_row, plan_rows, fifo_greedy):
        with pytest.raises(PackingError, match=match):
            fn(lengths, capacity)
