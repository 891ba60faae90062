"""The learner side of the async actor-learner on a tiny real model, in one process: the feasibility
gate, stale drops, one pack per micro-step, accounting, resume state, and an actor against a dead server."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from resolved_runs import producer
from thread_ranks import ThreadRanks, on_ranks

from rollmatch.collectives import LocalCollectives
from rollmatch.config.decoding import eval_decoding
from rollmatch.errors import BackendError
from rollmatch.rollout.hf import HFBackend
from rollmatch.training.channel_b.actor import RolloutActor
from rollmatch.training.channel_b.async_mode import AsyncPacks
from rollmatch.training.channel_b.ready_packs import (
    ReadyPack,
    ReadyPackQueue,
    SegmentOrigin,
    VersionPurePacker,
)
from rollmatch.training.channel_b.record_stream import RecordStream
from rollmatch.training.channel_modes import WindowRows
from rollmatch.training.periodic_eval import DetectionEval
from rollmatch.training.rows import RowPlanner
from rollmatch.training.segment_producers import GTSegmentProducer
from rollmatch.training.step import ABSchedule, StepPlanner


@pytest.fixture
def tiny(stage2_tiny: SimpleNamespace) -> SimpleNamespace:
    model, cfg, encoder, codec, records = (
        stage2_tiny.model,
        stage2_tiny.cfg,
        stage2_tiny.encoder,
        stage2_tiny.codec,
        stage2_tiny.records,
    )
    segments = GTSegmentProducer(model, encoder, codec, cfg).produce(records, 0).segments
    model.zero_grad(set_to_none=True)
    actors: list[RolloutActor] = []
    yield SimpleNamespace(
        model=model, cfg=cfg, encoder=encoder, codec=codec, records=records, segments=segments, actors=actors
    )
    for actor in actors:  # every step start starts the rank's actor; stop them all
        assert actor.stop(timeout_s=30.0)
    model.zero_grad(set_to_none=True)


def rows(tiny: SimpleNamespace) -> RowPlanner:
    return RowPlanner(
        packing=True, packing_length=1024, carry_limit=16, pad_token_id=tiny.encoder.pad_token_id
    )


def async_channel(
    tiny: SimpleNamespace,
    rollouts: Any = None,
    *,
    window: int = 1,
    limit: int = 8,
    max_wait_s: float = 0.0,
    in_process_actor: bool = False,
    sync_every_steps: int = 1,
) -> AsyncPacks:
    """Async Channel-B over an in-process HF backend. Without ``rollouts`` the actor stays idle (prefetch
    target 0: it never rolls out), so the test alone fills the queue; ``in_process_actor``: the actor rolls
    out on that same backend (its rollouts carry the version the learner last pushed to it)."""
    backend = HFBackend(
        tiny.model,
        tiny.encoder.tokenizer,
        eos_token_id=tiny.encoder.eos_token_id,
        pad_token_id=tiny.encoder.pad_token_id,
    )
    if in_process_actor:
        rollouts = producer(tiny, tiny.model, backend, 2)
    queue: ReadyPackQueue[Any] = ReadyPackQueue(limit)
    actor = RolloutActor(
        rollouts=rollouts,
        stream=RecordStream(tiny.records, rank=0, world_size=1, seed=0),
        queue=queue,
        packer=VersionPurePacker(length=lambda s: s.length, capacity=1024, batch_size=None),
        decode_batch_size=2,
        prefetch_target=2 if rollouts is not None else 0,
        version_window=window,
        training_seed=0,
        rank=0,
    )
    channel = AsyncPacks(
        backend=backend,
        model=tiny.model,
        actor=actor,
        queue=queue,
        rows=rows(tiny),
        version_window=window,
        sync_every_steps=sync_every_steps,
        accounting_path=None,
        max_wait_s=max_wait_s,
    )
    tiny.actors.append(actor)
    return channel


def planner(tiny: SimpleNamespace, channel_b: AsyncPacks) -> StepPlanner:
    return StepPlanner(
        schedule=ABSchedule(1.0),
        channel_a=WindowRows(
            GTSegmentProducer(tiny.model, tiny.encoder, tiny.codec, tiny.cfg).produce, rows(tiny)
        ),
        channel_b=channel_b,
        sync=channel_b,
        collectives=LocalCollectives(),
        report_ab=True,
    )


def ready_pack(tiny: SimpleNamespace, version: int, index: int) -> ReadyPack[Any]:
    segment = tiny.segments[index]
    return ReadyPack(
        version=version,
        segments=[segment],
        tokens=segment.length,
        origins=[SegmentOrigin(segment.sample_id, index)],
    )


def test_an_empty_queue_turns_a_wanted_b_step_into_channel_a(tiny, train_plan) -> None:
    plan = planner(tiny, async_channel(tiny)).plan([tiny.records[:1], tiny.records[1:2]], 0)
    assert plan.kind == "A"
    assert plan.sums["stage2_ab/async/b_step_skipped_due_to_queue"] == 1
    assert plan.sums["stage2_ab/step_kind_b"] == 0 and plan.sums["samples"] == 2  # GT targets trained
    assert plan.gauges["stage2_ab/async/queue_depth_max"] == 0
    assert torch.isfinite(train_plan(tiny.model, plan))


def test_a_stale_pack_is_dropped_and_b_trains_one_fresh_pack_per_micro_step(tiny, train_plan) -> None:
    channel = async_channel(tiny, window=1)
    for version, index in ((0, 0), (1, 1), (2, 2)):  # at step 2 (version 2, window 1) v0 is stale
        channel.queue.put(ready_pack(tiny, version, index))
    plan = planner(tiny, channel).plan([tiny.records[:1], tiny.records[1:2]], 2)
    assert plan.kind == "B"
    assert [len(m.rows) for m in plan.micro_steps] == [1, 1]  # exactly one packed row per micro-step
    trained = [m.rows[0]["input_ids"].shape[-1] for m in plan.micro_steps]
    assert trained == [tiny.segments[1].length, tiny.segments[2].length]  # never the stale v0 pack
    assert plan.gauges["stage2_ab/async/drop_stale_total"] == 1
    assert plan.gauges["stage2_ab/async/packs_trained_total"] == 0  # taken, not yet through backward
    assert plan.gauges["stage2_ab/async/ver_lag_max"] == 1 and plan.sums["stage2_ab/async/ver_lag_sum"] == 1
    assert channel.queue.counts.balance(len(channel.queue)) == 0
    assert channel.state_dict()["ledger"] == {"frontier": 3, "done_ahead": []}  # trained + dropped are done
    assert torch.isfinite(train_plan(tiny.model, plan))
    assert channel.queue.counts.trained == 2 and channel.queue.counts.balance(len(channel.queue)) == 0


def test_too_few_eligible_packs_run_a_and_keep_the_packs(tiny) -> None:
    channel = async_channel(tiny, window=0)
    channel.queue.put(ready_pack(tiny, 3, 0))
    plan = planner(tiny, channel).plan([tiny.records[:1], tiny.records[1:2]], 3)  # 1 pack for 2 micro-steps
    assert plan.kind == "A" and len(channel.queue) == 1


def test_a_b_step_waits_up_to_max_wait_s_for_its_packs(tiny) -> None:
    channel = async_channel(tiny, window=1, max_wait_s=30.0)
    # The gate: the pack is put only once the learner waits for it (the actor hears of the wait), so
    # the step found an empty queue and got its pack by waiting, however fast this machine is.
    learner_waits = threading.Event()
    set_step_waiting = channel.actor.set_step_waiting

    def heard(waiting: bool) -> None:
        if waiting:
            learner_waits.set()
        set_step_waiting(waiting)

    channel.actor.set_step_waiting = heard  # type: ignore[method-assign]
    put_while_waiting: list[bool] = []

    def late_producer() -> None:
        if learner_waits.wait(timeout=25):
            put_while_waiting.append(len(channel.queue) == 0)  # nothing was there when it began waiting
            channel.queue.put(ready_pack(tiny, 0, 0))

    producer = threading.Thread(target=late_producer)
    started = time.monotonic()
    producer.start()
    plan = planner(tiny, channel).plan([tiny.records[:1]], 0)
    producer.join(timeout=30)
    assert put_while_waiting == [True], "the step never waited for its pack (max_wait_s ignored)"
    assert plan.kind == "B" and time.monotonic() - started < 25
    assert plan.gauges["sync/version"] == 0  # the run's first push happened before the actor started
    assert channel.actor.started


def test_a_step_short_of_packs_trains_the_rollouts_waiting_in_the_packer(tiny) -> None:
    """Rollouts waiting in the actor's packer for a pack to fill would expire before the next step: a B
    step that lacks a pack flushes them into an under-filled pack of their version and trains it."""
    channel = async_channel(tiny, window=1)
    channel.queue.put(ready_pack(tiny, 1, 0))
    waiting = tiny.segments[1]
    assert channel.actor.packer.add(waiting, SegmentOrigin(waiting.sample_id, 1), 1) == []  # not full
    plan = planner(tiny, channel).plan([tiny.records[:1], tiny.records[1:2]], 2)
    assert plan.kind == "B" and channel.actor.packer.waiting == 0
    assert [m.rows[0]["input_ids"].shape[-1] for m in plan.micro_steps] == [
        tiny.segments[0].length,
        waiting.length,
    ]
    assert channel.queue.counts.balance(len(channel.queue)) == 0


def test_version_window_zero_is_on_policy_and_trains_every_b_step(tiny) -> None:
    """Push first, then judge freshness against the version the servers now hold: with window 0 every
    B step waits for rollouts of the weights it is about to update, and gets them."""
    channel = async_channel(tiny, window=0, max_wait_s=60.0, in_process_actor=True)
    steps = planner(tiny, channel)
    for step in range(3):
        plan = steps.plan([tiny.records[:1]], step)
        assert plan.kind == "B", f"step {step} ran A: {dict(plan.sums)}"
        assert plan.gauges["stage2_ab/async/ver"] == step
        assert (
            plan.gauges["stage2_ab/async/ver_lag_max"] == 0 and plan.sums["stage2_ab/async/ver_lag_sum"] == 0
        )
    assert plan.sums["stage2_ab/async/b_step_skipped_due_to_queue"] == 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.integers(0, 2),  # version_window
    st.integers(1, 3),  # sync_every_steps
    st.integers(1, 4),  # queue limit
    st.lists(
        st.one_of(
            st.tuples(st.just("arrive"), st.integers(0, 3)),  # a pack rolled out this many versions ago
            st.tuples(st.just("segment"), st.integers(0, 3)),  # a rollout waiting in the actor's packer
            st.tuples(st.just("step"), st.integers(1, 2)),  # an optimizer step of this many micro-steps
        ),
        max_size=24,
    ),
)
def test_no_trained_pack_ever_lags_beyond_the_window_in_the_whole_step_loop(
    tiny, window: int, sync_every: int, limit: int, ops: list[tuple[str, int]]
) -> None:
    """The planner, the sync policy and the queue together, over random orders of arrivals, steps and
    syncs (no waiting: max_wait_s 0, so no clock is involved): every trained pack's lag is within the
    window, ``ver`` is the version the step trains, every B step trains one pack per micro-step, and
    every pack is accounted for."""
    channel = async_channel(tiny, window=window, limit=limit, sync_every_steps=sync_every)
    steps, step = planner(tiny, channel), 0
    for op, value in ops:
        if op == "arrive":  # rolled out under a version the servers held at most `value` pushes ago
            version = max(channel.backend.weight_version - value, 0)
            channel.queue.put(ready_pack(tiny, version, step % len(tiny.segments)))
            continue
        if op == "segment":  # a B step that lacks packs flushes these into its own
            version = max(channel.backend.weight_version - value, 0)
            segment = tiny.segments[step % len(tiny.segments)]
            for pack in channel.actor.packer.add(segment, SegmentOrigin(segment.sample_id, step), version):
                channel.queue.put(pack)
            continue
        plan = steps.plan([tiny.records[:1]] * value, step)
        assert plan.gauges["stage2_ab/async/ver"] == step // sync_every == channel.backend.weight_version
        if plan.kind == "B":
            assert [len(m.rows) for m in plan.micro_steps] == [1] * value
            assert plan.gauges["stage2_ab/async/ver_lag_max"] <= window
        for micro in plan.micro_steps:
            micro.finish(tiny.model, torch.zeros(()))  # marks the micro-step's pack trained
        assert channel.queue.counts.balance(len(channel.queue)) == 0
        step += 1
    channel.queue.discard_all()
    assert channel.queue.counts.balance(0) == 0


def test_a_one_rank_failure_in_take_reaches_the_other_rank_in_the_same_step(tiny, tmp_path) -> None:
    """Two ranks each reserve their packs and vote B; rank 1 then fails in ``take`` (its record trace
    cannot be written: a directory stands at its path). Rank 1 still joins the step's gather with its
    error, so both raise there, at once, instead of rank 0 waiting out the collective timeout."""
    blocked = tmp_path / "trace-is-a-directory"
    blocked.mkdir()

    def plan_on(collectives: ThreadRanks) -> tuple[str, Any]:
        channel = async_channel(tiny, window=0)
        if collectives.rank == 1:
            channel.trace_path = str(blocked)
        for index in range(2):
            channel.queue.put(ready_pack(tiny, 0, 2 * index + collectives.rank))
        steps = StepPlanner(
            schedule=ABSchedule(1.0),
            channel_a=None,
            channel_b=channel,
            sync=channel,
            collectives=collectives,
            report_ab=True,
        )
        try:
            steps.plan([tiny.records[:1], tiny.records[1:2]], 0)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}", channel
        return "no error", channel

    started = time.monotonic()
    (rank0, channel0), (rank1, channel1) = on_ranks(2, plan_on)
    assert rank1.startswith("IsADirectoryError") and str(blocked) in rank1
    assert rank0.startswith("BackendError") and f"rank 1: {rank1}" in rank0, rank0
    assert time.monotonic() - started < 30
    for channel in (channel0, channel1):  # both voted B on reserved packs and took them
        assert channel.queue.counts.produced == 2 and channel.queue.eligible(0, 0) == 0
        channel.queue.discard_all()  # shutdown: the taken packs were never trained, so they are discarded
        assert channel.queue.counts.discarded == 2 and channel.queue.counts.balance(0) == 0


def test_a_step_the_schedule_wants_on_channel_a_never_waits(tiny) -> None:
    channel = async_channel(tiny, max_wait_s=30.0)
    plan_a = StepPlanner(
        schedule=ABSchedule(0.5),  # step 0 wants A
        channel_a=WindowRows(
            GTSegmentProducer(tiny.model, tiny.encoder, tiny.codec, tiny.cfg).produce, rows(tiny)
        ),
        channel_b=channel,
        sync=channel,
        collectives=LocalCollectives(),
        report_ab=True,
    )
    started = time.monotonic()
    assert plan_a.plan([tiny.records[:1]], 0).kind == "A"
    assert time.monotonic() - started < 20  # the empty queue was not waited for


def test_an_actor_that_cannot_reach_its_server_fails_the_step_naming_the_url(tiny, free_port) -> None:
    from rollmatch.rollout.client import ServerBackend, ServerConnection

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    client = ServerBackend(
        [ServerConnection(url, 1, timeout_s=5.0, infer_timeout_s=None)],
        collectives=LocalCollectives(),
        tokenizer=tiny.encoder.tokenizer,
    )
    rollouts = producer(tiny, tiny.model, client, 2)
    channel = async_channel(tiny, rollouts)
    channel.actor.start()
    deadline = time.monotonic() + 60.0
    while channel.actor.failure is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert channel.actor.stop(timeout_s=10.0)  # the thread ended with its first (failed) call
    assert channel.actor.failure is not None and url in channel.actor.failure
    with pytest.raises(BackendError, match=rf"rank 0: rollout actor: .*{url}"):
        planner(tiny, channel).plan([tiny.records[:1]], 0)


def test_periodic_evaluation_scores_the_current_weights_between_pushes(tiny, train_plan) -> None:
    """``sync_every_steps: 2``: step 2 pushes the weights after 2 optimizer steps (version 1) and step 3
    pushes nothing; an evaluation after step 3 must still score the weights after 3 steps, not those
    the step loop last pushed, and leave the actor's step where the loop put it."""
    channel = async_channel(tiny, window=1, sync_every_steps=2)
    plans = planner(tiny, channel)
    windows = [tiny.records[:1], tiny.records[1:2]]
    for step in (2, 3):  # a resumed run at step 2: its first step pushes, and starts the actor
        assert torch.isfinite(train_plan(tiny.model, plans.plan(windows, step)))
    assert channel.ver == 1 and channel.weights_step == 2  # step 3 trained version 1: no push
    evaluation = DetectionEval(
        cfg=tiny.cfg,
        decoding=eval_decoding(tiny.cfg),
        backend=channel.backend,
        sync=channel,
        encoder=tiny.encoder,
        codec=tiny.codec,
        records=tiny.records[:1],
        collectives=LocalCollectives(),
    )
    round_ = evaluation.run(4)  # after 4 optimizer steps: step 4 of version 2 is next
    assert round_.sync is not None and round_.sync.version == 2  # pushed: what step 4 would push
    assert channel.weights_step == 4
    assert evaluation.run(4).sync is None  # the servers hold these weights now: no second push

    plan = plans.plan(windows, 4)  # the loop goes on: version 2 is served, so step 4 pushes nothing
    assert "sync/pushes" not in plan.sums
    assert torch.isfinite(train_plan(tiny.model, plan))
    next_step = channel.actor.next_step

    round_ = evaluation.run(5)  # within version 2: the step loop would not push, the evaluation must
    assert round_.sync is not None and round_.sync.version == 2 and channel.weights_step == 5
    assert round_.metrics["eval/weight_version"] == 2.0
    assert channel.actor.next_step == next_step  # the actor's step is the loop's, not the evaluation's


def test_the_warning_signal_ends_a_max_wait_s_wait_within_one_slice(tiny, monkeypatch, caplog) -> None:
    """SIGUSR1 (Slurm's warning) sent from inside the first wait slice of a step that wants B and has no
    pack (the actor is idle, max_wait_s 300): the wait ends after that one slice, so the checkpoint at
    this step's end is not held up by max_wait_s."""
    import os
    import signal

    from rollmatch.training import preemption

    channel = async_channel(tiny, window=1, max_wait_s=300.0)
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: None)  # never the default (fatal) action
    preemption.install_warning_handler()
    wait = channel.queue.wait_for_change
    slices: list[float] = []

    def wait_then_warn(timeout: float) -> Any:
        if threading.current_thread() is threading.main_thread():  # the step's wait (the actor waits too)
            slices.append(timeout)
            if len(slices) == 1:
                os.kill(os.getpid(), signal.SIGUSR1)
        return wait(timeout)

    monkeypatch.setattr(channel.queue, "wait_for_change", wait_then_warn)
    try:
        started = time.monotonic()
        plan = planner(tiny, channel).plan([tiny.records[:1]], 0)
        elapsed = time.monotonic() - started
    finally:
        signal.signal(signal.SIGUSR1, previous)
        preemption._RECEIVED.clear()
    assert plan.kind == "A"  # no pack came: the step trains Channel-A, then the step-end vote checkpoints
    assert len(slices) == 1, slices  # one slice after the signal, not 600 of them
    assert "stopped waiting for Channel-B packs" in caplog.text
    assert elapsed < 30  # a tenth of max_wait_s
