"""Segments of one optimizer step -> the rows its micro-steps train (one forward/backward per row).

Owns: :class:`RowPlanner` (one per channel, so rows never mix Channel-A and Channel-B segments:
packed rows with the channel's own carry buffer, or padded batches), :func:`spread_rows` (how many
rows each micro-step trains: the same on every rank) and :func:`padding_row` (the zero-weight row a
rank runs when another rank has more rows, so DDP stays in lock-step). Leaves out: how segments are
produced (``training.segment_producers``), which rows a step takes (``packing.carry``: packed ahead over the
whole step, as many full rows as the data brings, a bounded reserve left waiting) and the step's
decisions (``training.step``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from rollmatch.packing.binpack import plan_rows
from rollmatch.packing.carry import CarryBuffer
from rollmatch.packing.collate import pack_row, pad_batch
from rollmatch.packing.segment import Segment

log = logging.getLogger(__name__)
MicroBatch = dict[str, Any]
Row = list[Segment]


class RowPlanner:
    """One channel's rows: packed (through its carry buffer) or one padded batch per micro-batch."""

    def __init__(
        self,
        *,
        packing: bool,
        packing_length: int,
        carry_limit: int,
        pad_token_id: int,
        one_row_per_micro_step: bool = False,
        max_carry_age_steps: int | None = None,
    ):
        self.packing = packing
        self.packing_length = packing_length
        self.pad_token_id = pad_token_id
        # Several ranks (DDP): a step takes at most one packed row per micro-step, the rest waits.
        self.one_row_per_micro_step = one_row_per_micro_step
        self.carry = (
            CarryBuffer(capacity_tokens=packing_length, max_segments=carry_limit) if packing else None
        )
        # Rollout channels: carried segments older than this many steps are dropped, not trained (their
        # rollouts came from weights that old); None: no bound (GT targets do not age).
        self.max_carry_age_steps = max_carry_age_steps
        self.dropped_stale = 0  # segments the last ``rows`` call dropped for their age

    def rows(
        self, micro_batches: Sequence[Sequence[Segment]], *, drain: bool = False, step: int | None = None
    ) -> list[Row]:
        """This step's rows for the segments its micro-batches brought (``drain``: empty the carry too).
        With ``max_carry_age_steps`` and the optimizer ``step``, carried segments made more than that many
        steps before ``step`` are dropped first (counted in :attr:`dropped_stale`).

        Packed: the step's segments are packed ahead, across its micro-batches — at least one row, more
        while a reserve of rows would wait (``packing.carry``); with ``one_row_per_micro_step`` at most one
        per micro-batch (a ``drain`` then leaves what does not fit untrained, logged). Padded: one batch
        per micro-batch.
        """
        if self.carry is None:
            return [list(batch) for batch in micro_batches]
        self.dropped_stale = 0
        if self.max_carry_age_steps is not None and step is not None:
            self.dropped_stale = len(self.carry.drop_older_than(step, self.max_carry_age_steps))
        new = [s for batch in micro_batches for s in batch]
        max_rows = len(micro_batches) if self.one_row_per_micro_step else None
        rows = self.carry.take_rows(new, min_rows=1, drain=drain, max_rows=max_rows)
        if drain and len(self.carry):
            log.warning(
                "%d segment(s) left untrained in the carry buffer at the end of the run: with several ranks "
                "every micro-step trains exactly one row",
                len(self.carry),
            )
        return rows

    def all_rows(self, segments: Sequence[Segment], batch_size: int) -> list[Row]:
        """Every segment in rows now, nothing carried (step mode): packed, or ``batch_size`` per batch."""
        if self.carry is None:
            return [list(segments[i : i + batch_size]) for i in range(0, len(segments), batch_size)]
        plan = plan_rows([s.length for s in segments], self.packing_length)
        return [[segments[i] for i in row] for row in plan]

    def batch(self, row: Row) -> MicroBatch:
        """Model inputs of one row: a packed row, or a right-padded batch."""
        return pack_row(row) if self.packing else pad_batch(row, self.pad_token_id)

    def count(self, rows: Sequence[Row], sums: Counter[str]) -> None:
        """Add the ``packing/*`` sums of ``rows`` (trained rows; padding rows are not counted)."""
        if self.carry is None:
            return
        for row in rows:
            sums["packing/rows"] += 1
            sums["packing/segments"] += len(row)
            sums["packing/tokens"] += sum(s.length for s in row)
            sums["packing/capacity"] += self.packing_length
            sums["packing/carry_depth_sum"] += len(self.carry)

    def state_dict(self) -> dict[str, Any] | None:
        return self.carry.state_dict() if self.carry is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.carry is not None and state is not None:
            self.carry.load_state_dict(state)


def spread_rows(num_rows: int, micro_steps: int) -> list[int]:
    """How many of ``num_rows`` rows each of ``micro_steps`` micro-steps trains.

    Spare rows go to the last micro-steps, so the last one (where gradients are synchronised) always
    trains at least one row; with fewer rows than micro-steps the first ones train none.
    """
    base, extra = divmod(num_rows, micro_steps)
    return [base + (1 if k >= micro_steps - extra else 0) for k in range(micro_steps)]


def padding_row(segment: Segment) -> Row:
    """A row that runs a forward/backward and trains nothing: ``segment`` with every weight zeroed.

    A real segment (image included), so every parameter takes part in the backward as DDP expects.
    Its unlikelihood flags go too (they are a loss term of their own, not scaled by ``weights``); its
    advantages stay, so a GRPO step's rows all take the policy-gradient path (zero weight trains nothing).
    """
    return [
        replace(
            segment,
            sample_id=f"{segment.sample_id}#padding",
            weights=torch.zeros_like(segment.weights),
            unlikelihood_weights=None,
            normaliser=None,
        )
    ]
