"""Cross-field rules of the Channel-B objective and of several rollouts per record.

Owns the static rules on ``loss.objective``, ``loss.grpo.*`` and
``custom.extra.rollout_matching.rollouts_per_record``; ``config.rules`` runs them with the others.
Each rule returns :class:`~rollmatch.errors.ConfigProblem` s and its docstring is its line in
docs/config.md.
"""

from __future__ import annotations

from rollmatch.config.schema import ROLLOUT_KEY, RollmatchConfig
from rollmatch.config.sharding import parameter_sharding
from rollmatch.errors import ConfigProblem

_RM = ROLLOUT_KEY
_K = f"{_RM}.rollouts_per_record"


def rule_rollouts_per_record(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """`rollouts_per_record` > 1 needs sampling decoding (`decoding.temperature` > 0); step mode's `stage2_ab.channel_b.rollouts_per_step` must be a multiple of it."""
    per_record = cfg.rollout.rollouts_per_record
    problems: list[ConfigProblem] = []
    if per_record > 1 and cfg.rollout.decoding.temperature == 0.0:
        problems.append(
            ConfigProblem(
                _K,
                per_record,
                f"greedy decoding ({_RM}.decoding.temperature: 0) gives {per_record} identical rollouts of a "
                f"record; set {_RM}.decoding.temperature > 0 (e.g. 1.0), or {_K}: 1",
            )
        )
    budget = cfg.stage2_ab.channel_b.rollouts_per_step
    if budget is not None and budget % per_record != 0:
        problems.append(
            ConfigProblem(
                "stage2_ab.channel_b.rollouts_per_step",
                budget,
                f"counts rollouts and must be a multiple of {_K} = {per_record} (every record brings "
                f"{per_record}); set it to {max(per_record, budget - budget % per_record)}",
            )
        )
    return problems


def rule_grpo(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """`loss.objective: grpo` needs `rollouts_per_record` >= 2 and a trainer variant that rolls out, takes no target weights (`loss.missed_weight`, `loss.fp_unlikelihood_weight`); `loss.grpo.clip_eps_high` needs a value below `loss.grpo.max_ratio - 1`; the rollout decoding must be plain tempered sampling (`top_p: 1`, `top_k: -1`, `repetition_penalty: 1`: the learner's log-probs are those of `softmax(logits / temperature)`); `loss.grpo.kl_coef` > 0 is refused with ZeRO-3 / FSDP."""
    loss = cfg.loss
    if loss.objective != "grpo":
        return []
    problems: list[ConfigProblem] = []
    if cfg.rollout.rollouts_per_record < 2:
        problems.append(
            ConfigProblem(
                _K,
                cfg.rollout.rollouts_per_record,
                "loss.objective: grpo normalises each reward within its record's samples, which needs at "
                f"least 2; set {_K}: 8 (or any K >= 2) with sampling decoding ({_RM}.decoding.temperature > 0)",
            )
        )
    if cfg.custom.trainer_variant == "sft":
        problems.append(
            ConfigProblem(
                "loss.objective",
                loss.objective,
                "custom.trainer_variant: sft never rolls out; use rollout_matching_sft or stage2_ab_training "
                "(Channel-B), or loss.objective: rollout_matching",
            )
        )
    for key, value, neutral in (
        ("fp_unlikelihood_weight", loss.fp_unlikelihood_weight, 0.0),
        ("missed_weight", loss.missed_weight, 1.0),
    ):
        if value != neutral:  # GRPO trains the rollout's own tokens: it builds no teacher-forced target
            problems.append(
                ConfigProblem(
                    f"loss.{key}",
                    value,
                    f"shapes rollout-matching targets, which loss.objective: grpo never builds; remove it "
                    f"(leave {neutral}) or use loss.objective: rollout_matching",
                )
            )
    problems.extend(_grpo_sampling_problems(cfg))
    if loss.grpo.kl_coef > 0 and parameter_sharding(cfg) != "none":
        problems.append(
            ConfigProblem(
                "loss.grpo.kl_coef",
                loss.grpo.kl_coef,
                f"the KL reference is an unsharded frozen copy of the model, which {parameter_sharding(cfg)} "
                "training does not shard or run; set loss.grpo.kl_coef: 0 (TRL's default beta) or train "
                "without ZeRO-3 / FSDP",
            )
        )
    high = loss.grpo.clip_eps if loss.grpo.clip_eps_high is None else loss.grpo.clip_eps_high
    if 1.0 + high >= loss.grpo.max_ratio:
        problems.append(
            ConfigProblem(
                "loss.grpo.max_ratio",
                loss.grpo.max_ratio,
                f"must exceed 1 + clip_eps_high (= {1.0 + high}), or the dual clip would cut inside the PPO "
                "clip range; raise max_ratio (default 3.0) or lower loss.grpo.clip_eps_high",
            )
        )
    return problems


def _grpo_sampling_problems(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """Decoding settings whose sampling distribution the learner does not reproduce.

    The learner's log-prob of a token is ``log_softmax(logits / temperature)``; every engine records the
    log-prob of the distribution it drew from. Top-p / top-k truncate and renormalise that distribution
    and the repetition penalty rescales logits by the history (HF and vLLM differently): a fresh
    rollout's ratio would then not be 1 and the update not the sampling policy's gradient.
    """
    decoding = cfg.rollout.decoding
    problems: list[ConfigProblem] = []
    for key, value, neutral, why in (
        ("top_p", decoding.top_p, 1.0, "truncates the sampling distribution"),
        ("top_k", decoding.top_k, -1, "truncates the sampling distribution"),
        ("repetition_penalty", decoding.repetition_penalty, 1.0, "rescales logits by the history"),
    ):
        if value != neutral and not (key == "top_k" and value == 0):
            problems.append(
                ConfigProblem(
                    f"{_RM}.decoding.{key}",
                    value,
                    f"{why}, which the GRPO learner's log-probs (log_softmax(logits / temperature)) do not "
                    f"reproduce, so the policy gradient would be biased; with loss.objective: grpo set "
                    f"{_RM}.decoding.{key}: {neutral} and control exploration with decoding.temperature",
                )
            )
    return problems


def rule_noise_objects(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """`loss.noise_objects.enabled` trains only with `custom.trainer_variant: sft`: rollout-matching and GRPO targets are built from the model's own answers, where noise objects have no defined target (a dropped noise object in a kept prefix, a noise object as reward); a noise-trained checkpoint can start them, with `eval.noise_label` set to score its answers."""
    if not cfg.loss.noise_objects.enabled or cfg.custom.trainer_variant == "sft":
        return []
    return [
        ConfigProblem(
            "loss.noise_objects.enabled",
            True,
            f"noise objects pad the SFT target only; custom.trainer_variant {cfg.custom.trainer_variant} builds "
            "its targets (and GRPO its rewards) from the model's own answers, where a noise object has no "
            "defined target. Set custom.trainer_variant: sft, or loss.noise_objects.enabled: false",
        )
    ]
