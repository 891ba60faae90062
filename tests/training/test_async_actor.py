"""The rollout actor and the learner's wait together, model-free: segments are fixed token counts from a
stand-in for the rollout servers (it reports the version it holds, as a server does), so the admission
and packing logic runs exactly as in a run, on the real actor thread and the real ready-pack queue."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from rollmatch.data.records import Record
from rollmatch.rollout.types import SyncReport
from rollmatch.training.channel_b.actor import AdmissionSettings, RolloutActor
from rollmatch.training.channel_b.async_mode import AsyncPacks
from rollmatch.training.channel_b.ready_packs import ReadyPackQueue, VersionPurePacker
from rollmatch.training.channel_b.record_stream import RecordStream
from rollmatch.training.rows import RowPlanner
from rollmatch.training.schedule import step_kind
from rollmatch.training.segment_producers import ChannelOutput

CAPACITY = 1024  # tokens per pack (training.global_max_length)
SEGMENT_TOKENS = 400  # two segments fill a pack to 800 tokens, a third does not fit


@dataclass(frozen=True)
class TokenCount:
    """A segment as the packer sees it: its length."""

    length: int


class ServersAt:
    """The version the rollout servers hold: a push sets it (no weights travel here)."""

    def __init__(self) -> None:
        self.weight_version = 0

    def sync_weights(self, model: Any, version: int) -> SyncReport:
        self.weight_version = version
        return SyncReport(version=version, num_bytes=0, seconds=0.0, mode="full")

    def close(self) -> None:
        return None


class FixedLengthRollouts:
    """One segment of ``SEGMENT_TOKENS`` per record, ``delay_s`` after the call, tagged with the version
    the servers hold when it returns."""

    rollouts_per_record = 1

    def __init__(self, servers: ServersAt, delay_s: float):
        self.backend = servers
        self.delay_s = delay_s

    def roll_out(self, records: list[Record], *, seed: int, created_step: int) -> ChannelOutput:
        time.sleep(self.delay_s)
        version = self.backend.weight_version
        return ChannelOutput(
            segments=[TokenCount(SEGMENT_TOKENS) for _ in records],  # type: ignore[misc]
            sums=Counter({"rollout/count": len(records)}),
            versions=[version] * len(records),
        )


def async_packs(*, window: int, b_ratio: float, gas: int, max_wait_s: float) -> AsyncPacks:
    servers = ServersAt()
    records = [Record(id=f"r{i}", images=("unused.png",), width=1, height=1) for i in range(64)]
    queue: ReadyPackQueue[Any] = ReadyPackQueue(8)
    actor = RolloutActor(
        rollouts=FixedLengthRollouts(servers, delay_s=0.2),  # type: ignore[arg-type]
        stream=RecordStream(records, rank=0, world_size=1, seed=0),
        queue=queue,
        packer=VersionPurePacker(length=lambda s: s.length, capacity=CAPACITY, batch_size=None),
        decode_batch_size=2,
        prefetch_target=max(2, gas),
        version_window=window,
        training_seed=0,
        rank=0,
        admission=AdmissionSettings(sync_every_steps=1, gradient_accumulation_steps=gas, b_ratio=b_ratio),
    )
    return AsyncPacks(
        backend=servers,  # type: ignore[arg-type]
        model=torch.nn.Linear(1, 1),
        actor=actor,
        queue=queue,
        rows=RowPlanner(packing=True, packing_length=CAPACITY, carry_limit=16, pad_token_id=0),
        version_window=window,
        sync_every_steps=1,
        accounting_path=None,
        max_wait_s=max_wait_s,
    )


# window 0 (on-policy) under the defaults: every pack of step s must be made during its wait. Window 1
# with b_ratio 0.5: no later B step in the window either, so a B step's packs must be finished during
# its wait too. Both stalled while the partial pack counted against the actor's admission room.
@pytest.mark.parametrize(("window", "b_ratio", "gas"), [(0, 1.0, 1), (1, 0.5, 2)])
def test_a_b_step_gets_its_packs_within_its_wait_when_the_last_one_is_partial(
    window: int, b_ratio: float, gas: int
) -> None:
    max_wait_s = 15.0
    channel = async_packs(window=window, b_ratio=b_ratio, gas=gas, max_wait_s=max_wait_s)
    try:
        for step in range(4):
            channel.before_step(step, None)
            wants_b = step_kind(step, b_ratio) == "B"
            started = time.monotonic()
            status = channel.reserve_for_step(step, gas, wants_b=wants_b)
            waited = time.monotonic() - started
            assert status.failure is None
            if wants_b:
                assert status.ready == gas, f"step {step}: {status.ready} of {gas} packs after {waited:.1f}s"
                assert waited < max_wait_s - 5  # well within the wait, not at its end
                packs = channel.queue.take_reserved(gas)
                assert all(channel.ver - p.version <= window for p in packs)
                channel.queue.mark_trained(gas)
            channel.finish_step(step)
        assert channel.queue.counts.trained == gas * sum(step_kind(s, b_ratio) == "B" for s in range(4))
    finally:
        channel.close()
    assert channel.queue.counts.balance(0) == 0
