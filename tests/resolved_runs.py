"""Resolved runs for tests that assemble training parts in this one CPU process (no launch), and the
rollout segment producer those tests build.

``cpu_run`` is :func:`~rollmatch.config.resolved.resolve_run` for one CPU process, what
``training.entry`` builds; ``gradient_accumulation_steps`` replaces the derived value where a test's
planner needs a given number of micro-steps. ``unresolved_run`` is the same door without the
checkpoint (``model.path`` need not exist; ``data.coord_frame: auto`` is taken as norm1000).
``resolved_config`` loads a mapping and resolves it so. ``producer`` is a :class:`RolloutSegmentProducer` of ``parts`` (anything with ``encoder``, ``codec`` and
``cfg``) with the config's rollout decoding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from rollmatch.config.decoding import rollout_decoding
from rollmatch.config.load import load_config_dict
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
    run = resolve_for(cfg)
    return dataclasses.replace(run, coord_frame=run.coord_frame or "norm1000")


def resolve_for(cfg: RollmatchConfig, *, world_size: int = 1, gpus: int = 0) -> ResolvedRun:
    """``cfg`` through the one door to a run, for ``world_size`` processes that see ``gpus`` CUDA devices
    (0: the CPU), checkpoint not required."""
    device_type = "cuda" if gpus else "cpu"
    return resolve_run(
        cfg, world_size=world_size, device_count=gpus, device_type=device_type, model_required=False
    )


def resolved_config(
    data: dict[str, Any], overrides: Sequence[str] = (), *, world_size: int = 1
) -> RollmatchConfig:
    """``data`` loaded and through the one door to a run (every rule; ``world_size`` CPU processes; the
    checkpoint not required): the config of a run that passes, or the :class:`ConfigError` raised."""
    cfg = load_config_dict(data, overrides)
    resolve_for(cfg, world_size=world_size)
    return cfg


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
