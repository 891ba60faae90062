"""Resolved runs for tests that assemble training parts in this one CPU process (no launch), and the
rollout segment producer those tests build.

``cpu_run`` is :func:`~rollmatch.config.resolved.resolve_run` for one CPU process, what
``training.entry`` builds; ``gradient_accumulation_steps`` replaces the derived value where a test's
planner needs a given number of micro-steps. ``unresolved_run`` is for configs a builder must refuse
before it reads the model (its ``model.path`` need not exist): the derived values are the config's own.
``producer`` is a :class:`RolloutSegmentProducer` of ``parts`` (anything with ``encoder``, ``codec`` and
``cfg``) with the config's rollout decoding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rollmatch.config import rules
from rollmatch.config.decoding import eval_decoding, rollout_decoding
from rollmatch.config.resolved import ResolvedRun, resolve_run
from rollmatch.config.schema import RollmatchConfig
from rollmatch.rollout.types import RolloutBackend
from rollmatch.training.segment_producers import RolloutSegmentProducer


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


def producer(
    parts: Any, model: Any, backend: RolloutBackend, decode_batch_size: int
) -> RolloutSegmentProducer:
    return RolloutSegmentProducer(
        model,
        parts.encoder,
        parts.codec,
        parts.cfg,
        backend,
        decoding=rollout_decoding(parts.cfg),
        decode_batch_size=decode_batch_size,
    )
