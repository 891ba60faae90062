"""Trainer variants: each one is a :class:`~rollmatch.training.step.StepPlanner` assembled from parts.

- ``sft``: every step Channel-A (teacher forcing on the GT serialization).
- ``rollout_matching_sft``: every step Channel-B on the window's records (one rollout call per step),
  weights pushed to the rollout engine before each step that needs them.
- ``stage2_ab_training``: the ``b_ratio`` schedule; Channel-A, and Channel-B in the configured mode:
  ``micro`` (the window's records, rolled out in decode batches), ``step`` (a rollout budget per step,
  ``training.channel_b.step_mode``) or ``async`` (ready packs from a per-rank actor, ``training.channel_b.async_mode``).

Channel-A and Channel-B each get their own row planner (carry buffer), so no row mixes the two.
Leaves out: the config rules that refuse impossible combinations (``config.rules``, checked before this
runs) and the trainer loop (``training.trainer``).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rollmatch.collectives import Collectives, LocalCollectives
from rollmatch.config.resolved import ResolvedRun
from rollmatch.config.schema import RollmatchConfig
from rollmatch.data.prompts import PromptEncoder
from rollmatch.data.records import Record
from rollmatch.detection.codec import ObjectCodec
from rollmatch.rollout.build import build_backend
from rollmatch.rollout.types import Decoding, Rollout, RolloutBackend, RolloutRequest, SyncReport
from rollmatch.training.channel_b.actor import AdmissionSettings, RolloutActor
from rollmatch.training.channel_b.async_mode import AsyncPacks
from rollmatch.training.channel_b.ready_packs import ReadyPackQueue, VersionPurePacker
from rollmatch.training.channel_b.record_stream import RecordStream
from rollmatch.training.channel_b.step_mode import (
    StepRecordStream,
    StepRollouts,
    rank_share,
    rollouts_per_step,
)
from rollmatch.training.channel_modes import WindowRows
from rollmatch.training.offload import with_rollout_offload
from rollmatch.training.rollout_log import RolloutLog
from rollmatch.training.rows import RowPlanner
from rollmatch.training.segment_producers import GTSegmentProducer, RolloutSegmentProducer
from rollmatch.training.step import ABSchedule, Channel, ConstantSchedule, StepPlanner, SyncBeforeRollouts


@dataclass
class BuildContext:
    """Everything a variant may assemble from, built once by ``training.entry``."""

    run: ResolvedRun  # the run resolved at start-up (config.resolved): config, GAS, decodings, backends
    model: torch.nn.Module
    encoder: PromptEncoder
    codec: ObjectCodec
    collectives: Collectives
    train_records: list[Record] = field(default_factory=list)
    optimizer_getter: Callable[[], Any] = lambda: None
    rollout_log: RolloutLog | None = None  # rank 0 with training.log_rollouts_every > 0

    @property
    def cfg(self) -> RollmatchConfig:
        return self.run.config

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.run.gradient_accumulation_steps


@dataclass
class VariantParts:
    """The planner, the rollout backend (if any), and what the trainer checkpoints per rank."""

    planner: StepPlanner
    backend: RolloutBackend | None = None
    stateful: dict[str, Any] = field(default_factory=dict)  # name -> has state_dict / load_state_dict

    def close(self) -> None:
        """Channels first (async actors stop), then the backend (its weight-sync groups close)."""
        try:
            self.planner.close()
        finally:
            if self.backend is not None:
                self.backend.close()


def build_variant(ctx: BuildContext) -> VariantParts:
    return _VARIANTS[ctx.cfg.custom.trainer_variant](ctx)


def build_sft(ctx: BuildContext) -> VariantParts:
    channel_a = gt_rows(ctx)
    planner = StepPlanner(
        schedule=ConstantSchedule("A"),
        channel_a=channel_a,
        channel_b=None,
        sync=None,
        collectives=ctx.collectives,
        report_ab=False,
    )
    return VariantParts(planner=planner, stateful={"channel_a": channel_a})


def build_rollout_matching(ctx: BuildContext) -> VariantParts:
    backend = backend_for(ctx)
    rollouts = segment_producer(ctx, backend, ctx.run.rollout_decode_batch_size)  # None: one per micro-batch
    channel_b = WindowRows(rollouts.produce, row_planner(ctx), per_record=rollouts.rollouts_per_record)
    planner = StepPlanner(
        schedule=ConstantSchedule("B"),
        channel_a=None,
        channel_b=channel_b,
        sync=SyncBeforeRollouts(backend, ctx.model),
        collectives=ctx.collectives,
        report_ab=False,
        rollout_log=ctx.rollout_log,
    )
    return VariantParts(planner=planner, backend=backend, stateful={"channel_b": channel_b})


def build_stage2(ctx: BuildContext) -> VariantParts:
    cfg = ctx.cfg
    b_ratio = cfg.stage2_ab.schedule.b_ratio
    assert b_ratio is not None  # rule_b_ratio_required, checked when the run was resolved
    channel_a = gt_rows(ctx)
    backend = backend_for(ctx)
    mode = cfg.stage2_ab.channel_b.mode
    channel_b: Channel
    if mode == "async":
        channel_b = async_packs(ctx, backend)
        sync: Any = channel_b
    else:
        channel_b = step_rollouts(ctx, backend) if mode == "step" else micro_rollouts(ctx, backend)
        sync = SyncBeforeRollouts(backend, ctx.model)
    planner = StepPlanner(
        schedule=ABSchedule(float(b_ratio)),
        channel_a=channel_a,
        channel_b=channel_b,
        sync=sync,
        collectives=ctx.collectives,
        report_ab=True,
        rollout_log=ctx.rollout_log,
    )
    stateful = {"channel_a": channel_a}
    if mode != "step":  # step mode carries nothing between steps
        stateful["channel_b"] = channel_b
    return VariantParts(planner=planner, backend=backend, stateful=stateful)


# ----------------------------------------------------------------------------------------- parts
def row_planner(ctx: BuildContext, max_carry_age_steps: int | None = None) -> RowPlanner:
    t = ctx.cfg.training
    return RowPlanner(
        packing=t.packing,
        packing_length=t.global_max_length,
        carry_limit=t.carry_buffer_size,
        pad_token_id=ctx.encoder.pad_token_id,
        one_row_per_micro_step=ctx.collectives.world_size > 1,  # DDP lock-step: one pass per micro-step
        max_carry_age_steps=max_carry_age_steps,
    )


def gt_rows(ctx: BuildContext) -> WindowRows:
    return WindowRows(GTSegmentProducer(ctx.model, ctx.encoder, ctx.codec, ctx.cfg).produce, row_planner(ctx))


def backend_for(ctx: BuildContext) -> RolloutBackend:
    """The configured backend; colocated engines run each rollout phase inside the offload context."""
    backend = build_backend(
        ctx.run,
        model=ctx.model,
        tokenizer=ctx.encoder.tokenizer,
        processor=ctx.encoder.processor,
        collectives=ctx.collectives,
        eos_token_id=ctx.encoder.eos_token_id,
        pad_token_id=ctx.encoder.pad_token_id,
    )
    return with_rollout_offload(
        backend, ctx.cfg.rollout.offload, model=ctx.model, optimizer_getter=ctx.optimizer_getter
    )


def rollout_channel(ctx: BuildContext, backend: RolloutBackend) -> RolloutSegmentProducer:
    """Channel-B's rollout segment producer: records decoded in calls of the run's rollout decode batch
    (``custom.extra.rollout_matching.decode_batch_size``)."""
    return segment_producer(ctx, backend, ctx.run.rollout_decode_batch_size)


def segment_producer(
    ctx: BuildContext, backend: RolloutBackend, decode_batch_size: int | None
) -> RolloutSegmentProducer:
    """The rollout segment producer of the resolved run (``decode_batch_size`` None: one call for all)."""
    return RolloutSegmentProducer(
        ctx.model,
        ctx.encoder,
        ctx.codec,
        ctx.cfg,
        backend,
        decoding=ctx.run.decoding,
        decode_batch_size=decode_batch_size,
        rollout_log=ctx.rollout_log,
    )


def micro_rollouts(ctx: BuildContext, backend: RolloutBackend) -> WindowRows:
    channel = rollout_channel(ctx, backend)
    rows = row_planner(ctx, ctx.cfg.stage2_ab.channel_b.max_carry_age_steps)
    return WindowRows(channel.produce, rows, per_record=channel.rollouts_per_record)


def step_rollouts(ctx: BuildContext, backend: RolloutBackend) -> StepRollouts:
    """Channel-B step mode: this rank's budget share and its record stream."""
    cfg, world, rank = ctx.cfg, ctx.collectives.world_size, ctx.collectives.rank
    t, channel_b = cfg.training, cfg.stage2_ab.channel_b
    per_record = cfg.rollout.rollouts_per_record
    budget = rollouts_per_step(channel_b, t, world, ctx.gradient_accumulation_steps, per_record)
    share = rank_share(budget // per_record, rank, world)  # records: each brings per_record rollouts
    return StepRollouts(
        rollouts=rollout_channel(ctx, backend),
        rows=row_planner(ctx),
        records=StepRecordStream(ctx.train_records, share=share, seed=t.seed, rank=rank),
        batch_size=t.per_device_train_batch_size,
        pipeline=channel_b.enable_pipeline,
        wait_timeout_s=t.collective_timeout_s,
    )


def async_packs(ctx: BuildContext, backend: RolloutBackend) -> AsyncPacks:
    """Channel-B async mode: this rank's actor (own record stream and server client) and ready-pack queue."""
    cfg, rank = ctx.cfg, ctx.collectives.rank
    t, channel_b = cfg.training, cfg.stage2_ab.channel_b
    settings = channel_b.async_
    decode_batch = ctx.run.rollout_decode_batch_size
    assert decode_batch is not None  # stage2_ab_training resolves a batch (config.resolved)
    queue: ReadyPackQueue[Any] = ReadyPackQueue(settings.queue_limit)
    actor = RolloutActor(
        rollouts=rollout_channel(ctx, ActorRolloutClient(backend)),
        stream=RecordStream(ctx.train_records, rank=rank, world_size=ctx.collectives.world_size, seed=t.seed),
        queue=queue,
        packer=VersionPurePacker(
            length=lambda segment: segment.length,
            capacity=t.global_max_length if t.packing else None,
            batch_size=None if t.packing else t.per_device_train_batch_size,
        ),
        decode_batch_size=decode_batch,
        prefetch_target=settings.prefetch_target_packs,
        version_window=settings.version_window,
        training_seed=t.seed,
        rank=rank,
        admission=AdmissionSettings(
            sync_every_steps=settings.sync_every_steps,
            gradient_accumulation_steps=ctx.gradient_accumulation_steps,
            b_ratio=float(cfg.stage2_ab.schedule.b_ratio or 0.0),
        )
        if settings.admission_control
        else None,
    )
    return AsyncPacks(
        backend=backend,
        model=ctx.model,
        actor=actor,
        queue=queue,
        rows=row_planner(ctx),
        version_window=settings.version_window,
        sync_every_steps=settings.sync_every_steps,
        accounting_path=os.path.join(t.output_dir, "async", f"rank{rank}.json"),
        trace_path=os.path.join(t.output_dir, "async", f"rank{rank}.records.jsonl")
        if settings.record_trace
        else None,
        max_wait_s=settings.max_wait_s,
        actor_stop_timeout_s=settings.actor_stop_timeout_s,
    )


class ActorRolloutClient:
    """The actor's own client of the rollout servers: rollouts only, on HTTP sessions of its own.

    It never pushes weights and never closes the servers' weight-sync groups (the learner's backend owns
    them), so closing it only closes its sessions.
    """

    name = "vllm_server"

    def __init__(self, backend: RolloutBackend):
        from rollmatch.rollout.client import ServerBackend, ServerConnection

        if not isinstance(
            backend, ServerBackend
        ):  # rule_async (config.rules) refused any other at resolution
            raise TypeError(f"async actors roll out on rollout servers, got the {backend.name} backend")
        connections = [
            ServerConnection(c.url, c.group_port, timeout_s=c.timeout_s, infer_timeout_s=c.infer_timeout_s)
            for c in backend.connections
        ]
        self._client = ServerBackend(
            connections,
            collectives=LocalCollectives(),
            tokenizer=backend.tokenizer,
            image_wire=backend.image_wire,
            min_healthy=backend.pool.min_healthy,
            rotate_servers=backend.rotate_servers,
            first_server=backend.collectives.rank,  # with rotate_servers: the ranks' actors start apart
        )
        backend.followers.append(self._client.pool)  # the learner's push outcomes reach this client too

    @property
    def weight_version(self) -> int:
        raise RuntimeError("the actor's client does not track weights: rollouts carry the server's version")

    def generate(self, requests: list[RolloutRequest], decoding: Decoding, seed: int) -> list[Rollout]:
        return self._client.generate(requests, decoding, seed)

    def take_server_sums(self) -> Counter[str]:
        return self._client.take_server_sums()

    def sync_weights(self, model: Any, version: int) -> SyncReport:
        raise RuntimeError("the rollout actor never pushes weights; the learner's rank 0 does")

    def close(self) -> None:
        for connection in self._client.connections:
            connection.close()


_VARIANTS: dict[str, Callable[[BuildContext], VariantParts]] = {
    "sft": build_sft,
    "rollout_matching_sft": build_rollout_matching,
    "stage2_ab_training": build_stage2,
}
