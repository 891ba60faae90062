"""Per-rank record streams the learner owns: deterministic, endless, resumable (pure, no torch).

Owns: :func:`stream_permutation` (one seeded permutation per pass over a rank's records),
:class:`RecordStream` (the async actor's source: the rank's shard of the training records, pass after
pass, read in order) with :class:`StreamLedger` (which stream positions were trained or dropped, so a
resumed run neither repeats nor skips a record), and :func:`extra_record_indices` (Channel-B step mode:
records a step tops its rollout budget up with, positioned by the optimizer step).
Leaves out: what is done with the records (``training.channel_b.actor``, ``training.channel_b.step_mode``).

A rank's shard is ``records[rank::world_size]`` (every record belongs to exactly one rank); pass ``p``
reads it in the order of ``stream_permutation(seed, rank, p, len(shard))``. Stream position ``n`` is
record ``n % len(shard)`` of pass ``n // len(shard)``.
"""

from __future__ import annotations

import functools
import random
import threading
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

from rollmatch.errors import DataError

R = TypeVar("R")


@functools.lru_cache(maxsize=8)  # consecutive reads stay in the same pass (or two)
def stream_permutation(seed: int, rank: int, epoch: int, num_records: int) -> tuple[int, ...]:
    """The order of pass ``epoch`` over ``num_records`` records of ``rank`` (seeded, deterministic)."""
    order = list(range(num_records))
    random.Random(f"rollmatch-step-records:{seed}:{rank}:{epoch}").shuffle(order)
    return tuple(order)


def extra_record_indices(
    global_step: int, count: int, *, stride: int, num_records: int, seed: int, rank: int
) -> list[int]:
    """Indices of the ``count`` records a step-mode step tops its budget up with, from a per-rank stream.

    Step ``s`` reads stream positions ``s * stride ..`` (``stride`` = the per-step share, an upper bound
    of ``count``), so a step's extra records depend only on the step: resume reproduces them.
    """
    if num_records <= 0:
        raise DataError(
            "step mode needs training records to top up its rollout budget; data.train_jsonl is empty"
        )
    start = global_step * stride
    indices = []
    for position in range(start, start + count):
        epoch, offset = divmod(position, num_records)
        indices.append(stream_permutation(seed, rank, epoch, num_records)[offset])
    return indices


class StreamLedger:
    """Which stream positions are done (trained, or dropped and counted); thread-safe.

    ``frontier`` is the first position not yet done; ``done_ahead`` the done positions beyond it
    (packs are trained out of production order). Saving both lets a resumed stream restart at the
    frontier and skip exactly the positions already done.
    """

    def __init__(self, frontier: int = 0, done_ahead: Sequence[int] = ()):
        self._lock = threading.Lock()
        self.frontier = frontier
        self._ahead = {p for p in done_ahead if p >= frontier}
        self._advance()

    def mark_done(self, positions: Sequence[int]) -> None:
        with self._lock:
            self._ahead.update(p for p in positions if p >= self.frontier)
            self._advance()

    def is_done(self, position: int) -> bool:
        with self._lock:
            return position < self.frontier or position in self._ahead

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"frontier": self.frontier, "done_ahead": sorted(self._ahead)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> StreamLedger:
        return cls(int(state["frontier"]), [int(p) for p in state["done_ahead"]])

    def _advance(self) -> None:
        while self.frontier in self._ahead:
            self._ahead.discard(self.frontier)
            self.frontier += 1


class RecordStream(Generic[R]):
    """This rank's endless, seeded stream over its shard of ``records`` (read by one actor thread)."""

    def __init__(
        self,
        records: Sequence[R],
        *,
        rank: int,
        world_size: int,
        seed: int,
        ledger: StreamLedger | None = None,
    ):
        self.shard = list(records[rank::world_size])
        if not self.shard:
            raise DataError(
                f"rank {rank} of {world_size} gets no training records for its rollout actor: data.train_jsonl "
                f"has {len(records)} record(s); use at least as many records as learner ranks"
            )
        self.rank = rank
        self.seed = seed
        self.ledger = ledger or StreamLedger()
        self.position = self.ledger.frontier  # next position to read

    def take(self, count: int) -> list[tuple[int, R]]:
        """The next ``count`` (stream position, record) pairs, skipping positions already done."""
        taken: list[tuple[int, R]] = []
        while len(taken) < count:
            position = self.position
            self.position += 1
            if self.ledger.is_done(position):
                continue
            epoch, offset = divmod(position, len(self.shard))
            index = stream_permutation(self.seed, self.rank, epoch, len(self.shard))[offset]
            taken.append((position, self.shard[index]))
        return taken
