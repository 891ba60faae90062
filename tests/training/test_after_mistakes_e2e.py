"""Training after the model's own mistakes, end to end on a tiny model: ``keep_prefix: all`` +
``matched_prefix: supervise`` with ``missed_weight`` and the false-positive unlikelihood term, rolled
out by HF generate and by a colocated vLLM engine.

A tiny random model writes no complete element, so nothing would be kept. The module first teaches
one (stage-1 SFT on two records until it writes their lists), then rolls out on the same images with
other GT: the memorised boxes are false positives, kept in the context and flagged.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest

from rollmatch.config.load import deep_merge, load_config_dict
from rollmatch.data.records import load_records
from rollmatch.training.entry import run_training

# a stage-1 run that memorises two lists, then short rollout runs: minutes on a loaded CPU
pytestmark = [pytest.mark.heavy, pytest.mark.timeout(1200)]

SFT_STEPS = 30
AFTER_MISTAKES = {
    "keep_prefix": "all",
    "matched_prefix": "supervise",
    "missed_weight": 0.5,
    "fp_unlikelihood_weight": 0.5,
}


def base(model: Path, train: Path, out: Path, extra: dict[str, Any]) -> dict[str, Any]:
    cfg = {
        "model": {"path": str(model)},
        "data": {"train_jsonl": str(train), "val_jsonl": None, "coord_frame": "norm1000"},
        "custom": {"extra": {"rollout_matching": {"rollout_backend": "hf", "max_new_tokens": 64}}},
        "preflight": {"records": 0},  # rollout training from an untrained model: no format check
        "training": {
            "output_dir": str(out),
            "per_device_train_batch_size": 2,
            "learning_rate": 3e-3,
            "report_to": [],
            "logging_steps": 1,
            "save_steps": 1000,
            "packing": True,
            "global_max_length": 1024,
        },
    }
    return deep_merge(cfg, extra)


@pytest.fixture(scope="module")
def memorised(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(stage-1 model that writes the two records' lists, records with other GT on the same images)``."""
    from rollmatch.data.shapes import generate_shapes

    root = tmp_path_factory.mktemp("after_mistakes")
    data = generate_shapes(root / "shapes", n_train=2, n_val=0, size=112, seed=0)
    cfg = base(
        tiny_model_dir,
        data["train"],
        root / "sft",
        {"custom": {"trainer_variant": "sft"}, "training": {"max_steps": SFT_STEPS, "logging_steps": 8}},
    )
    stage1 = Path(run_training(load_config_dict(cfg)).final_model_dir)
    # the same images, every box moved to the opposite corner: what the model writes is now wrong
    moved = data["train"].with_name("moved.jsonl")  # image paths are relative to its folder
    with moved.open("w") as handle:
        for line in data["train"].read_text().splitlines():
            record = json.loads(line)
            for obj in record["objects"]:
                x1, y1, x2, y2 = obj["bbox"]
                obj["bbox"] = [
                    record["width"] - x2,
                    record["height"] - y2,
                    record["width"] - x1,
                    record["height"] - y1,
                ]
            handle.write(json.dumps(record) + "\n")
    assert load_records(moved)
    return stage1, moved


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_training_after_own_mistakes_flags_false_positives_and_trains(
    backend: str, memorised: tuple[Path, Path], tmp_path: Path
) -> None:
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    stage1, moved = memorised
    extra = {
        "custom": {
            "trainer_variant": "rollout_matching_sft",
            "extra": {
                "rollout_matching": {
                    "rollout_backend": backend,
                    "vllm": {"mode": "colocate", "tensor_parallel_size": 1, "enforce_eager": True},
                }
            },
        },
        "loss": AFTER_MISTAKES,
        "training": {"max_steps": 2, "learning_rate": 1e-4},
    }
    result = run_training(load_config_dict(base(stage1, moved, tmp_path / backend, extra)))
    logged = [h for h in result.log_history if "loss" in h]
    assert result.global_step == 2 and all(math.isfinite(h["loss"]) for h in logged)
    assert all(h["rollout/count"] == 2 for h in logged)
    # the memorised answers are complete elements that match nothing: kept, flagged, and the
    # targets hold other token ids than SFT's
    assert logged[0]["match/fp"] > 0, logged[0]
    assert logged[0]["target/unlikelihood_tokens"] > 0, logged[0]
    assert logged[0]["target/differs_from_sft"] >= 1
    assert logged[0]["target/dropped_elements"] == 0  # keep_prefix: all drops nothing


def test_diagnose_on_a_model_that_writes_lists(memorised: tuple[Path, Path], tmp_path: Path) -> None:
    from rollmatch.diagnostics import run_diagnose

    stage1, moved = memorised
    cfg = load_config_dict(base(stage1, moved, tmp_path / "diagnose", {"eval": {"max_new_tokens": 64}}))
    result = run_diagnose(cfg, load_records(moved), prefix_ks=(1,))
    # the memorised answers are wrong on the moved GT: a keep-all target holds them
    assert result["targets_vs_sft"]["prefix_fn_all_supervise"]["differs_frac"] > 0
    probe = result["prefix_probe"]["1"]
    assert probe["records"] >= 1  # more than one GT object and a complete first element of its own
    assert 0.0 <= probe["recall_after_gt_prefix"] <= 1.0 and 0.0 <= probe["recall_after_own_prefix"] <= 1.0
