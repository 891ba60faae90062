"""Rules of `rollouts_per_record` and `loss.objective: grpo`: each refusal names the key and the fix."""

from __future__ import annotations

from typing import Any

from rollmatch.config.load import load_config_dict

RM = "custom.extra.rollout_matching"
K = f"{RM}.rollouts_per_record"
SAMPLING = {"temperature": 1.0}


def rollout(**rollout_matching: Any) -> dict[str, Any]:
    return {"custom": {"extra": {"rollout_matching": rollout_matching}}}


def test_several_rollouts_per_record_with_greedy_decoding_are_refused(problems_of) -> None:
    problem = problems_of(rollout(rollouts_per_record=4)).only(K)
    assert problem.value == 4
    assert "decoding.temperature > 0" in problem.fix and "identical" in problem.fix


def test_several_rollouts_per_record_with_sampling_load() -> None:
    cfg = load_config_dict(rollout(rollouts_per_record=4, decoding=SAMPLING))
    assert cfg.rollout.rollouts_per_record == 4
    assert load_config_dict({}).rollout.rollouts_per_record == 1  # the default keeps today's behaviour


def test_step_budget_must_be_a_multiple_of_rollouts_per_record(problems_of) -> None:
    data = {
        **rollout(rollouts_per_record=4, decoding=SAMPLING),
        "stage2_ab": {"channel_b": {"mode": "step", "rollouts_per_step": 6}},
    }
    problem = problems_of(data).only("stage2_ab.channel_b.rollouts_per_step")
    assert problem.value == 6 and "multiple" in problem.fix and "4" in problem.fix


def test_grpo_needs_a_group_of_at_least_two(problems_of) -> None:
    problem = problems_of({"loss": {"objective": "grpo"}}).only(K)
    assert problem.value == 1 and "K >= 2" in problem.fix


def test_grpo_with_greedy_decoding_reports_the_rollouts_key(problems_of) -> None:
    problem = problems_of({**rollout(rollouts_per_record=2), "loss": {"objective": "grpo"}}).only(K)
    assert "temperature" in problem.fix


def test_grpo_under_sft_is_refused(problems_of) -> None:
    data = rollout(rollouts_per_record=2, decoding=SAMPLING)
    data["custom"]["trainer_variant"] = "sft"
    problem = problems_of({**data, "loss": {"objective": "grpo"}}).only("loss.objective")
    assert "rollout_matching_sft" in problem.fix


def test_dual_clip_must_sit_outside_the_ppo_clip(problems_of) -> None:
    data = {
        **rollout(rollouts_per_record=2, decoding=SAMPLING),
        "loss": {"objective": "grpo", "grpo": {"clip_eps_high": 0.5, "max_ratio": 1.4}},
    }
    problem = problems_of(data).only("loss.grpo.max_ratio")
    assert problem.value == 1.4 and "1.5" in problem.fix


def test_grpo_config_loads_with_its_defaults() -> None:
    cfg = load_config_dict(
        {**rollout(rollouts_per_record=2, decoding=SAMPLING), "loss": {"objective": "grpo"}}
    )
    grpo = cfg.loss.grpo
    assert (grpo.reward, grpo.scale_rewards, grpo.clip_eps, grpo.kl_coef) == ("f1", "group", 0.2, 0.0)
    assert load_config_dict({}).loss.objective == "rollout_matching"


def test_grpo_refuses_the_rollout_matching_target_weights(problems_of) -> None:
    """GRPO trains the rollout's own tokens: a target weight beside it would silently do nothing."""
    for key, value in (("missed_weight", 2.0), ("fp_unlikelihood_weight", 0.5)):
        loss = {"objective": "grpo", "target": "prefix_fn", "keep_prefix": "all", key: value}
        problem = problems_of({**rollout(rollouts_per_record=2, decoding=SAMPLING), "loss": loss}).only(
            f"loss.{key}"
        )
        assert problem.value == value and "loss.objective: rollout_matching" in problem.fix


def test_grpo_refuses_decoding_the_learner_cannot_reproduce(problems_of) -> None:
    """Top-p / top-k truncate the sampling distribution and the repetition penalty rescales logits by the
    history: the learner's log_softmax(logits / T) would not be the behaviour policy's log-prob."""
    for key, value in (("top_p", 0.9), ("top_k", 20), ("repetition_penalty", 1.1)):
        decoding = {"temperature": 0.7, key: value}
        data = {**rollout(rollouts_per_record=2, decoding=decoding), "loss": {"objective": "grpo"}}
        problem = problems_of(data).only(f"{RM}.decoding.{key}")
        assert problem.value == value and "temperature" in problem.fix, problem
    tempered = rollout(rollouts_per_record=2, decoding={"temperature": 0.7, "top_p": 0.9})
    assert load_config_dict(tempered).rollout.decoding.top_p == 0.9  # rollout matching keeps them
