"""``custom.object_format: coord_tokens`` end to end on a tiny model with the coordinate tokens:
stage-1 SFT, rollout matching (HF and vLLM colocated), Stage-2 AB micro, eval and pictures."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rollmatch.config.schema import RollmatchConfig
from rollmatch.data.records import load_records
from rollmatch.evaluation import run_eval
from rollmatch.training.entry import run_training
from rollmatch.viz import render_pictures

pytestmark = pytest.mark.heavy


def phase(
    make_config, coord_model_dir: Path, tmp_path: Path, name: str, model: Path, extra: dict
) -> RollmatchConfig:
    base = {
        "model": {"path": str(model)},
        "custom": {"object_format": "coord_tokens", "extra": {"rollout_matching": {"max_new_tokens": 40}}},
        "loss": {"coord_sigma_bins": 1.0, "coord_w1_weight": 0.1, "geometry_l1_weight": 0.5},
        "training": {"output_dir": str(tmp_path / name), "save_steps": 1000},
    }
    from rollmatch.config.load import deep_merge

    return make_config(deep_merge(base, extra))


def test_coord_tokens_train_roll_out_evaluate_and_draw(
    make_config, coord_model_dir: Path, tmp_path: Path
) -> None:
    sft = run_training(
        phase(
            make_config,
            coord_model_dir,
            tmp_path,
            "sft",
            coord_model_dir,
            {"custom": {"trainer_variant": "sft"}, "training": {"max_steps": 6, "learning_rate": 3e-3}},
        )
    )
    losses = [h["loss"] for h in sft.log_history if "loss" in h]
    assert losses[-1] < losses[0], losses  # the coordinate losses train
    stage1 = Path(sft.final_model_dir)
    backends = ["hf", "vllm"] if importlib.util.find_spec("vllm") else ["hf"]
    for backend in backends:
        rollout_extra = {
            "custom": {
                "trainer_variant": "rollout_matching_sft",
                "extra": {
                    "rollout_matching": {
                        "rollout_backend": backend,
                        "vllm": {"tensor_parallel_size": 1, "enforce_eager": True},
                    }
                },
            },
            "loss": {"target": "reordered_gt"},
            "training": {"max_steps": 2},
        }
        result = run_training(
            phase(make_config, coord_model_dir, tmp_path, f"rm-{backend}", stage1, rollout_extra)
        )
        rollout_lines = [h for h in result.log_history if "rollout/count" in h]
        assert rollout_lines and all(h["rollout/count"] > 0 for h in rollout_lines), backend
    ab = phase(
        make_config,
        coord_model_dir,
        tmp_path,
        "ab",
        stage1,
        {
            "custom": {
                "trainer_variant": "stage2_ab_training",
                "extra": {"rollout_matching": {"rollout_backend": "hf"}},
            },
            "stage2_ab": {"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": "micro"}},
            "training": {"max_steps": 2},
        },
    )
    logged = [h for h in run_training(ab).log_history if "loss" in h]
    assert [h["stage2_ab/step_kind_b"] for h in logged] == [0.0, 1.0]

    records = load_records(ab.data.val_jsonl)
    evaluated = ab.model_copy(update={"model": ab.model.model_copy(update={"path": str(stage1)})})
    predictions = tmp_path / "eval" / "predictions.jsonl"
    result = run_eval(evaluated, records, str(predictions))
    assert result.num_samples == len(records) and result.label_mode == "require"
    lines = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert len(lines) == len(records) and all(
        "<|coord_" in line["text"] or not line["objects"] for line in lines
    )
    pictures = render_pictures(records, predictions, tmp_path / "pictures", matching=evaluated.eval.matching)
    assert pictures[-1].name == "grid.png" and pictures[-1].stat().st_size > 0
