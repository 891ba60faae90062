"""Ready packs of the async actor-learner (pure): version purity, drop-oldest, stale drops, accounting.

Segments here are plain token counts (the packer and the queue only need a length), so the semantics
are tested exhaustively without a model.
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollmatch.training.ready_packs import (
    ReadyPack,
    ReadyPackQueue,
    SegmentOrigin,
    VersionPurePacker,
    is_eligible,
)


def packer(capacity: int | None = 10, batch_size: int | None = None) -> VersionPurePacker[int]:
    return VersionPurePacker(length=lambda n: n, capacity=capacity, batch_size=batch_size)


def origin(i: int) -> SegmentOrigin:
    return SegmentOrigin(f"r{i}", i)


def pack(version: int, *lengths: int) -> ReadyPack[int]:
    return ReadyPack(
        version=version, segments=list(lengths), tokens=sum(lengths), origins=[origin(n) for n in lengths]
    )


def test_a_pack_is_taken_once_a_row_of_tokens_waits_and_fills_best() -> None:
    p = packer(capacity=10)
    assert p.add(6, origin(0), 1) == []
    assert p.add(3, origin(1), 1) == []  # 9 tokens wait: less than a row
    (first,) = p.add(4, origin(2), 1)  # 13 >= 10: the oldest (6) pinned, 4 fills the row exactly
    assert first.version == 1 and first.segments == [6, 4] and first.tokens == 10
    assert [o.stream_position for o in first.origins] == [0, 2]
    assert p.waiting == 1


def test_a_new_version_flushes_the_old_one_into_its_own_packs() -> None:
    p = packer(capacity=10)
    p.add(3, origin(0), 1)
    p.add(4, origin(1), 1)
    packs = p.add(5, origin(2), 2)  # version 2 arrives: v1's 3 + 4 leave together, 5 waits for v2
    assert [(q.version, q.segments) for q in packs] == [(1, [3, 4])]
    assert p.flush()[0].version == 2


def test_padded_mode_packs_batch_size_segments_in_arrival_order() -> None:
    p = packer(capacity=None, batch_size=2)
    assert p.add(7, origin(0), 0) == []
    (q,) = p.add(9, origin(1), 0)
    assert q.segments == [7, 9]
    with pytest.raises(ValueError, match="exactly one"):
        packer(capacity=10, batch_size=2)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 10), st.integers(0, 3)), max_size=60))
def test_packs_never_mix_versions_and_keep_every_segment_once(items: list[tuple[int, int]]) -> None:
    p = packer(capacity=10)
    packs: list[ReadyPack[int]] = []
    for position, (length, version) in enumerate(items):
        packs.extend(p.add(length, origin(position), version))
    packs.extend(p.flush())
    positions = sorted(o.stream_position for q in packs for o in q.origins)
    assert positions == list(range(len(items)))
    for q in packs:
        assert q.tokens == sum(q.segments) <= 10
        assert {items[o.stream_position][1] for o in q.origins} == {q.version}  # version-pure
    # Packs leave in version runs: a version never reappears after a newer one started (FIFO purity).
    assert p.waiting == 0


def test_queue_drops_the_oldest_when_full_and_counts_it() -> None:
    queue: ReadyPackQueue[int] = ReadyPackQueue(limit=2)
    for version in (0, 1, 2):
        queue.put(pack(version, 5))
    assert queue.versions() == [1, 2]
    assert queue.counts.produced == 3 and queue.counts.dropped_oldest == 1
    assert [o.stream_position for o in queue.take_dropped_origins()] == [5]
    assert queue.counts.balance(len(queue)) == 0


def test_stale_pack_under_version_window_one_is_dropped_counted_and_never_trained() -> None:
    queue: ReadyPackQueue[int] = ReadyPackQueue(limit=8)
    queue.put(pack(0, 3))  # stale at version 2 with window 1
    queue.put(pack(1, 4))
    queue.put(pack(2, 5))
    assert not is_eligible(0, 2, 1) and is_eligible(1, 2, 1)
    assert queue.eligible(2, 1) == 2
    taken = queue.take_eligible(2, current_version=2, version_window=1)
    assert [q.version for q in taken] == [1, 2]  # the stale one was dropped, not trained
    assert queue.counts.dropped_stale == 1 and queue.counts.trained == 2
    assert queue.counts.balance(len(queue)) == 0
    with pytest.raises(RuntimeError, match="eligible packs"):
        queue.take_eligible(1, current_version=2, version_window=1)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("put"), st.integers(0, 6)),
            st.tuples(st.just("take"), st.integers(0, 6)),
            st.tuples(st.just("stale"), st.integers(0, 6)),
        ),
        max_size=50,
    ),
    st.integers(1, 4),
    st.integers(0, 2),
)
def test_every_pack_produced_is_trained_or_counted_as_dropped(ops, limit, window) -> None:
    queue: ReadyPackQueue[int] = ReadyPackQueue(limit=limit)
    for op, version in ops:
        if op == "put":
            queue.put(pack(version, 1))
        elif op == "stale":
            queue.drop_stale(version, window)
        else:
            queue.drop_stale(version, window)
            if len(queue):
                queue.take_eligible(1, version, window)
        assert len(queue) <= limit
        assert queue.counts.balance(len(queue)) == 0
    queue.discard_all()
    assert len(queue) == 0 and queue.counts.balance(0) == 0


def test_a_waiting_producer_wakes_when_the_learner_takes() -> None:
    queue: ReadyPackQueue[int] = ReadyPackQueue(limit=4)
    queue.put(pack(0, 1))
    woke = threading.Event()

    def producer() -> None:
        queue.wait_for_change(timeout_s=10.0)
        woke.set()

    thread = threading.Thread(target=producer)
    thread.start()
    queue.take_eligible(1, 0, 0)
    thread.join(timeout=10.0)
    assert woke.is_set()
    with pytest.raises(ValueError, match="queue_limit"):
        ReadyPackQueue(limit=0)
