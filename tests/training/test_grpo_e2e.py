"""GRPO end to end on the tiny model: a few steps colocated (HF and in-process vLLM), with metrics."""

from __future__ import annotations

import math
from typing import Any

import pytest

from rollmatch.training.entry import run_training

GRPO_ROLLOUTS = {"rollouts_per_record": 4, "decoding": {"temperature": 0.7}, "max_new_tokens": 24}


def grpo_config(make_config: Any, **rollout: Any) -> Any:
    return make_config(
        {
            "data": {"max_samples": 4},
            "custom": {"extra": {"rollout_matching": {**GRPO_ROLLOUTS, **rollout}}},
            "loss": {"objective": "grpo"},
            "training": {"max_steps": 3, "per_device_train_batch_size": 2},
        }
    )


@pytest.mark.heavy
def test_grpo_steps_on_the_hf_backend_log_rewards_and_ratio(make_config) -> None:
    result = run_training(grpo_config(make_config))
    assert result.global_step == 3
    logged = [h for h in result.log_history if "loss" in h]
    assert len(logged) == 3
    for line in logged:
        assert line["rollout/count"] == 8  # 2 records x 4 samples
        assert math.isfinite(line["loss"])
        for key in ("grpo/reward_mean", "grpo/reward_std", "grpo/zero_std_group_frac", "grpo/clip_frac"):
            assert key in line, key
        # fresh rollouts from the training model itself: the ratio is 1 up to float rounding, and so is the
        # engine/learner correction of the tokens trained in the step that sampled them
        assert abs(line["grpo/ratio_mean"] - 1.0) < 1e-3, line
        assert abs(line["grpo/is_ratio_mean"] - 1.0) < 1e-3 and line["grpo/is_capped_frac"] == 0.0, line
        assert line["grpo/lag_mean"] >= 0.0 and 0.0 <= line["grpo/stale_frac"] <= 1.0, line
        assert line["grpo/ratio_p05"] > 0.99 and line["grpo/ratio_p95"] < 1.01


@pytest.mark.heavy
def test_grpo_steps_on_a_colocated_vllm_engine(make_config) -> None:
    """In-process vLLM: its processed log-probs (temperature 0.7) are the behaviour policy; after each push they match the learner's,
    so the importance ratio of these fresh rollouts stays 1 within the engine's arithmetic."""
    pytest.importorskip("vllm")
    cfg = grpo_config(
        make_config,
        rollout_backend="vllm",
        vllm={
            "mode": "colocate",
            "tensor_parallel_size": 1,
            "enforce_eager": True,
            "kv_cache_space_gib": 0.25,
        },
    )
    result = run_training(cfg)
    assert result.global_step == 3
    logged = [h for h in result.log_history if "loss" in h]
    assert all(h["rollout/count"] == 8 and math.isfinite(h["loss"]) for h in logged)
    assert all(abs(h["grpo/ratio_mean"] - 1.0) < 1e-2 for h in logged), [h["grpo/ratio_mean"] for h in logged]
    assert all(h["grpo/clip_frac"] == 0.0 for h in logged)


@pytest.mark.heavy
def test_packing_carry_trains_part_of_a_group_one_step_late_and_reports_its_lag(make_config) -> None:
    """Packed rows hold fewer rollouts than a step samples: the carry buffer leaves the rest of a record's
    group for the next step. Those segments keep the advantages computed over their whole group and
    train with lag 1: ``grpo/lag_mean`` and ``grpo/stale_frac`` count them, the staleness ratio (against
    the engine's log-prob) is no longer exactly 1, and fresh tokens still get the engine/learner weight."""
    cfg = make_config(
        {
            "data": {"max_samples": 6},
            "custom": {"extra": {"rollout_matching": GRPO_ROLLOUTS}},
            "loss": {"objective": "grpo"},
            "training": {
                "max_steps": 3,
                "per_device_train_batch_size": 2,
                "packing": True,
                "global_max_length": 300,  # a few rollouts per row: the rest of a step's waits
                "learning_rate": 1e-3,
            },
        }
    )
    result = run_training(cfg)
    logged = [h for h in result.log_history if "loss" in h]
    assert len(logged) == 3 and all(math.isfinite(h["loss"]) for h in logged)
    assert logged[0]["grpo/lag_mean"] == 0.0  # nothing was sampled before the first step
    late = [h for h in logged[1:] if h["grpo/stale_frac"] > 0]
    assert late, [(h["grpo/lag_mean"], h["grpo/stale_frac"]) for h in logged]
    for line in late:
        assert line["grpo/lag_mean"] > 0.0 and line["grpo/lag_mean"] == pytest.approx(line["grpo/stale_frac"])
        assert abs(line["grpo/is_ratio_mean"] - 1.0) < 1e-3  # the fresh tokens' engine gap stays tiny
