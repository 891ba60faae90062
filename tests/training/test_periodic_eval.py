"""Detection evaluation during training: ``eval/*`` metrics every N steps in the same sinks as training
metrics, the best checkpoint (``metric_for_best_model``) kept and reloaded at the end; with two gloo ranks
rank 0 evaluates while the other rank waits, and both agree."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from fork_ranks import run_forked_ranks
from transformers import AutoModelForImageTextToText

from rollmatch.training.entry import run_training

EVAL_METRICS = ("eval/f1", "eval/precision", "eval/recall", "eval/map", "eval/truncated_frac", "eval/samples")


def _eval_lines(output_dir: str) -> list[dict]:
    lines = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if "eval/f1" in line]


@pytest.mark.heavy
def test_eval_every_n_steps_keeps_and_reloads_the_best_checkpoint(make_config):
    cfg = make_config(
        {
            "data": {"max_samples": 4},
            "eval": {"max_samples": 2, "max_new_tokens": 16},
            "training": {
                "max_steps": 4,
                "eval_steps": 2,
                "save_steps": 2,
                "save_total_limit": 1,
                "metric_for_best_model": "eval/truncated_frac",
                "hf_args": {"load_best_model_at_end": True},
            },
        }
    )
    result = run_training(cfg)
    evals = _eval_lines(cfg.training.output_dir)
    assert [line["step"] for line in evals] == [2, 4]
    for key in EVAL_METRICS:
        assert all(key in line for line in evals), key
    assert all(line["eval/samples"] == 2 for line in evals)
    assert [line["eval/weight_version"] for line in evals] == [2, 4]  # evaluated the weights of that step
    assert (Path(cfg.training.output_dir) / "eval" / "step-4.predictions.jsonl").exists()

    scores = {line["step"]: line["eval/truncated_frac"] for line in evals}
    best_step = min(scores, key=lambda step: (scores[step], step))  # lower is better; ties: the first
    assert best_step != 4, "the reload check below needs a best checkpoint that is not the last one"
    remaining = sorted(p.name for p in Path(cfg.training.output_dir).glob("checkpoint-*"))
    assert remaining == [f"checkpoint-{best_step}"]  # save_total_limit 1 keeps the best one
    final = AutoModelForImageTextToText.from_pretrained(result.final_model_dir, dtype=torch.float32)
    best_dir = os.path.join(cfg.training.output_dir, remaining[0])
    best = AutoModelForImageTextToText.from_pretrained(best_dir, dtype=torch.float32)
    for (name, a), (_, b) in zip(final.state_dict().items(), best.state_dict().items(), strict=True):
        assert torch.equal(a, b), f"final model is not the best checkpoint ({name})"


@pytest.mark.heavy
def test_two_ranks_evaluate_consistently(make_config, tmp_path: Path) -> None:
    # Two real gloo ranks forked from this process (tests/fork_ranks.py): the eval logic is ours, not torchrun's.
    cfg = make_config(
        {
            "data": {"max_samples": 4},
            "eval": {"max_samples": 2, "max_new_tokens": 8},
            "training": {
                "per_device_train_batch_size": 1,
                "max_steps": 2,
                "eval_steps": 1,
                "metric_for_best_model": "eval/f1",
                "collective_timeout_s": 120,
            },
        }
    )
    run_forked_ranks(lambda rank: run_training(cfg), timeout_s=400)
    evals = _eval_lines(cfg.training.output_dir)
    assert [line["step"] for line in evals] == [1, 2]
    assert all(line["eval/samples"] == 2 for line in evals)
