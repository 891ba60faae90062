"""End to end on a tiny real model: rollout-matching SFT lowers the loss, logs metrics, resumes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rollmatch.config.schema import TrainingConfig
from rollmatch.training.checkpoints import COMPLETE_MARKER, latest_complete_checkpoint
from rollmatch.training.entry import run_training


@pytest.mark.heavy
def test_rollout_matching_lowers_loss_on_a_fixed_batch(make_config):
    cfg = make_config({"data": {"max_samples": 2}, "training": {"max_steps": 8}})
    result = run_training(cfg)
    losses = [h["loss"] for h in result.log_history if "loss" in h]
    assert result.global_step == 8
    assert losses[-1] < 0.8 * losses[0], losses
    last = next(h for h in reversed(result.log_history) if "loss" in h)
    assert last["rollout/count"] == 2
    for key in ("match/precision", "match/recall", "match/f1", "rollout/len_mean", "packing/fill_ratio"):
        assert key in last
    lines = (Path(cfg.training.output_dir) / "metrics.jsonl").read_text().splitlines()
    assert any("match/f1" in json.loads(line) for line in lines)
    assert (Path(result.final_model_dir) / "config.json").exists()


@pytest.mark.heavy
def test_save_and_resume_continues_global_step(make_config):
    first = run_training(make_config({"training": {"max_steps": 2, "save_steps": 2}}))
    checkpoint = latest_complete_checkpoint(first.output_dir)
    assert checkpoint is not None and checkpoint.endswith("checkpoint-2")
    assert (Path(checkpoint) / COMPLETE_MARKER).exists()
    resumed = run_training(
        make_config({"training": {"max_steps": 4, "save_steps": 2, "resume_from_checkpoint": "latest"}})
    )
    assert resumed.global_step == 4
    steps = [h["step"] for h in resumed.log_history if "loss" in h]
    assert steps[-2:] == [3, 4]


def test_incomplete_checkpoint_is_never_resumed(tmp_path):
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / COMPLETE_MARKER).write_text("{}")
    (tmp_path / "checkpoint-4").mkdir()  # crashed mid-save: no marker
    assert latest_complete_checkpoint(str(tmp_path)).endswith("checkpoint-2")


@pytest.mark.parametrize(
    ("eff", "bs", "world", "gas"), [(32, 1, 1, 32), (32, 4, 2, 4), (10, 4, 1, 3), (1, 8, 2, 1)]
)
def test_effective_batch_size_derives_gradient_accumulation(eff, bs, world, gas):
    t = TrainingConfig(effective_batch_size=eff, per_device_train_batch_size=bs)
    assert t.gradient_accumulation(world) == gas == max(1, math.ceil(eff / (bs * world)))
