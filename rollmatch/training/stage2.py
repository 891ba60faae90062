"""``stage2_ab_training``: per optimizer step, Channel-A (GT teacher forcing) or Channel-B (rollouts).

Assembly, top to bottom: the schedule (``training.schedule``) picks the kind of each optimizer step,
rank 0 decides it and broadcasts it once per step, and the whole accumulation window then runs that
kind on every rank:

- Channel-A: :class:`~rollmatch.training.channels.GTChannel` segments, packed when
  ``training.packing`` is on, no rollouts and no weight sync;
- Channel-B ``micro``: rollout matching for the window's records, one packed row per micro-step;
- Channel-B ``step``: ``rollouts_per_step`` rollouts learned to completion on the last micro-step
  (``training.step_mode``).

Both B modes roll out in calls of ``stage2_ab.channel_b.rollout_decode_batch_size`` samples
(:class:`DecodeBatchedRollouts`), whatever the backend, and push weights to the rollout engine only
before B steps. A and B-micro share one packing carry buffer. Leaves out: the async actor-learner
(``channel_b.mode: async``) and the optimizer step (HF's loop).

Metrics (sums, see docs/stage2.md): ``stage2_ab/step_kind_b``, ``stage2_ab/b_ratio_realized``,
``stage2_ab/loss_{a,b}`` (mean over the steps of that channel), ``stage2_ab/micro_steps_{a,b}``
(micro-steps executed, all ranks) and ``stage2_ab/rollouts`` (rollouts per step, all ranks).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rollmatch.collectives import Collectives
from rollmatch.data.records import Record, load_records
from rollmatch.errors import ConfigError, ConfigProblem
from rollmatch.training.channels import ChannelOutput, GTChannel, RolloutChannel
from rollmatch.training.schedule import StepKind, fixed_size_chunks, realized_b_ratio, step_kind
from rollmatch.training.step_mode import (
    StepLearner,
    StepModeWindows,
    StepRecordStream,
    publish_sums,
    rank_share,
    rollouts_per_step,
)
from rollmatch.training.variants import (
    BuildContext,
    VariantParts,
    backend_for,
    row_builder,
    step_seed,
    weight_sync_hook,
)
from rollmatch.training.window import MicroBatch, Window, WindowBuilder, WindowFn

if TYPE_CHECKING:
    from collections.abc import Callable

    from rollmatch.training.trainer import RollmatchTrainer

log = logging.getLogger(__name__)
_CHANNEL_B = "stage2_ab.channel_b"


def build_stage2(ctx: BuildContext) -> VariantParts:
    """Assemble the stage2_ab_training variant from the config (see the module docstring)."""
    cfg = ctx.cfg
    channel_b = cfg.stage2_ab.channel_b
    b_ratio = _checked_b_ratio(ctx)
    rows = row_builder(ctx)
    gt = GTChannel(ctx.model, ctx.encoder, ctx.codec, ctx.cfg)
    channel_a = WindowBuilder(producer=gt.produce, rows=rows, collectives=ctx.collectives).build
    backend = backend_for(ctx)
    rollouts = DecodeBatchedRollouts(
        RolloutChannel(ctx.model, ctx.encoder, ctx.codec, ctx.cfg, backend),
        decode_batch_size=channel_b.rollout_decode_batch_size,
        training_seed=cfg.training.seed,
    )
    if channel_b.mode == "micro":
        micro = WindowBuilder(producer=rollouts.produce, rows=rows, collectives=ctx.collectives)
        channel_b_window: WindowFn = micro.build
    else:
        channel_b_window = step_mode_windows(ctx, rollouts).build
    windows = Stage2Windows(
        b_ratio=b_ratio,
        channel_a=channel_a,
        channel_b=channel_b_window,
        sync_weights=weight_sync_hook(backend, ctx.model),
        collectives=ctx.collectives,
    )
    return VariantParts(build_window=windows.build, backend=backend, closeables=[backend])


def step_mode_windows(ctx: BuildContext, rollouts: DecodeBatchedRollouts) -> StepModeWindows:
    """Channel-B step mode: this rank's budget share, its record stream and the B-loop learner."""
    cfg, world = ctx.cfg, ctx.collectives.world_size
    t, channel_b = cfg.training, cfg.stage2_ab.channel_b
    budget = rollouts_per_step(channel_b, t, world, ctx.gradient_accumulation_steps)
    share = rank_share(budget, ctx.collectives.rank, world)
    log.info("stage2_ab step mode: %d rollouts per optimizer step (%d on this rank)", budget, share)
    learner = StepLearner(
        produce_chunk=rollouts.chunk,
        decode_batch_size=channel_b.rollout_decode_batch_size,
        packing=t.packing,
        packing_length=t.global_max_length,
        batch_size=t.per_device_train_batch_size,
        pad_token_id=ctx.encoder.pad_token_id,
        pipeline=channel_b.enable_pipeline,
        wait_timeout_s=t.collective_timeout_s,
    )
    pool = load_records(cfg.data.train_jsonl, max_samples=cfg.data.max_samples)
    stream = StepRecordStream(pool, share=share, seed=t.seed, rank=ctx.collectives.rank)
    return StepModeWindows(learner=learner, records=stream)


class DecodeBatchedRollouts:
    """Rollout matching in backend calls of ``rollout_decode_batch_size`` samples each.

    The learner micro-batch (1 under packing) and the decode batch are independent: a window's
    records are split into contiguous chunks, each rolled out by one ``backend.generate`` call
    seeded with ``step_seed + chunk start``, so a step's rollouts do not depend on the chunking.
    """

    def __init__(self, channel: RolloutChannel, *, decode_batch_size: int, training_seed: int):
        self.channel = channel
        self.decode_batch_size = decode_batch_size
        self.training_seed = training_seed

    def chunk(self, records: Sequence[Record], global_step: int, start: int) -> ChannelOutput:
        """One rollout call for ``records``, the chunk starting at index ``start`` of the step."""
        return self.channel.produce(records, global_step, step_seed(self.training_seed, global_step) + start)

    def produce(self, records: Sequence[Record], global_step: int) -> ChannelOutput:
        """Every record of a window, chunk by chunk; segments in record order, sums added up."""
        merged = ChannelOutput(segments=[])
        for start, end in fixed_size_chunks(len(records), self.decode_batch_size):
            out = self.chunk(records[start:end], global_step, start)
            merged.segments.extend(out.segments)
            merged.sums.update(out.sums)
        return merged


class Stage2Windows:
    """The trainer's window function: decide the step's kind on rank 0, broadcast it, build that window."""

    def __init__(
        self,
        *,
        b_ratio: float,
        channel_a: WindowFn,
        channel_b: WindowFn,
        sync_weights: Callable[[int], None],
        collectives: Collectives,
    ):
        self.b_ratio = b_ratio
        self.channel_a = channel_a
        self.channel_b = channel_b
        self.sync_weights = sync_weights
        self.collectives = collectives

    def decide(self, global_step: int) -> StepKind:
        """The kind rank 0 computes for ``global_step``; every rank gets (and runs) the same one."""
        local = step_kind(global_step, self.b_ratio) if self.collectives.is_main else None
        return self.collectives.broadcast_object(local, f"stage2_ab step kind (step {global_step})")

    def build(self, raw_batches: Sequence[Sequence[Record]], global_step: int) -> Window:
        kind = self.decide(global_step)
        if kind == "B":
            self.sync_weights(global_step)  # A steps never roll out, so they never need fresh weights
            window = self.channel_b(raw_batches, global_step)
        else:
            window = self.channel_a(raw_batches, global_step)
        tally = _WindowTally(kind=kind, global_step=global_step, expected=len(window.micro_batches))
        window.micro_batches = [
            ChannelMicroStep(batch, window.total_weight, tally, self.collectives)
            if isinstance(batch, dict)
            else batch  # step mode: its micro-steps run and report themselves
            for batch in window.micro_batches
        ]
        window.sums["stage2_ab/step_kind_b"] += 1.0 if kind == "B" else 0.0
        window.sums["stage2_ab/b_ratio_realized"] += realized_b_ratio(global_step, self.b_ratio)
        if "rollout/count" in window.sums:
            window.sums["stage2_ab/rollouts"] += window.sums["rollout/count"]
        return window


@dataclass
class _WindowTally:
    """Losses and micro-steps executed in one window of one rank, reported after its last micro-step."""

    kind: StepKind
    global_step: int
    expected: int
    executed: int = 0
    loss: torch.Tensor | float = 0.0  # a detached device tensor once a micro-step ran (no host sync)


class ChannelMicroStep:
    """One A or B-micro micro-batch: HF's ordinary training step, plus per-channel loss accounting."""

    def __init__(self, batch: MicroBatch, total_weight: float, tally: _WindowTally, collectives: Collectives):
        self.batch = batch
        self.total_weight = total_weight
        self.tally = tally
        self.collectives = collectives

    def run(self, trainer: RollmatchTrainer, model: torch.nn.Module) -> torch.Tensor:
        weight = torch.tensor(self.total_weight, dtype=torch.float64, device=trainer.args.device)
        loss = trainer.training_step(model, self.batch, weight)
        tally = self.tally
        tally.executed += 1
        tally.loss = tally.loss + loss
        log.debug(
            "stage2_ab step %d micro-step %d/%d ran Channel-%s on rank %d",
            tally.global_step,
            tally.executed,
            tally.expected,
            tally.kind,
            self.collectives.rank,
        )
        if tally.executed == tally.expected:
            publish_sums(trainer, self._window_sums())
        return loss

    def _window_sums(self) -> Counter[str]:
        # Every rank runs the same number of micro-steps (DDP lock-step), so this reduce is aligned.
        tally, world = self.tally, self.collectives.world_size
        loss_sum, micro_steps = self.collectives.all_reduce_sum(
            [float(tally.loss), tally.executed], f"stage2_ab channel losses (step {tally.global_step})"
        )
        channel = tally.kind.lower()
        # Each rank's loss carries the world-size factor of DDP averaging: the step loss is the mean.
        return Counter(
            {
                f"stage2_ab/loss_{channel}_sum": loss_sum / world,
                f"stage2_ab/steps_{channel}_sum": 1.0,
                f"stage2_ab/micro_steps_{channel}": micro_steps,
            }
        )


def _checked_b_ratio(ctx: BuildContext) -> float:
    """``b_ratio``, after failing fast on what this variant cannot run (static rules: config.rules)."""
    cfg = ctx.cfg
    problems: list[ConfigProblem] = []
    b_ratio = cfg.stage2_ab.schedule.b_ratio
    if b_ratio is None:  # config.rules reports it at load; a config built in code skips that
        problems.append(
            ConfigProblem(
                "stage2_ab.schedule.b_ratio",
                None,
                "required by stage2_ab_training: the fraction of optimizer steps on Channel-B, a float in [0, 1]",
            )
        )
    mode = cfg.stage2_ab.channel_b.mode
    if mode == "async":
        problems.append(
            ConfigProblem(
                f"{_CHANNEL_B}.mode",
                "async",
                "the async actor-learner is not available in this build of stage2_ab_training; use "
                f"{_CHANNEL_B}.mode: micro (any world size) or step (one process)",
            )
        )
    if mode == "step" and cfg.training.deepspeed is not None:
        problems.append(
            ConfigProblem(
                "training.deepspeed",
                cfg.training.deepspeed,
                "step mode runs a variable number of backward passes inside one micro-step, which DeepSpeed's "
                f"accumulation bookkeeping cannot follow; unset training.deepspeed or use {_CHANNEL_B}.mode: micro",
            )
        )
    if problems:
        raise ConfigError(problems)
    return float(b_ratio)
