"""Row selection for padding-free packing: which waiting segments go into the next row.

Owns: the pure selection policy on segment *lengths* (no torch, no segments): :func:`select_row`
(one row, the oldest segment pinned, filled as close to capacity as the lengths allow),
:func:`plan_rows` (every length known up front: the fewest rows of a few deterministic plans, for
step-mode rows, draining and benchmarks) and :func:`fifo_greedy` (the naive next-fit baseline the
benchmark compares against). Leaves out: tensors and the buffer that holds segments between steps
(``packing.carry``).

Selection is an exact subset-sum over the lengths (a bitset dynamic programme: one Python big-int
per item, ``O(n * capacity / 64)`` word operations, well under a millisecond for 100 segments and
a capacity of a few thousand tokens). Among the subsets that reach the best fill, backtracking
prefers older segments, so nothing waits longer than it must and the result is deterministic.

Why one greedy row at a time is enough for streaming: measured in ``bench/packing.py``, the carry
buffer's rows equal the lower bound of *any* packer that must emit one row per step under the same
arrivals (a step can only pack what has arrived), so the gap to an offline packer is the arrival
process, not the selection; look-ahead and largest-first variants of :func:`select_row` gained
nothing there (docs/performance.md). Offline, pinning the oldest does lose on some mixes (e.g. [1,
3, 2, 3, 2, 3] in rows of 5: 4 rows instead of 3), so :func:`plan_rows` also tries largest-first
plans and keeps the fewest rows.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence

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
    return [0, *sorted(_fullest_subset(lengths, range(1, len(lengths)), capacity - lengths[0]))]


def plan_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Split all segments into rows when every length is known up front (deterministic).

    Returns rows of indices, each ascending, the rows ordered by their oldest segment. Three plans
    are tried in order and the first with the fewest rows is kept: repeated :func:`select_row` on
    what is left (oldest pinned: the age-friendliest), minimum slack around the largest waiting
    segment, and best-fit decreasing. The search stops early at the lower bound
    ``ceil(sum(lengths) / capacity)``, which the first plan usually reaches.
    """
    _check_lengths(lengths, capacity)
    lower_bound = math.ceil(sum(lengths) / capacity)
    best: list[list[int]] | None = None
    for plan in _PLANS:
        rows = plan(lengths, capacity)
        if best is None or len(rows) < len(best):
            best = rows
        if len(best) <= lower_bound:
            break
    return sorted(sorted(row) for row in best or [])


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


def _oldest_pinned_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Repeated :func:`select_row` on the segments that are left."""
    remaining = list(range(len(lengths)))
    rows: list[list[int]] = []
    while remaining:
        picked = select_row([lengths[i] for i in remaining], capacity)
        rows.append([remaining[j] for j in picked])
        picked_set = set(picked)
        remaining = [idx for j, idx in enumerate(remaining) if j not in picked_set]
    return rows


def _largest_pinned_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Each row: the largest segment left plus the fullest subset of the others (older first on ties).

    Long segments are the hard ones to place; pairing each with the best filler is what wins over
    the oldest-pinned plan on wide length mixes.
    """
    remaining = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    while remaining:
        largest = remaining[0]
        row = [largest, *_fullest_subset(lengths, sorted(remaining[1:]), capacity - lengths[largest])]
        rows.append(row)
        taken = set(row)
        remaining = [i for i in remaining if i not in taken]
    return rows


def _best_fit_decreasing_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Longest first, each into the row it leaves least room in (a new row when none fits)."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row index), ascending
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        slot = bisect.bisect_left(free, (lengths[i], -1))
        if slot < len(free):
            room, row = free.pop(slot)
            rows[row].append(i)
            bisect.insort(free, (room - lengths[i], row))
        else:
            rows.append([i])
            bisect.insort(free, (capacity - lengths[i], len(rows) - 1))
    return rows


_PLANS: tuple[Callable[[Sequence[int], int], list[list[int]]], ...] = (
    _oldest_pinned_rows,
    _largest_pinned_rows,
    _best_fit_decreasing_rows,
)


def _fullest_subset(lengths: Sequence[int], candidates: Sequence[int], room: int) -> list[int]:
    """The subset of ``candidates`` (indices) with the largest total <= ``room``.

    Among equally full subsets it prefers candidates listed earlier (a perfect fill found among the
    first candidates stops the search).
    """
    # reachable[k]: bit s set iff some subset of candidates[:k] sums to s (s <= room).
    window = (1 << (room + 1)) - 1
    reachable = [1]
    for i in candidates:
        current = reachable[-1]
        reachable.append((current | (current << lengths[i])) & window)
        if reachable[-1] >> room:
            break  # a perfect fill exists using only these (earlier) candidates
    best = reachable[-1].bit_length() - 1
    chosen: list[int] = []
    for k in range(len(reachable) - 1, 0, -1):
        if not (reachable[k - 1] >> best) & 1:
            # ``best`` cannot be reached without candidates[k - 1]: take it.
            chosen.append(candidates[k - 1])
            best -= lengths[candidates[k - 1]]
    return chosen


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
