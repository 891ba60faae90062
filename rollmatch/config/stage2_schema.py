"""The ``stage2_ab`` section of the schema: the A/B schedule and Channel-B (micro, step or async mode,
the async actor-learner's queue).

Owns the pydantic models; every key's default and description lives here once. Leaves out: the rules
across them (``config.rollout_rules``, ``config.wait_rules``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from rollmatch.config.section import Section


# ----------------------------------------------------------------------------------------- stage2_ab
class ScheduleConfig(Section):
    """Deterministic A/B schedule: step s is Channel-B iff floor((s+1)*b_ratio) > floor(s*b_ratio)."""

    b_ratio: float | None = Field(
        None, ge=0.0, le=1.0, description="Fraction of optimizer steps on Channel-B."
    )


class AsyncConfig(Section):
    """Async actor-learner (`channel_b.mode: async`): ready-pack queue per learner rank."""

    queue_limit: int = Field(
        8,
        gt=0,
        description="Max ready packs held per rank, counting those reserved for or trained by the current step; beyond it the queued pack of the oldest weight version is dropped.",
    )
    prefetch_target_packs: int = Field(2, gt=0, description="Eligible packs the actor keeps ready.")
    version_window: int = Field(
        2, ge=0, description="A pack is eligible iff its weight version >= current - version_window."
    )
    sync_every_steps: int = Field(1, gt=0, description="Push weights to the servers every N optimizer steps.")
    max_wait_s: float = Field(
        0.0,
        ge=0.0,
        le=3600.0,
        description="A step that wants B waits up to this long for its ready packs before running Channel-A instead (0: no wait). At most `training.collective_timeout_s` minus a margin (a tenth of it, at least 10 s); `version_window: 0` needs it > 0.",
    )
    record_trace: bool = Field(
        False,
        description="Append every record a step trains or drops (step, stream position, record id, weight version) to <output_dir>/async/rank<R>.records.jsonl, and at shutdown those still held (`discarded`): an audit of what each rank learned from, e.g. across a resume.",
    )
    admission_control: bool = Field(
        True,
        description="The actor does not start rollouts whose packs would be stale (beyond version_window) by the step that consumes them; the consume-time gate stays as the safety net.",
    )
    actor_stop_timeout_s: float = Field(
        10.0,
        gt=0.0,
        le=600.0,
        description="At the run's end (or a stop on the warning signal) the learner waits this long for its actor to finish the rollout call in flight; an actor still inside one after this is left to exit with the process (logged).",
    )


class ChannelBConfig(Section):
    """Channel-B (rollout-matching) steps of stage2_ab_training."""

    mode: Literal["micro", "step", "async"] = Field(
        "micro",
        description="micro: rollouts per micro-batch; step: rollouts_per_step per optimizer step (one process); async: actor-learner queues (server mode).",
    )
    rollouts_per_step: int | None = Field(
        None,
        gt=0,
        description="step mode: raw rollouts per optimizer step, a multiple of `rollouts_per_record` K (default bs * world * GAS * K: bs * world * GAS records).",
    )
    enable_pipeline: bool = Field(
        False, description="step mode: overlap rollouts and learning (server mode only)."
    )
    max_carry_age_steps: int = Field(
        4,
        ge=0,
        description="micro mode with `training.packing`: rollout segments that wait in the carry buffer for a later B step (with several ranks every micro-step trains one row and the rest waits) are dropped, not trained, once they are more than this many optimizer steps older than the step (their rollouts came from weights that old); counted in `stage2_ab/micro/carry_dropped_stale`. 0: a B step trains only its own rollouts. The default keeps a segment carried once from one B step to the next down to `schedule.b_ratio` 0.25 (B every 4 steps).",
    )
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


class Stage2ABConfig(Section):
    """stage2_ab_training: per optimizer step, Channel-A (GT teacher forcing) or Channel-B (rollout matching)."""

    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    channel_b: ChannelBConfig = Field(default_factory=ChannelBConfig)
