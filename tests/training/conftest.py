"""Fixtures for trainer tests: a small synthetic shapes set, a config factory, the Stage-2 parts of the
tiny model, a plan runner."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rollmatch.config.load import deep_merge, load_config_dict
from rollmatch.config.schema import RollmatchConfig


@pytest.fixture(scope="session")
def shapes_small(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from rollmatch.data.shapes import generate_shapes

    return generate_shapes(tmp_path_factory.mktemp("shapes"), n_train=8, n_val=4, size=112, seed=0)


@pytest.fixture
def make_config(
    tiny_model_dir: Path, shapes_small: dict[str, Path], tmp_path: Path
) -> Callable[..., RollmatchConfig]:
    def make(extra: dict[str, Any] | None = None) -> RollmatchConfig:
        base: dict[str, Any] = {
            "model": {"path": str(tiny_model_dir)},
            "data": {  # norm1000: the expectations here were written for 0..1000 (auto: pixels on Qwen2.5-VL)
                "train_jsonl": str(shapes_small["train"]),
                "val_jsonl": str(shapes_small["val"]),
                "coord_frame": "norm1000",
            },
            "custom": {
                "trainer_variant": "rollout_matching_sft",
                "extra": {"rollout_matching": {"rollout_backend": "hf", "max_new_tokens": 24}},
            },
            "preflight": {"records": 0},  # rollout training from an untrained model: no format check
            "training": {
                "output_dir": str(tmp_path / "out"),
                "per_device_train_batch_size": 2,
                "max_steps": 4,
                "learning_rate": 3e-3,
                "report_to": [],
                "logging_steps": 1,
                "save_steps": 1000,
                "packing": True,
                "global_max_length": 1024,
            },
        }
        return load_config_dict(deep_merge(base, extra or {}))

    return make


@pytest.fixture
def stage2_tiny(
    loaded_tiny: tuple[Any, Any], tiny_model_dir: Path, make_config: Callable[..., RollmatchConfig]
) -> Any:
    """The tiny model with a Stage-2 config (every step wants Channel-B), its prompt encoder, the
    ``qwen_json`` codec and the training records."""
    from types import SimpleNamespace

    from rollmatch.data.prompts import PromptEncoder
    from rollmatch.data.records import load_records
    from rollmatch.detection.object_formats import build_codec

    model, _ = loaded_tiny
    cfg = make_config(
        {"custom": {"trainer_variant": "stage2_ab_training"}, "stage2_ab": {"schedule": {"b_ratio": 1.0}}}
    )
    encoder = PromptEncoder.from_pretrained(str(tiny_model_dir), cfg.data)
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    return SimpleNamespace(
        model=model, cfg=cfg, encoder=encoder, codec=codec, records=load_records(cfg.data.train_jsonl)
    )


@pytest.fixture
def train_plan() -> Callable[[Any, Any], Any]:
    """``train_plan(model, plan)``: see :func:`run_plan`."""
    return run_plan


def run_plan(model: Any, plan: Any) -> Any:
    """Forward/backward every pass of a ``StepPlan`` as ``RollmatchTrainer`` does in one process.

    Returns the step's loss ``sum(w * ce) / sum(w)`` (detached); gradients accumulate in ``model``.
    """
    import torch

    from rollmatch.packing.collate import model_inputs
    from rollmatch.training.losses import weighted_ce_sum

    total = torch.zeros(())
    for micro in plan.micro_steps:
        loss = torch.zeros(())
        for batch, normaliser in micro.passes(plan.total_weight):
            logits = model(**model_inputs(batch)).logits
            row_loss = weighted_ce_sum(logits, batch["input_ids"], batch["weights"]) / normaliser
            row_loss.backward()
            loss = loss + row_loss.detach()
        total = total + micro.finish(model, loss)
    return total
