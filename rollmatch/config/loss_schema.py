"""The ``loss`` and ``matching`` sections of the schema: the objective (rollout-matching targets or
GRPO) and its weights, and how rollouts are matched to the ground truth.

Owns the pydantic models; every key's default and description lives here once. Leaves out: the rules
across them (``config.rules``, ``config.objective_rules``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rollmatch.config.section import Section


# ----------------------------------------------------------------------------------------------- loss
class GrpoConfig(Section):
    """`loss.objective: grpo`: rewards, advantages and the clipped policy-gradient loss (docs/detection.md, "Objectives")."""

    reward: Literal["f1", "f1_iou"] = Field(
        "f1",
        description="Reward of a valid rollout from the strict parse + Hungarian match (training `matching.*`): `f1` = 2 TP / (predictions + GT); `f1_iou` weighs each match by its IoU. Invalid elements count as predictions (false positives); no GT and no prediction scores 1.",
    )
    invalid_reward: float = Field(
        0.0,
        description="The floor: reward of a rollout that is truncated (hit `max_new_tokens` or ended inside the list) or whose list is malformed (not a list, bad structure, text after it, unclosed).",
    )
    duplicate_penalty: float = Field(
        0.0,
        ge=0.0,
        description="Subtracted times the rollout's duplicate rate (valid predictions with the label of an earlier one and IoU >= 0.7 with it, over all predictions).",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="Advantage of sample k of a record: `r_k - mean` over the record's K rewards, divided by `std + 1e-4` with `group` (the record's K rewards, unbiased std as TRL and verl) or `batch` (every reward scored with it: the step's, or the ready pack's in async mode); `none`: not divided (Dr. GRPO).",
    )
    loss_type: Literal["dapo", "bnpo", "grpo", "dr_grpo"] = Field(
        "dapo",
        description="How token losses are averaged (TRL's `loss_type`). `dapo`: over every trained token of the optimizer step (all rows, micro-steps and ranks); `bnpo`: the same here (rollmatch's batch is the optimizer step; TRL's is each micro-batch, equal with one micro-batch on one process); `grpo`: each rollout's token mean, then the mean over the step's rollouts (short rollouts weigh more per token); `dr_grpo`: the step's token sum over (rollouts x `max_new_tokens`).",
    )
    mask_truncated_completions: bool = Field(
        False,
        description="Rollouts cut by `max_new_tokens` still get their (floor) reward and count in their group's advantages, but train no token (TRL's option of the same name); they still count in the `grpo` / `dr_grpo` normalisers, as in TRL.",
    )
    is_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = (
        Field(
            "token_truncate",
            description="Engine/learner correction of fresh tokens (TRL's `vllm_importance_sampling_mode`): the ratio `exp(learner - engine log-prob)` per token (`token_*`) or its product over the rollout (`sequence_*`) weighs the token's loss, capped at `is_cap` (`*_truncate`) or zeroed above it (`*_mask`); no gradient through it. The PPO ratio of such a token is then taken against the learner (1 on a fresh rollout). Tokens trained a step or more after sampling keep the engine's log-prob in the PPO ratio and weigh 1. `none`: every ratio against the engine's log-prob (engine mismatch and staleness in one ratio).",
        )
    )
    is_cap: float = Field(
        3.0,
        gt=1.0,
        description="Cap of the engine/learner correction (TRL's `vllm_importance_sampling_clip_max`, default 3).",
    )
    clip_eps: float = Field(
        0.2,
        gt=0.0,
        lt=1.0,
        description="PPO clip: the ratio to the behaviour policy is clipped to [1 - clip_eps, 1 + clip_eps_high] (TRL: `epsilon`).",
    )
    clip_eps_high: float | None = Field(
        None,
        gt=0.0,
        description="Upper clip (asymmetric, e.g. 0.28; TRL: `epsilon_high`); null: equal to `clip_eps`.",
    )
    max_ratio: float = Field(
        3.0,
        gt=1.0,
        description="Dual clip (verl's `clip_ratio_c`, TRL's `delta`): a token with a negative advantage whose ratio to the behaviour policy exceeds this gets the constant loss `-max_ratio * A` and no gradient, bounding how far stale rollouts (packing carry, async packs) can push.",
    )
    kl_coef: float = Field(
        0.0,
        ge=0.0,
        description="Weight of the per-token KL (k3 estimator) to the starting weights (TRL: `beta`), at the sampling temperature; > 0 keeps a frozen copy of the model (one more copy of the weights in memory, one more forward per row). Refused with ZeRO-3 / FSDP (the frozen copy is not sharded).",
    )


class NoiseKindsConfig(Section):
    """`loss.noise_objects`: how often each kind of noise object is drawn (relative weights)."""

    jittered: float = Field(
        0.5,
        ge=0.0,
        description="Weight of a copy of a GT box with each side moved by a truncated-normal fraction of the box's size (std `loss.noise_objects.jitter`, cut at 2 std): a near-duplicate, Pix2Seq's duplicate box. Needs GT objects: a record without any draws `random` boxes only (none when `random` is 0).",
    )
    shifted: float = Field(
        0.25,
        ge=0.0,
        description="Weight of a GT box's size moved to a uniformly random centre (Pix2Seq's shifted box). Needs GT objects, like `jittered`.",
    )
    random: float = Field(
        0.25,
        ge=0.0,
        description="Weight of a box at a uniformly random centre whose sides are |truncated normal| of std `random_max_side / 2` of the image side (Pix2Seq's random box).",
    )

    @model_validator(mode="after")
    def _some_kind(self) -> NoiseKindsConfig:
        if self.random <= 0.0 and self.jittered + self.shifted <= 0.0:
            raise ValueError(
                "loss.noise_objects.kinds: every weight is 0; give at least one kind a weight > 0 (Pix2Seq: "
                "jittered 0.5, shifted 0.25, random 0.25)"
            )
        return self


class NoiseObjectsConfig(Section):
    """Noise objects in the SFT target (Pix2Seq's sequence augmentation; docs/detection.md, "Noise objects")."""

    enabled: bool = Field(
        False,
        description="Append noise objects after the real ones in every GT (SFT / Channel-A) target: their coordinate tokens weigh 0 (unsupervised), their label (`label`) and the list structure are supervised, so the model learns to end the real list and call the rest noise. Evaluation drops objects with the noise label before matching (`eval.noise_label`). Only with `custom.trainer_variant: sft`.",
    )
    pad_to: int | None = Field(
        None,
        ge=1,
        le=1000,
        description="Pad each record's list with noise objects to this many objects in all (Pix2Seq: to its maximum instances per image); a record with as many real objects gets none. Set exactly one of `pad_to`, `count`, `per_object` when enabled.",
    )
    count: int | None = Field(None, ge=1, le=1000, description="This many noise objects per record.")
    per_object: float | None = Field(
        None,
        gt=0.0,
        le=10.0,
        description="Noise objects per real object of the record, rounded half up (at least 1 on a record with objects; 0 on an empty one).",
    )
    kinds: NoiseKindsConfig = Field(default_factory=NoiseKindsConfig)
    jitter: float = Field(
        0.05,
        gt=0.0,
        le=1.0,
        description="`jittered` noise: std of each side's move, as a fraction of the box's width or height (Pix2Seq's duplicate jitter: 0.05).",
    )
    random_max_side: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="`random` noise: the sides are |N(0, (random_max_side / 2)^2)| of the image side, cut at 2 std (Pix2Seq: 1.0).",
    )
    label: str = Field(
        "noise",
        min_length=1,
        description="Label of every noise object; a record whose real objects use it is an error. Non-empty, without surrounding whitespace.",
    )
    label_weight: float = Field(
        1.0,
        ge=0.0,
        description="Weight of the noise objects' label tokens (Pix2Seq weighs its noise class token like its EOS, 0.1); the structure tokens of noise objects weigh 1, their coordinate tokens 0.",
    )
    seed: int = Field(
        0,
        ge=0,
        description="Seed of the noise: a record's noise objects are a function of (seed, record id, optimizer step), fresh each time the record is trained on, the same on a rerun.",
    )

    @field_validator("label")
    @classmethod
    def _clean_label(cls, label: str) -> str:
        if label != label.strip() or not label.strip():
            raise ValueError(
                f"loss.noise_objects.label = {label!r}: give a non-empty label without surrounding whitespace, "
                "e.g. noise"
            )
        return label

    @model_validator(mode="after")
    def _one_count(self) -> NoiseObjectsConfig:
        given = [name for name in ("pad_to", "count", "per_object") if getattr(self, name) is not None]
        if self.enabled and len(given) != 1:
            raise ValueError(
                f"loss.noise_objects: enabled with {given or 'none'} of pad_to / count / per_object set; set "
                "exactly one (e.g. pad_to: the largest object count of the data, as Pix2Seq)"
            )
        return self


class LossConfig(Section):
    """The rollout-matching target and its per-token loss weights (prompt tokens always weigh 0).

    Targets, weights and why the default is what it is: docs/detection.md, "Targets and loss weights".
    """

    target: Literal["prefix_fn", "reordered_gt"] = Field(
        "prefix_fn",
        description="Rollout-matching target. `prefix_fn`: the rollout's own prefix (`keep_prefix`) + the GT objects not in it + EOS. `reordered_gt`: the GT objects the rollout matched, in the rollout's order, with GT coordinates and labels, then the missed GT (canonical order); false positives, duplicates and invalid elements left out; every token supervised.",
    )
    prefix_weight: float = Field(
        0.0, ge=0.0, description="Weight of the rollout prefix's structure tokens (0: no loss on the prefix)."
    )
    desc_weight: float = Field(1.0, ge=0.0, description="Weight of label-value tokens in the appended tail.")
    keep_prefix: Literal["matched", "all"] = Field(
        "matched",
        description="`prefix_fn` only: `matched` keeps the rollout up to its first element that is not a matched prediction (false positive, duplicate, invalid), then appends every GT object not yet in it; `all` keeps every complete element and appends the missed GT (the list can only grow, see docs/detection.md).",
    )
    coord_sigma_bins: float = Field(
        1.0,
        ge=0.0,
        le=100.0,
        description="`coord_tokens`: width (in bins of 1/999 of the side) of the Gaussian soft target over coordinate tokens at a coordinate position; 0 = one-hot (plain CE with `coord_gate_weight: 1`).",
    )
    coord_gate_weight: float = Field(
        1.0,
        ge=0.0,
        description="`coord_tokens`: weight of `-log P(any coordinate token)` at coordinate positions (keeps the mass on coordinate tokens).",
    )
    coord_w1_weight: float = Field(
        0.0,
        ge=0.0,
        description="`coord_tokens`: weight of the 1-D Wasserstein distance between the predicted and the target bin distribution (in units of the image side).",
    )
    geometry_l1_weight: float = Field(
        0.0,
        ge=0.0,
        description="`coord_tokens`: weight of SmoothL1 between each trained box's expected coordinates (softmax over bins) and its target box (units of the side).",
    )
    geometry_giou_weight: float = Field(
        0.0, ge=0.0, description="`coord_tokens`: weight of 1 - GIoU of the same expected and target boxes."
    )
    matched_prefix: Literal["none", "supervise"] = Field(
        "supervise",
        description="`prefix_fn` only: `supervise` rewrites each kept matched element to its GT's serialization and supervises its coordinate tokens (weight 1) and label tokens (`desc_weight`); structure tokens keep `prefix_weight`. With `keep_prefix: all` every matched element is rewritten, also after a false positive, and the kept false positives, duplicates and invalid elements stay in the context at weight 0 (training after the model's own mistakes). `none`: the prefix is the rollout's own tokens, unsupervised. Unset, it is `supervise` with `keep_prefix: matched` (the learning-signal study's best target, docs/detection.md) and `none` elsewhere; `target: reordered_gt` refuses `supervise`.",
    )
    missed_weight: float = Field(
        1.0,
        ge=0.0,
        description="Rollout-matching targets: factor on the weights of the appended missed-GT objects (their separators, coordinates and labels); the closing `]` and EOS keep weight 1.",
    )
    fp_unlikelihood_weight: float = Field(
        0.0,
        ge=0.0,
        description="`keep_prefix: all` only: weight of an unlikelihood term `-log(1 - p(token))` on the first token of each kept false positive or duplicate that no correct continuation shares (its first wrong coordinate character, its separator when no GT is left); summed with the CE and divided by the same step total of CE weights. 0: off. docs/detection.md.",
    )

    objective: Literal["rollout_matching", "grpo"] = Field(
        "rollout_matching",
        description="Channel-B objective. `rollout_matching`: teacher-forced CE on the targets below. `grpo`: policy gradient on the rollout tokens with a detection reward (`loss.grpo`), advantages normalised within each record's `rollouts_per_record` samples (K >= 2, sampling decoding).",
    )
    grpo: GrpoConfig = Field(default_factory=GrpoConfig)
    noise_objects: NoiseObjectsConfig = Field(default_factory=NoiseObjectsConfig)

    @model_validator(mode="before")
    @classmethod
    def _matched_prefix_where_it_applies(cls, data: Any) -> Any:
        """Unset ``matched_prefix``: ``supervise`` where it applies, else ``none``, so ``target:
        reordered_gt`` or ``keep_prefix: all`` alone is a whole config; an explicit value is kept (and a
        combination that cannot apply is refused by check-config)."""
        if isinstance(data, dict) and "matched_prefix" not in data:
            applies = (
                data.get("target", "prefix_fn") == "prefix_fn"
                and data.get("keep_prefix", "matched") == "matched"
            )
            data = {**data, "matched_prefix": "supervise" if applies else "none"}
        return data


class MatchingConfig(Section):
    """Hungarian matching of parsed predictions to ground truth."""

    iou_threshold: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="A pair can match iff IoU > 0 and IoU >= this (0: any overlap; boxes that only touch never match).",
    )
    label_mode: Literal["ignore", "require"] = Field(
        "require",
        description="`require`: a label mismatch is no match (label-aware F1, what detection papers report); `ignore`: geometry only.",
    )
    fp_cost: float = Field(1.0, ge=0.0, description="Cost of leaving a prediction unmatched (dummy column).")
    fn_cost: float = Field(1.0, ge=0.0, description="Cost of leaving a GT object unmatched (dummy row).")
