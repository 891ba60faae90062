"""Cross-field rules of the Channel-B objective and of several rollouts per record.

Owns the static rules on ``loss.objective``, ``loss.grpo.*`` and
``custom.extra.rollout_matching.rollouts_per_record``; ``config.rules`` runs them with the others.
Each rule returns :class:`~rollmatch.errors.ConfigProblem` s and its docstring is its line in
docs/config.md.
"""

from __future__ import annotations

from rollmatch.config.schema import ROLLOUT_KEY, RollmatchConfig
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
    """`loss.objective: grpo` needs `rollouts_per_record` >= 2 and a trainer variant that rolls out, takes no target weights (`loss.missed_weight`, `loss.fp_unlikelihood_weight`); `loss.grpo.clip_eps_high` needs a value below `loss.grpo.max_ratio - 1`."""
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
