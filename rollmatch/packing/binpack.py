"""Row selection for padding-free packing: which waiting segments go into the next row.

Owns: the pure selection policy on segment *lengths* (no torch, no segments): :func:`select_row`
(one row, the oldest segment pinned, filled as close to capacity as the lengths allow),
:func:`plan_rows` (an offline plan by repeated selection, for draining and benchmarks) and
:func:`fifo_greedy` (the naive next-fit baseline the benchmark compares against).
Leaves out: tensors and the buffer that holds segments between steps (``packing.carry``).

Selection is an exact subset-sum over the lengths (a bitset dynamic programme: one Python big-int
per item, ``O(n * capacity / 64)`` word operations, well under a millisecond for 100 segments and
a capacity of a few thousand tokens). Among the subsets that reach the best fill, backtracking
prefers older segments, so nothing waits longer than it must and the result is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollmatch.errors import PackingError

_CAPACITY_KEY = "training.global_max_length"


def select_row(lengths: Sequence[int], capacity: int) -> list[int]:
    """Indices (ascending) of the segments to put in one row of at most ``capacity`` tokens.

    ``lengths`` are in age order, oldest first. The oldest (index 0) is always included so no
    segment can starve; the others are chosen to maximise the row's total length, preferring older
    segments among equally full choices. An empty ``lengths`` gives an empty row.
    """
    _check_lengths(lengths, capacity)
    if not lengths:
        return []
    room = capacity - lengths[0]
    rest = lengths[1:]
    # reachable[i]: bit s set iff some subset of rest[:i] sums to s (s <= room).
    window = (1 << (room + 1)) - 1
    reachable = [1]
    for length in rest:
        current = reachable[-1]
        reachable.append((current | (current << length)) & window)
        if reachable[-1] >> room:
            break  # a perfect fill exists using only these (older) segments
    best = reachable[-1].bit_length() - 1
    chosen: list[int] = []
    for i in range(len(reachable) - 1, 0, -1):
        if not (reachable[i - 1] >> best) & 1:
            # ``best`` cannot be reached without rest[i - 1]: take it.
            chosen.append(i)  # index into lengths (rest is offset by one)
            best -= rest[i - 1]
    return [0, *sorted(chosen)]


def plan_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Split all segments into rows by repeated :func:`select_row` on what is left (oldest first)."""
    _check_lengths(lengths, capacity)
    remaining = list(range(len(lengths)))
    rows: list[list[int]] = []
    while remaining:
        picked = select_row([lengths[i] for i in remaining], capacity)
        rows.append([remaining[j] for j in picked])
        picked_set = set(picked)
        remaining = [idx for j, idx in enumerate(remaining) if j not in picked_set]
    return rows


def fifo_greedy(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Next-fit in arrival order: close the row as soon as the next segment does not fit (baseline)."""
    _check_lengths(lengths, capacity)
    rows: list[list[int]] = []
    row: list[int] = []
    used = 0
    for i, length in enumerate(lengths):
        if row and used + length > capacity:
            rows.append(row)
            row, used = [], 0
        row.append(i)
        used += length
    if row:
        rows.append(row)
    return rows


def _check_lengths(lengths: Sequence[int], capacity: int) -> None:
    if capacity <= 0:
        raise PackingError(f"packing capacity must be positive, got {capacity}: set `{_CAPACITY_KEY}` > 0")
    for i, length in enumerate(lengths):
        if not isinstance(length, int) or length <= 0:
            raise PackingError(f"segment {i} has length {length!r}; lengths must be positive integers")
        if length > capacity:
            raise PackingError(
                f"segment {i} has {length} tokens, more than the row capacity {capacity}: "
                f"raise `{_CAPACITY_KEY}` or shorten the sample"
            )
