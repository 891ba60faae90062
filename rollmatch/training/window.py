"""One optimizer step's worth of micro-batches (a "window"), with exact loss normalisation.

Owns: turning the GAS raw record batches of one optimizer step into GAS model-ready micro-batches
(one packed row, or one padded batch, per micro-step — every rank runs the same number of
forward/backward passes), and the step's total loss weight summed over all micro-steps and ranks
(DESIGN §5: ``loss = sum(w * ce) / sum(w)`` over the whole step). Metric sums travel in the same
collective. Leaves out: how segments are produced (``training.channels``) and the optimizer step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollmatch.collectives import Collectives
from rollmatch.data.records import Record
from rollmatch.packing.carry import CarryBuffer
from rollmatch.packing.collate import pack_row, pad_batch
from rollmatch.packing.segment import Segment
from rollmatch.training.channels import ChannelOutput

MicroBatch = dict[str, Any]
# records of the whole window, optimizer step -> segments (in record order) + metric sums
Producer = Callable[[Sequence[Record], int], ChannelOutput]


@dataclass
class Window:
    """Model-ready micro-batches of one optimizer step and its global loss normaliser."""

    micro_batches: list[MicroBatch]
    total_weight: float
    sums: Counter[str] = field(default_factory=Counter)


# raw record batches of one optimizer step, global_step -> Window
WindowFn = Callable[[Sequence[Sequence[Record]], int], Window]


class RowBuilder:
    """Segments of one micro-step -> one model input: a packed row (carry buffer) or a padded batch."""

    def __init__(self, *, packing: bool, packing_length: int, carry_limit: int, pad_token_id: int):
        self.packing = packing
        self.pad_token_id = pad_token_id
        self.carry = (
            CarryBuffer(capacity_tokens=packing_length, max_segments=carry_limit) if packing else None
        )

    def build(self, segments: Sequence[Segment], sums: Counter[str]) -> MicroBatch:
        if self.carry is None:
            return pad_batch(segments, self.pad_token_id)
        row = self.carry.next_row(segments)
        tokens = sum(s.length for s in row)
        sums["packing/rows"] += 1
        sums["packing/segments"] += len(row)
        sums["packing/tokens"] += tokens
        sums["packing/capacity"] += self.carry.capacity_tokens
        sums["packing/carry_depth_sum"] += len(self.carry)
        return pack_row(row)


def batch_weight(batch: MicroBatch) -> float:
    """Loss weight of a micro-batch (the first position of a row never carries loss)."""
    return float(batch["weights"][..., 1:].sum())


class WindowBuilder:
    """Builds :class:`Window`s: produce segments for the window, split them per micro-step, row them."""

    def __init__(self, *, producer: Producer, rows: RowBuilder, collectives: Collectives):
        self.producer = producer
        self.rows = rows
        self.collectives = collectives

    def build(self, raw_batches: Sequence[Sequence[Record]], global_step: int) -> Window:
        # One producer call for the whole window: rollouts batch across micro-steps (weights do not
        # change inside an accumulation window, so this equals per-micro-step rollouts).
        records = [r for batch in raw_batches for r in batch]
        produced = self.producer(records, global_step)
        sums = Counter(produced.sums)
        micro_batches: list[MicroBatch] = []
        start = 0
        for batch in raw_batches:
            segments = produced.segments[start : start + len(batch)]
            start += len(batch)
            micro_batches.append(self.rows.build(segments, sums))
        local_weight = sum(batch_weight(b) for b in micro_batches)
        sums["loss/weight"] += local_weight
        return Window(micro_batches, *self.reduce(sums, phase=f"window weights (step {global_step})"))

    def reduce(self, sums: Counter[str], phase: str) -> tuple[float, Counter[str]]:
        """Sum metric sums over ranks (one gather per optimizer step); returns (total weight, sums)."""
        gathered = self.collectives.all_gather_object(dict(sums), phase)
        total: Counter[str] = Counter()
        for rank_sums in gathered:
            total.update(rank_sums)
        return float(total["loss/weight"]), total
