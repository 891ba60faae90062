"""The engine/learner correction, staleness, the log-ratio clamp, loss types and TRL's names.

Hand-computed cases: a fresh token's PPO ratio is 1 and its engine gap becomes a capped weight; a stale
token keeps the engine's log-prob in the PPO ratio; the log-ratio is clamped before exp; the loss_type
token weights give TRL's aggregations; TRL's names load as rollmatch's keys.
"""

from __future__ import annotations

import math

import pytest
import torch

from rollmatch.config.load import load_config_dict
from rollmatch.errors import ConfigError
from rollmatch.training.grpo_loss import GrpoSettings, grpo_loss_sum
from rollmatch.training.grpo_targets import policy_token_weights


def _row(values: list[float]) -> torch.Tensor:
    return torch.tensor([[0.0, *values]])  # position 0 is never predicted


def test_fresh_tokens_train_with_ratio_one_and_a_capped_engine_weight() -> None:
    learner = _row([-1.0, -1.0, -1.0]).requires_grad_(True)
    engine = _row([-1.0, -1.0 - math.log(2.0), -1.0 - math.log(5.0)])  # engine gaps: ratio 1, 2, 5
    adv, weights = _row([1.0, 1.0, 1.0]), _row([1.0, 1.0, 1.0])
    settings = GrpoSettings(is_correction="token_truncate", is_cap=3.0)
    loss, stats = grpo_loss_sum(learner, engine, adv, weights, settings)
    loss.backward()
    assert float(loss) == pytest.approx(-(1.0 + 2.0 + 3.0), rel=1e-6)  # weights 1, 2, min(5, 3)
    assert learner.grad[0, 1:].tolist() == pytest.approx([-1.0, -2.0, -3.0], rel=1e-6)
    assert stats["grpo/clipped_tokens"] == 0  # the PPO ratio of a fresh token is 1
    assert stats["grpo/is_tokens"] == 3 and stats["grpo/is_capped_tokens"] == 1
    assert stats["grpo/is_ratio_sum"] == pytest.approx(8.0, rel=1e-6)
    masked, _ = grpo_loss_sum(learner, engine, adv, weights, GrpoSettings(is_correction="token_mask"))
    assert float(masked) == pytest.approx(-(1.0 + 2.0), rel=1e-6)  # the ratio-5 token weighs 0
    sequence, _ = grpo_loss_sum(
        learner, engine, adv, weights, GrpoSettings(is_correction="sequence_truncate")
    )
    assert float(sequence) == pytest.approx(-3.0 * 3.0, rel=1e-6)  # product 10, capped at 3, on every token
    plain, _ = grpo_loss_sum(learner, engine, adv, weights, GrpoSettings(is_correction="none"))
    assert float(plain) == pytest.approx(-(1.0 + 1.2 + 1.2), rel=1e-6)  # one ratio, PPO-clipped at 1.2


def test_sequence_correction_groups_tokens_by_rollout_within_a_packed_row() -> None:
    learner = _row([0.0, 0.0, 0.0, 0.0])
    engine = _row([-math.log(2.0), -math.log(2.0), 0.0, -math.log(1.5)])
    ids = _row([0.0, 0.0, 1.0, 1.0])  # two rollouts in one row
    ones = _row([1.0] * 4)
    settings = GrpoSettings(is_correction="sequence_truncate", is_cap=3.0)
    loss, _ = grpo_loss_sum(learner, engine, ones, ones, settings, sequence_ids=ids)
    assert float(loss) == pytest.approx(-(3.0 + 3.0 + 1.5 + 1.5), rel=1e-6)  # min(4, 3) twice, 1.5 twice


def test_stale_tokens_keep_the_engine_ratio_and_report_their_lag() -> None:
    learner = _row([0.0, 0.0]).requires_grad_(True)
    engine = _row([-math.log(2.0), -math.log(2.0)])
    ones = _row([1.0, 1.0])
    lag = _row([0.0, 2.0])
    loss, stats = grpo_loss_sum(learner, engine, ones, ones, GrpoSettings(), lag=lag)
    # fresh: ratio 1, weight 2 -> -2; stale: ratio 2 > 1.2 -> clipped at 1.2, weight 1
    assert float(loss) == pytest.approx(-(2.0 + 1.2), rel=1e-6)
    assert stats["grpo/lag_sum"] == 2.0 and stats["grpo/stale_tokens"] == 1 and stats["grpo/is_tokens"] == 1
    assert stats["grpo/clipped_tokens"] == 1


def test_the_log_ratio_is_clamped_before_exp() -> None:
    learner = _row([0.0]).requires_grad_(True)
    engine = _row([-200.0])  # exp(200) is inf in float32
    loss, _ = grpo_loss_sum(learner, engine, _row([-1.0]), _row([1.0]), GrpoSettings(is_correction="none"))
    loss.backward()
    assert math.isfinite(float(loss)) and torch.isfinite(learner.grad).all()
    assert float(loss) == pytest.approx(3.0, rel=1e-6)  # the dual clip: -max_ratio * A


@pytest.mark.parametrize(
    ("loss_type", "expected"),
    [
        ("dapo", (1.0, 4.0)),
        ("bnpo", (1.0, 4.0)),
        ("grpo", (0.25, 1.0)),
        ("dr_grpo", (1.0, 16.0)),
    ],
)
def test_loss_type_token_weights(loss_type: str, expected: tuple[float, float]) -> None:
    assert policy_token_weights(4, loss_type, 16) == expected
    weight, share = policy_token_weights(4, loss_type, 16, masked=True)
    assert weight == 0.0 and share == (0.0 if loss_type in ("dapo", "bnpo") else expected[1])


def test_trl_names_load_as_rollmatch_keys() -> None:
    cfg = load_config_dict(
        {
            "custom": {"extra": {"rollout_matching": {"decoding": {"temperature": 0.7}}}},
            "loss": {
                "objective": "grpo",
                "grpo": {
                    "num_generations": 4,
                    "beta": 0.04,
                    "epsilon": 0.2,
                    "epsilon_high": 0.28,
                    "delta": 4.0,
                    "loss_type": "dr_grpo",
                    "scale_rewards": "batch",
                    "mask_truncated_completions": True,
                    "vllm_importance_sampling_mode": "sequence_mask",
                    "vllm_importance_sampling_clip_max": 2.0,
                },
            },
        }
    )
    grpo = cfg.loss.grpo
    assert cfg.rollout.rollouts_per_record == 4 and grpo.kl_coef == 0.04 and grpo.clip_eps_high == 0.28
    assert grpo.max_ratio == 4.0 and grpo.is_correction == "sequence_mask" and grpo.is_cap == 2.0
    with pytest.raises(ConfigError, match=r"loss\.grpo\.beta.*kl_coef"):
        load_config_dict({"loss": {"grpo": {"beta": 0.1, "kl_coef": 0.2}}})
