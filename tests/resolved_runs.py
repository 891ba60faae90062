"""Resolved runs for tests that assemble training parts in this one CPU process (no launch).

``cpu_run`` is :func:`~rollmatch.config.resolved.resolve_run` for one CPU process, what
``training.entry`` builds; ``gradient_accumulation_steps`` replaces the derived value where a test's
planner needs a given number of micro-steps. ``unresolved_run`` is for configs a builder must refuse
before it reads the model (its ``model.path`` need not exist): the derived values are the config's own.
"""

from __future__ import annotations

import dataclasses

from rollmatch.config import rules
from rollmatch.config.decoding import eval_decoding, rollout_decoding
from rollmatch.config.resolved import ResolvedRun, resolve_run
from rollmatch.config.schema import RollmatchConfig


def cpu_run(cfg: RollmatchConfig, *, gradient_accumulation_steps: int | None = None) -> ResolvedRun:
    run = resolve_run(cfg, world_size=1, device_count=0, device_type="cpu")
    if gradient_accumulation_steps is None:
        return run
    return dataclasses.replace(run, gradient_accumulation_steps=gradient_accumulation_steps)


def unresolved_run(cfg: RollmatchConfig) -> ResolvedRun:
    return ResolvedRun(
        config=cfg,
        world_size=1,
        sync_mode=rules.resolve_sync_mode(cfg),
        servers=(),
        coord_frame="norm1000",
        pixel_bounds=(cfg.data.min_pixels, cfg.data.max_pixels),
        gradient_accumulation_steps=cfg.training.gradient_accumulation(1),
        decoding=rollout_decoding(cfg),
        eval_decoding=eval_decoding(cfg),
    )
