"""The carry buffer: segments that did not fit this step's row wait (oldest first) for a later one.

Owns: :class:`CarryBuffer` (bounded, rank-local, one row per call, checkpointable) and
:func:`row_stats` (the ``packing/*`` metrics). Leaves out: the selection policy
(``packing.binpack.select_row``: oldest pinned, exact best fill) and tensors of a row
(``packing.collate``).

Each optimizer step the trainer adds the segments of its micro-batches and takes that step's rows
(:meth:`CarryBuffer.take_rows`): at least one, and more while :data:`RESERVE_ROWS` rows' worth of
tokens (or more than ``max_segments`` segments) would be left waiting. A step that brings more tokens
than one row trains extra rows instead of failing, and the reserve keeps enough choice for full rows:
on long-tailed length mixes one row's worth of reserve used 5-20% more rows than the one-row-per-step
optimum, three rows' worth is within 0-6% (``bench/packing.py``), at a wait of a few steps. Every row
includes the oldest waiting segment, so nothing starves; the rest of the row is filled as close to
capacity as the waiting lengths allow. ``Segment.created_step`` records the optimizer step whose
rollouts produced a segment. :meth:`CarryBuffer.next_row` is the one-row-per-call form (benchmarks
and streaming callers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from rollmatch.errors import PackingError
from rollmatch.packing.binpack import select_row
from rollmatch.packing.segment import Segment

_BUFFER_KEY = "training.carry_buffer_size"
RESERVE_ROWS = 3  # rows' worth of tokens a step may leave waiting (choice for fuller rows)
_CAPACITY_KEY = "training.global_max_length"


class CarryBuffer:
    """Rank-local FIFO of waiting segments, at most ``max_segments`` long after each row is taken."""

    def __init__(self, capacity_tokens: int, max_segments: int) -> None:
        if capacity_tokens <= 0:
            raise PackingError(f"`{_CAPACITY_KEY}` = {capacity_tokens}: the row capacity must be > 0")
        if max_segments <= 0:
            raise PackingError(f"`{_BUFFER_KEY}` = {max_segments}: the carry buffer must hold >= 1 segment")
        self.capacity_tokens = capacity_tokens
        self.max_segments = max_segments
        self._waiting: list[Segment] = []

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def depth_tokens(self) -> int:
        """Tokens waiting in the buffer."""
        return sum(s.length for s in self._waiting)

    @property
    def waiting(self) -> tuple[Segment, ...]:
        """The waiting segments, oldest first (read-only view)."""
        return tuple(self._waiting)

    def take_rows(
        self,
        new_segments: Sequence[Segment],
        *,
        min_rows: int,
        drain: bool = False,
        max_rows: int | None = None,
    ) -> list[list[Segment]]:
        """Add ``new_segments`` and take this step's rows (each in age order, oldest segment pinned).

        At least ``min_rows`` rows (while segments wait), then more while :data:`RESERVE_ROWS` rows'
        worth of tokens or more than ``max_segments`` segments would wait; ``drain`` takes everything;
        never more than ``max_rows`` (the rest waits). Raises :class:`PackingError` (buffer unchanged) if a
        segment exceeds the row capacity, or if ``max_rows`` leaves more than ``max_segments`` waiting.
        """
        self._check_fit(new_segments)
        waiting = [*self._waiting, *new_segments]
        rows: list[list[Segment]] = []
        while (
            waiting
            and (max_rows is None or len(rows) < max_rows)
            and (len(rows) < min_rows or drain or self._over_limits(waiting))
        ):
            picked = select_row([s.length for s in waiting], self.capacity_tokens)
            chosen = set(picked)
            rows.append([waiting[i] for i in picked])
            waiting = [s for i, s in enumerate(waiting) if i not in chosen]
        if len(waiting) > self.max_segments and not drain:
            raise PackingError(
                f"{len(waiting)} segments ({sum(s.length for s in waiting)} tokens) would wait for a later step, "
                f"more than `{_BUFFER_KEY}` = {self.max_segments}: the step trains at most {max_rows} row(s) of "
                f"{self.capacity_tokens} tokens (one per micro-step with several ranks) and its segments need "
                f"more; raise `{_CAPACITY_KEY}` or `{_BUFFER_KEY}`, or lower `training.per_device_train_batch_size`"
            )
        self._waiting = waiting
        return rows

    def _over_limits(self, waiting: Sequence[Segment]) -> bool:
        tokens = sum(s.length for s in waiting)
        return len(waiting) > self.max_segments or tokens >= RESERVE_ROWS * self.capacity_tokens

    def _check_fit(self, segments: Sequence[Segment]) -> None:
        for segment in segments:
            if segment.length > self.capacity_tokens:
                raise PackingError(
                    f"sample {segment.sample_id!r} has {segment.length} tokens, more than `{_CAPACITY_KEY}` = "
                    f"{self.capacity_tokens}: raise `{_CAPACITY_KEY}` or shorten the sample"
                )

    def next_row(self, new_segments: Sequence[Segment]) -> list[Segment]:
        """Add ``new_segments`` (after the waiting ones) and take one row, oldest segment included.

        Returns the row's segments in age order ([] when nothing waits). Raises
        :class:`PackingError` (buffer unchanged) if a segment exceeds the row capacity or more
        than ``max_segments`` would be left waiting.
        """
        self._check_fit(new_segments)
        candidates = [*self._waiting, *new_segments]
        if not candidates:
            return []
        picked = select_row([s.length for s in candidates], self.capacity_tokens)
        picked_set = set(picked)
        left = [s for i, s in enumerate(candidates) if i not in picked_set]
        if len(left) > self.max_segments:
            raise PackingError(
                f"{len(left)} segments ({sum(s.length for s in left)} tokens) would wait for a later row, more "
                f"than `{_BUFFER_KEY}` = {self.max_segments}: the rollouts of one micro-step exceed a row of "
                f"{self.capacity_tokens} tokens; raise `{_CAPACITY_KEY}` or `{_BUFFER_KEY}`, or lower "
                "`training.per_device_train_batch_size`"
            )
        self._waiting = left
        return [candidates[i] for i in picked]

    def drop_older_than(self, step: int, max_age_steps: int) -> list[Segment]:
        """Remove and return the waiting segments made more than ``max_age_steps`` optimizer steps before
        ``step`` (``step - created_step > max_age_steps``): rollouts of weights too old to train on."""
        kept = [s for s in self._waiting if step - s.created_step <= max_age_steps]
        dropped = [s for s in self._waiting if step - s.created_step > max_age_steps]
        self._waiting = kept
        return dropped

    def drain(self) -> list[Segment]:
        """Remove and return every waiting segment (oldest first)."""
        waiting, self._waiting = self._waiting, []
        return waiting

    def drain_rows(self) -> list[list[Segment]]:
        """Empty the buffer into rows, each selected like :meth:`next_row` with nothing new."""
        rows: list[list[Segment]] = []
        while self._waiting:
            rows.append(self.next_row([]))
        return rows

    def state_dict(self) -> dict[str, Any]:
        """The waiting segments (tensors included, ``torch.save``-able) and the limits."""
        return {
            "capacity_tokens": self.capacity_tokens,
            "max_segments": self.max_segments,
            "segments": [_segment_state(s) for s in self._waiting],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore waiting segments saved by :meth:`state_dict` under this buffer's limits."""
        segments = [Segment(**fields) for fields in state["segments"]]
        for segment in segments:
            if segment.length > self.capacity_tokens:
                raise PackingError(
                    f"checkpointed carry segment {segment.sample_id!r} has {segment.length} tokens, more than "
                    f"`{_CAPACITY_KEY}` = {self.capacity_tokens}: resume with the checkpoint's value "
                    f"({state['capacity_tokens']})"
                )
        if len(segments) > self.max_segments:
            raise PackingError(
                f"checkpoint holds {len(segments)} carried segments, more than `{_BUFFER_KEY}` = "
                f"{self.max_segments}: resume with the checkpoint's value ({state['max_segments']})"
            )
        self._waiting = segments


def row_stats(rows: Sequence[Sequence[Segment]], capacity: int, carry_depth: int = 0) -> dict[str, float]:
    """``packing/*`` metrics of the rows of one step; ``carry_depth``: segments left waiting."""
    non_empty = [row for row in rows if row]
    tokens = sum(s.length for row in non_empty for s in row)
    n_rows = len(non_empty)
    return {
        "packing/rows": float(n_rows),
        "packing/segments_per_row": sum(len(row) for row in non_empty) / n_rows if n_rows else 0.0,
        "packing/fill_ratio": tokens / (n_rows * capacity) if n_rows else 0.0,
        "packing/carry_depth": float(carry_depth),
    }


def _segment_state(segment: Segment) -> dict[str, Any]:
    return {f.name: getattr(segment, f.name) for f in fields(Segment)}
