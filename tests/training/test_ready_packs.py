"""Ready packs of the async actor-learner (pure): version purity, drop-oldest, stale drops, accounting.

Segments here are plain token counts (the packer and the queue only need a length), so the semantics
are tested exhaustively without a model.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollmatch.training.channel_b.ready_packs import (
    ReadyPack,
    ReadyPackQueue,
    SegmentOrigin,
    VersionPurePacker,
    admission_room,
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


def test_a_stale_pack_put_into_a_full_queue_is_dropped_itself_not_the_oldest_fresh_pack() -> None:
    queue: ReadyPackQueue[int] = ReadyPackQueue(limit=2)
    queue.put(pack(3, 0))
    queue.put(pack(3, 1))
    queue.put(pack(1, 2))  # late rollouts of an older version (a server that reported v1 mid-sync)
    assert [p.origins[0].stream_position for p in queue.take_reserved(0)] == []
    assert queue.versions() == [3, 3]
    assert [o.stream_position for o in queue.take_dropped_origins()] == [2]
    assert queue.counts.dropped_oldest == 1 and queue.counts.balance(len(queue)) == 0


def test_queue_depth_counts_reserved_and_in_training_packs_against_the_limit() -> None:
    queue: ReadyPackQueue[int] = ReadyPackQueue(limit=3)
    for position in range(3):
        queue.put(pack(2, position))
    assert queue.reserve(2, current_version=2, version_window=0) == 2
    queue.take_reserved(1)  # one pack in training, one reserved, one queued: the queue is full
    assert len(queue) == 3
    for position in range(3, 6):  # the actor keeps producing while the step trains
        queue.put(pack(2, position))
        assert len(queue) <= 3
    assert queue.free == 0  # the actor paces on it
    assert queue.versions() == [2]  # only the newest queued pack is left beside the two held ones
    assert queue.counts.dropped_oldest == 3 and queue.counts.balance(len(queue)) == 0
    queue.mark_trained(1)
    assert queue.free == 1


def test_stale_pack_under_version_window_one_is_dropped_counted_and_never_trained() -> None:
    queue: ReadyPackQueue[int] = ReadyPackQueue(limit=8)
    queue.put(pack(0, 3))  # stale at version 2 with window 1
    queue.put(pack(1, 4))
    queue.put(pack(2, 5))
    assert not is_eligible(0, 2, 1) and is_eligible(1, 2, 1)
    assert queue.eligible(2, 1) == 2
    assert queue.reserve(2, current_version=2, version_window=1) == 2
    taken = queue.take_reserved(2)
    assert [q.version for q in taken] == [1, 2]  # the stale one was dropped, not trained
    assert queue.counts.trained == 0 and len(queue) == 2  # taken: trained once the backward pass ran
    queue.mark_trained(2)
    assert queue.counts.dropped_stale == 1 and queue.counts.trained == 2 and len(queue) == 0
    assert queue.counts.rollouts["trained"] == 2 and queue.counts.rollouts["dropped_stale"] == 1
    assert queue.counts.balance(len(queue)) == 0
    with pytest.raises(RuntimeError, match="reserve before the vote"):
        queue.take_reserved(1)


def test_reserved_packs_survive_a_stale_pack_put_into_a_full_queue_before_take() -> None:
    """The race of a step's vote and its take: the actor fills the queue in between."""
    queue: ReadyPackQueue[int] = ReadyPackQueue(limit=2)
    queue.put(pack(3, 0))
    queue.put(pack(3, 1))
    assert queue.reserve(2, current_version=3, version_window=0) == 2  # the vote counted these two
    for position in (2, 3, 4):  # late rollouts of an older version arrive and overflow the queue
        queue.put(pack(2, position))
    taken = queue.take_reserved(2)  # no error: the reserved packs were never evicted
    assert [p.origins[0].stream_position for p in taken] == [0, 1]
    # The two reserved packs fill the limit: each late pack is dropped itself.
    assert queue.counts.dropped_oldest == 3 and queue.counts.balance(len(queue)) == 0


def test_packs_reserved_for_a_step_that_ran_a_go_back_in_front() -> None:
    queue: ReadyPackQueue[int] = ReadyPackQueue(limit=2)
    queue.put(pack(1, 0))
    assert queue.reserve(2, current_version=1, version_window=0) == 1  # too few: the step runs A
    queue.put(pack(1, 1))
    queue.put(pack(1, 2))  # the reserved pack counts against the limit and cannot be evicted: 1 goes
    queue.unreserve()  # the next step: the reserved pack is the oldest again; the limit still holds
    assert [p.origins[0].stream_position for p in queue.take_reserved(0)] == []
    assert queue.reserve(2, 1, 0) == 2 and [p.origins[0].stream_position for p in queue.take_reserved(2)] == [
        0,
        2,
    ]
    assert queue.counts.dropped_oldest == 1 and queue.counts.balance(len(queue)) == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("put"), st.integers(0, 3)),  # a pack made this many versions ago
            st.tuples(st.just("step"), st.integers(0, 2)),  # reserve for a step of this many micro-steps
            st.tuples(st.just("sync"), st.integers(1, 2)),  # the servers move on by this many versions
        ),
        max_size=60,
    ),
    st.integers(1, 4),
    st.integers(0, 2),
)
def test_every_pack_is_accounted_for_and_no_trained_pack_lags_beyond_the_window(ops, limit, window) -> None:
    queue: ReadyPackQueue[int] = ReadyPackQueue(limit=limit)
    version = 0
    for op, value in ops:
        if op == "put":
            queue.put(pack(max(version - value, 0), 1))
        elif op == "sync":
            version += value
        else:
            queue.unreserve()
            if queue.reserve(value, version, window) >= value:
                for taken in queue.take_reserved(value):
                    assert version - taken.version <= window
                queue.mark_trained(value)
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
    queue.reserve(1, 0, 0)
    queue.take_reserved(1)
    thread.join(timeout=10.0)
    assert woke.is_set()
    with pytest.raises(ValueError, match="queue_limit"):
        ReadyPackQueue(limit=0)


def room(
    held: int, version: int, next_step: int, window: int, every: int = 1, gas: int = 2, b_ratio: float = 1.0
) -> int:
    return admission_room(
        held=held,
        current_version=version,
        next_step=next_step,
        version_window=window,
        sync_every_steps=every,
        gradient_accumulation_steps=gas,
        b_ratio=b_ratio,
    )


def test_admission_starts_only_rollouts_whose_packs_will_still_be_eligible() -> None:
    def admits(**kwargs: Any) -> bool:
        return room(**kwargs) >= 1

    # On-policy (window 0, a push every step): at step 5's start (servers at v5) roll out for step 5;
    # once step 5 took its packs, anything started before the push of v6 would arrive stale.
    assert admits(held=0, version=5, next_step=5, window=0) and admits(
        held=1, version=5, next_step=5, window=0
    )
    assert not admits(held=2, version=5, next_step=5, window=0)
    assert not admits(held=0, version=5, next_step=6, window=0)
    # Window 1: keep one step's packs ahead while the learner trains, never two.
    assert admits(held=0, version=5, next_step=6, window=1) and admits(
        held=1, version=5, next_step=6, window=1
    )
    assert not admits(held=2, version=5, next_step=6, window=1)
    # A push every 4 steps: packs stay eligible across the steps that share a version.
    assert admits(held=4, version=1, next_step=5, window=0, every=4)
    assert not admits(held=6, version=1, next_step=5, window=0, every=4)
    # b_ratio 0.5 with GAS 2: step 6 runs Channel-A, so nothing started during step 5 will be taken
    # before it is stale; step 5 is B and takes two.
    assert not admits(held=0, version=5, next_step=6, window=1, b_ratio=0.5)
    assert room(held=0, version=4, next_step=5, window=1, b_ratio=0.5) == 2


def test_admission_room_is_what_the_steps_within_the_window_still_take() -> None:
    # Window 1, a push every step, 4 packs a step: during step 5 (servers at v5, next step 6) the
    # actor may fill step 6 only; with 3 held, one more pack (a short batch), not a whole batch.
    assert room(held=0, version=5, next_step=6, window=1, gas=4) == 4
    assert room(held=3, version=5, next_step=6, window=1, gas=4) == 1
    assert room(held=4, version=5, next_step=6, window=1, gas=4) == 0
    # Before step 5 took its packs, steps 5 and 6 both may take them.
    assert room(held=4, version=5, next_step=5, window=1, gas=4) == 4
    # The version moved past what the next step trains: nothing more may start.
    assert room(held=0, version=5, next_step=7, window=0, gas=4) <= 0
    # A push every 4 steps, window 0: the steps 4-7 of v1 share it.
    assert room(held=2, version=1, next_step=5, window=0, every=4) == 4
    # b_ratio 0.5, GAS 2: a B step's whole need counts, not the average of one pack a step. During
    # step 4 (next step 5, a B step) the actor may fill both of step 5's micro-steps.
    assert [room(held=0, version=4, next_step=s, window=1, b_ratio=0.5) for s in (5, 6)] == [2, 0]


def test_a_pack_from_a_version_above_the_learners_is_dropped_and_never_trained() -> None:
    """A server still at a version of a run the learner resumed behind answers with a version above the
    learner's: its pack would pass the window with a negative lag; it is dropped like a stale one."""
    queue: ReadyPackQueue[int] = ReadyPackQueue(limit=8)
    queue.put(pack(7, 3))  # from the future: the learner is at version 2
    queue.put(pack(2, 4))
    assert not is_eligible(7, 2, 1) and is_eligible(2, 2, 1) and is_eligible(1, 2, 1)
    assert queue.eligible(2, 1) == 1
    assert queue.reserve(2, current_version=2, version_window=1) == 1
    assert [p.version for p in queue.take_reserved(1)] == [2]
    assert queue.counts.dropped_stale == 1 and queue.counts.balance(len(queue)) == 0


def test_the_ready_count_leaves_out_the_packs_a_step_trains() -> None:
    """``async/queue_depth`` reports packs waiting to be trained, not the ones the step took."""
    queue: ReadyPackQueue[int] = ReadyPackQueue(limit=8)
    for n in (1, 2, 3):
        queue.put(pack(0, n))
    queue.reserve(2, current_version=0, version_window=0)
    queue.take_reserved(1)
    assert len(queue) == 3 and queue.ready == 2  # one in training, one reserved, one queued
    queue.mark_trained(1)
    assert len(queue) == 2 and queue.ready == 2
