"""Per-rank record streams of the async actors (pure): disjoint shards, determinism, exact resume."""

from __future__ import annotations

import pytest

from rollmatch.errors import DataError
from rollmatch.training.channel_b.record_stream import RecordStream, StreamLedger


def test_ranks_read_disjoint_shards_that_cover_every_record_each_pass() -> None:
    records = [f"r{i}" for i in range(10)]
    streams = [RecordStream(records, rank=rank, world_size=3, seed=7) for rank in range(3)]
    first_pass = [[record for _, record in s.take(len(s.shard))] for s in streams]
    assert sorted(r for shard in first_pass for r in shard) == sorted(records)
    assert all(len(set(a) & set(b)) == 0 for a in first_pass for b in first_pass if a is not b)
    again = RecordStream(records, rank=1, world_size=3, seed=7)
    assert [r for _, r in again.take(len(again.shard))] == first_pass[1]  # deterministic
    second = streams[1].take(len(streams[1].shard))  # the next pass: same records, a new order
    assert sorted(r for _, r in second) == sorted(first_pass[1])
    assert [p for p, _ in second] == list(range(len(again.shard), 2 * len(again.shard)))


def test_a_resumed_stream_neither_repeats_nor_skips_records() -> None:
    records = [f"r{i}" for i in range(6)]
    stream = RecordStream(records, rank=0, world_size=1, seed=0)
    taken = stream.take(6)
    # Trained (or dropped) out of order: 0, 1, 3 and 5 are done; 2 and 4 were still in the queue.
    stream.ledger.mark_done([0, 1, 3, 5])
    assert stream.ledger.state_dict() == {"frontier": 2, "done_ahead": [3, 5]}

    resumed = RecordStream(
        records, rank=0, world_size=1, seed=0, ledger=StreamLedger.from_state(stream.ledger.state_dict())
    )
    again = resumed.take(2)
    assert again == [taken[2], taken[4]]  # exactly the two records not done, in stream order
    assert resumed.take(1)[0][0] == 6  # then the next pass


def test_a_rank_without_records_is_a_clear_error() -> None:
    with pytest.raises(DataError, match="rank 2 of 3 gets no training records"):
        RecordStream(["a", "b"], rank=2, world_size=3, seed=0)
