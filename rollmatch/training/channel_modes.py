"""The row sources of an optimizer step that work from the step's own records.

Owns :class:`WindowRows`: Channel-A (and ``sft``) — GT targets of the window's records — and
Channel-B ``micro`` (and ``rollout_matching_sft``) — rollouts of the window's records — are the same
strategy with a different segment producer and their own :class:`~rollmatch.training.rows.RowPlanner`
(so their rows, and carry buffers, never mix). The other Channel-B modes live in
``training.channel_b.step_mode`` (a rollout budget per step) and ``training.channel_b.async_mode`` (ready packs from an
actor). Leaves out: the step's decisions (``training.step``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from rollmatch.data.records import Record
from rollmatch.training.rows import RowPlanner
from rollmatch.training.segment_producers import ChannelOutput
from rollmatch.training.step import ChannelBatch, ChannelStatus, GaugeKind, Windows

CARRY_DROPPED_STALE = "stage2_ab/micro/carry_dropped_stale"
CARRY_AGE_MAX = "stage2_ab/micro/carry_age_max"

# records of the whole window, optimizer step -> segments (in record order) + metric sums
Producer = Callable[[Sequence[Record], int], ChannelOutput]


class WindowRows:
    """Segments of the window's records -> this channel's rows (one producer call per step).

    ``per_record``: segments the producer makes of each record (``rollouts_per_record`` for rollouts).
    """

    def __init__(self, producer: Producer, rows: RowPlanner, per_record: int = 1):
        self.producer = producer
        self.rows = rows
        self.per_record = per_record

    always_ready = True  # the window's own records always feed the step

    def reserve_for_step(self, global_step: int, micro_steps: int, *, wants_b: bool) -> ChannelStatus:
        return ChannelStatus()

    def take(self, windows: Windows, global_step: int, *, final: bool) -> ChannelBatch:
        # One producer call for the whole window: rollouts batch across micro-steps (weights do not
        # change inside an optimizer step, so this equals per-micro-step rollouts).
        produced = self.producer([r for window in windows for r in window], global_step)
        micro_batches, start = [], 0
        for window in windows:
            size = len(window) * self.per_record
            micro_batches.append(produced.segments[start : start + size])
            start += size
        rows = self.rows.rows(micro_batches, drain=final, step=global_step)
        self.rows.count(rows, produced.sums)
        gauges: dict[str, tuple[GaugeKind, float]] = {}
        if self.rows.max_carry_age_steps is not None and self.rows.carry is not None:
            # rollouts carried to a later step (several ranks: one row per micro-step, the rest waits)
            produced.sums[CARRY_DROPPED_STALE] += self.rows.dropped_stale
            ages = [global_step - s.created_step for row in rows for s in row]
            gauges[CARRY_AGE_MAX] = ("max", float(max(ages, default=0)))
        return ChannelBatch(rows=rows, batch=self.rows.batch, sums=produced.sums, gauges=gauges)

    def finish_step(self, global_step: int) -> tuple[Counter[str], dict[str, tuple[GaugeKind, float]]]:
        return Counter(), {}

    def close(self) -> None:
        return None

    def state_dict(self) -> dict[str, Any] | None:
        return self.rows.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.rows.load_state_dict(state)
