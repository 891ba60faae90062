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


# ------------------------------------------------------------------------------- loss.noise_objects
NOISE = "loss.noise_objects"


def sft_noise(**noise: Any) -> dict[str, Any]:
    return {"custom": {"trainer_variant": "sft"}, "loss": {"noise_objects": {"enabled": True, **noise}}}


def test_noise_objects_load_for_sft_and_evaluation_drops_their_label() -> None:
    from rollmatch.detection.noise_objects import noise_label_of

    cfg = load_config_dict(sft_noise(pad_to=12))
    assert cfg.loss.noise_objects.pad_to == 12 and noise_label_of(cfg) == "noise"
    assert noise_label_of(load_config_dict({})) is None  # off by default: nothing dropped
    assert noise_label_of(load_config_dict({"eval": {"noise_label": "junk"}})) == "junk"
    cfg = load_config_dict(sft_noise(count=3, label="bg"), [f"{NOISE}.kinds.random=0"])
    assert noise_label_of(cfg) == "bg" and cfg.loss.noise_objects.kinds.random == 0


def test_noise_objects_need_exactly_one_count(problems_of) -> None:
    for noise in ({}, {"pad_to": 4, "count": 2}, {"count": 1, "per_object": 0.5}):
        problem = problems_of(sft_noise(**noise)).only(NOISE)
        assert "exactly one" in problem.fix and "pad_to" in problem.fix


def test_noise_object_ranges_are_checked_with_the_key_named(problems_of) -> None:
    for key, value in (
        ("pad_to", 0),
        ("count", 1001),
        ("per_object", 0),
        ("jitter", 0),
        ("random_max_side", 1.5),
        ("label_weight", -1),
        ("seed", -1),
        ("label", ""),
    ):
        noise = {"pad_to": 4, key: value}  # a field out of range is reported before the count rule
        assert problems_of(sft_noise(**noise)).keys() == [f"{NOISE}.{key}"], key
    problem = problems_of(sft_noise(pad_to=4, label=" noise")).only(f"{NOISE}.label")
    assert "whitespace" in problem.fix
    kinds = {"jittered": 0, "shifted": 0, "random": 0}
    assert "at least one kind" in problems_of(sft_noise(pad_to=4, kinds=kinds)).only(f"{NOISE}.kinds").fix


def test_noise_objects_are_refused_where_targets_come_from_rollouts(problems_of) -> None:
    for variant in ("rollout_matching_sft", "stage2_ab_training"):
        data = sft_noise(pad_to=4)
        data["custom"]["trainer_variant"] = variant
        data["stage2_ab"] = {"schedule": {"b_ratio": 0.5}}
        problem = problems_of(data).only(f"{NOISE}.enabled")
        assert variant in problem.fix and "trainer_variant: sft" in problem.fix
    grpo = {**rollout(rollouts_per_record=2, decoding=SAMPLING), "loss": {"objective": "grpo"}}
    grpo["loss"]["noise_objects"] = {"enabled": True, "count": 1}
    assert "trainer_variant: sft" in problems_of(grpo).only(f"{NOISE}.enabled").fix
