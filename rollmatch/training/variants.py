"""Trainer variants as thin assemblies of components: which channel feeds each optimizer step.

- ``sft``: every step trains on the GT serialization (:class:`~rollmatch.training.channels.GTChannel`).
- ``rollout_matching_sft``: every step trains on the model's own rollouts (``RolloutChannel``).
- ``stage2_ab_training``: lives in ``rollmatch.training.stage2`` (deterministic A/B schedule).

A variant returns :class:`VariantParts`: the window function the trainer calls once per optimizer
step, a hook that runs before it (weight sync), and what to close at the end.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rollmatch.collectives import Collectives
from rollmatch.config.schema import RollmatchConfig
from rollmatch.data.prompts import PromptEncoder
from rollmatch.detection.codec import ObjectCodec
from rollmatch.rollout.build import build_backend
from rollmatch.rollout.chunking import step_seed
from rollmatch.rollout.types import RolloutBackend
from rollmatch.training.channels import GTChannel, RolloutChannel
from rollmatch.training.offload import with_rollout_offload
from rollmatch.training.window import RowBuilder, WindowBuilder, WindowFn


@dataclass
class BuildContext:
    """Everything a variant may assemble from, built once by ``training.entry``."""

    cfg: RollmatchConfig
    model: torch.nn.Module
    encoder: PromptEncoder
    codec: ObjectCodec
    collectives: Collectives
    gradient_accumulation_steps: int
    optimizer_getter: Callable[[], Any] = lambda: None


@dataclass
class VariantParts:
    build_window: WindowFn
    before_window: Callable[[int], None] | None = None
    backend: RolloutBackend | None = None
    closeables: list[Any] = field(default_factory=list)


def row_builder(ctx: BuildContext) -> RowBuilder:
    t = ctx.cfg.training
    return RowBuilder(
        packing=t.packing,
        packing_length=t.global_max_length,
        carry_limit=t.carry_buffer_size,
        pad_token_id=ctx.encoder.pad_token_id,
    )


def backend_for(ctx: BuildContext) -> RolloutBackend:
    """The configured backend; colocated engines run each rollout phase inside the offload context."""
    backend = build_backend(
        ctx.cfg,
        model=ctx.model,
        tokenizer=ctx.encoder.tokenizer,
        model_dir=ctx.cfg.model.path,
        collectives=ctx.collectives,
        eos_token_id=ctx.encoder.eos_token_id,
        pad_token_id=ctx.encoder.pad_token_id,
    )
    return with_rollout_offload(backend, ctx.cfg, model=ctx.model, optimizer_getter=ctx.optimizer_getter)


def weight_sync_hook(backend: RolloutBackend, model: torch.nn.Module) -> Callable[[int], None]:
    """Before each window: push weights if optimizer steps changed them since the last push.

    The weight version is the number of optimizer steps applied, so it survives resume.
    """

    def sync(global_step: int) -> None:
        if backend.weight_version != global_step:
            backend.sync_weights(model, global_step)

    return sync


def build_sft(ctx: BuildContext) -> VariantParts:
    channel = GTChannel(ctx.model, ctx.encoder, ctx.codec, ctx.cfg)
    windows = WindowBuilder(producer=channel.produce, rows=row_builder(ctx), collectives=ctx.collectives)
    return VariantParts(build_window=windows.build)


def build_rollout_matching(ctx: BuildContext) -> VariantParts:
    backend = backend_for(ctx)
    channel = RolloutChannel(ctx.model, ctx.encoder, ctx.codec, ctx.cfg, backend)
    seed = ctx.cfg.training.seed

    def produce(records: Any, global_step: int) -> Any:
        return channel.produce(records, global_step, step_seed(seed, global_step))

    windows = WindowBuilder(producer=produce, rows=row_builder(ctx), collectives=ctx.collectives)
    return VariantParts(
        build_window=windows.build,
        before_window=weight_sync_hook(backend, ctx.model),
        backend=backend,
        closeables=[backend],
    )


VARIANTS: dict[str, str] = {
    "sft": "rollmatch.training.variants:build_sft",
    "rollout_matching_sft": "rollmatch.training.variants:build_rollout_matching",
    "stage2_ab_training": "rollmatch.training.stage2:build_stage2",
}


def build_variant(ctx: BuildContext) -> VariantParts:
    module, func = VARIANTS[ctx.cfg.custom.trainer_variant].split(":")
    return getattr(importlib.import_module(module), func)(ctx)
