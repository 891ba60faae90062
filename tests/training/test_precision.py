"""The recipes' precision (fp32 master weights, bf16 compute) keeps an optimizer step at Stage-2's
learning rate; pure bf16 loses most of it: an AdamW update of ~1e-6 is below the bf16 spacing of a
typical weight (7.8e-5 at |w| 0.02), so the weight rounds back to itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rollmatch.config.load import load_config
from rollmatch.training.entry import run_training

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "recipes" / "qwen2_5_vl_3b_coco.yaml"


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def _changed_fraction(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """Share of the weight-matrix elements a step changed (embeddings, whose unused rows get no
    gradient, left out), each compared in the dtype it was trained in."""
    changed = total = 0
    for name, new in after.items():
        if new.dim() < 2 or "embed" in name or "lm_head" in name:
            continue
        old = before[name].to(new.dtype)
        changed += int((new != old).sum())
        total += new.numel()
    return changed / total


def _one_step(make_config: Any, tmp_path: Path, dtype: str, mixed: str) -> float:
    cfg = make_config(
        {
            "model": {"dtype": dtype},
            "custom": {"trainer_variant": "sft"},
            "training": {
                "output_dir": str(tmp_path / f"{dtype}-{mixed}"),
                "mixed_precision": mixed,
                "learning_rate": 1.0e-6,  # the Stage-2 recipes' rate
                "lr_scheduler_type": "constant",
                "warmup_ratio": 0.0,
                "max_steps": 1,
                "packing": False,
            },
        }
    )
    result = run_training(cfg)
    return _changed_fraction(_weights(Path(cfg.model.path)), _weights(Path(result.final_model_dir)))


@pytest.mark.heavy
def test_one_step_at_lr_1e6_changes_most_weights_under_the_recipe_precision(
    make_config: Any, tmp_path: Path
) -> None:
    recipe = load_config(RECIPE)
    precision = (recipe.model.dtype, recipe.training.mixed_precision)
    assert precision == ("float32", "bf16")  # what every recipe trains with (tests/config/test_recipes.py)
    kept = _one_step(make_config, tmp_path, *precision)
    lost = _one_step(make_config, tmp_path, "bfloat16", "no")  # the recipes' former precision
    assert kept > 0.9, kept
    assert lost < 0.5, lost
