"""Pick the rollout backend once, from the config; nothing else branches on the backend name."""

from __future__ import annotations

from typing import Any

from rollmatch.collectives import Collectives
from rollmatch.config.schema import RollmatchConfig
from rollmatch.rollout.types import RolloutBackend


def build_backend(
    cfg: RollmatchConfig,
    *,
    model: Any,
    tokenizer: Any,
    model_dir: str,
    collectives: Collectives,
    eos_token_id: int,
    pad_token_id: int,
) -> RolloutBackend:
    """The configured backend: ``hf`` (the training model), vLLM colocate, or rollout servers."""
    rm = cfg.rollout
    if rm.rollout_backend == "hf":
        from rollmatch.rollout.hf import HFBackend

        return HFBackend(
            model,
            tokenizer,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            batch_size=cfg.stage2_ab.channel_b.rollout_decode_batch_size
            if cfg.custom.trainer_variant == "stage2_ab_training"
            else max(cfg.training.per_device_train_batch_size, 1),
        )
    if rm.vllm.mode == "colocate":
        from rollmatch.rollout.vllm_colocate import VllmColocateBackend

        return VllmColocateBackend.from_config(
            cfg, model=model, tokenizer=tokenizer, model_dir=model_dir, collectives=collectives
        )
    from rollmatch.rollout.client import ServerBackend

    return ServerBackend.from_config(
        cfg, model=model, tokenizer=tokenizer, model_dir=model_dir, collectives=collectives
    )
