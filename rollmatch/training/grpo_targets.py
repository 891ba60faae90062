"""GRPO segments of one record's K rollouts: reward each, normalise within the group, keep the tokens.

Owns :class:`PolicyTokens` (what a policy-gradient segment carries besides ids and weights),
:func:`policy_token_weights` (``loss.grpo.loss_type`` as token weights and normaliser shares) and
:class:`GrpoGroups` (``loss.objective: grpo``: records' rollouts -> their rewards, normalised advantages
(``scale_rewards``) and per-token training data, plus the ``grpo/*`` reward sums). Leaves out: rolling out
(``training.segment_producers``), the reward arithmetic (``detection.rewards``) and the loss
(``training.grpo_loss``).

A GRPO segment is the prompt + the rollout's own tokens, the stop token included when the rollout
stopped on one; every response token has the ``loss_type``'s weight (1 by default; 0 for a truncated
rollout under ``mask_truncated_completions``), the rollout's advantage and the log-prob the behaviour
policy sampled it with (of the tempered distribution), and the segment the rollout's weight version. A rollout that sampled a media placeholder (``<|image_pad|>``: the
model would expand it into vision features) scores the floor and trains only its tokens before it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from rollmatch.config.schema import RollmatchConfig
from rollmatch.data.prompts import EncodedPrompt, PromptEncoder
from rollmatch.data.records import Record
from rollmatch.detection.codec import ObjectCodec
from rollmatch.detection.rewards import DetectionReward, batch_advantages, detection_reward
from rollmatch.detection.scoring import ScoredResponse, score_response
from rollmatch.detection.targets import TargetSequence
from rollmatch.errors import BackendError
from rollmatch.rollout.types import Rollout

MEDIA_TOKENS = ("<|image_pad|>", "<|video_pad|>")


@dataclass(frozen=True)
class PolicyTokens:
    """Per response token of a policy-gradient segment: its advantage and its behaviour log-prob; the
    rollout's weight version, and its share of the step's loss normaliser when that is not the sum of its
    token weights (``loss_type: dr_grpo``, masked truncated rollouts)."""

    advantages: list[float]
    behaviour_logprobs: list[float]
    weight_version: int = 0
    normaliser: float | None = None


def policy_token_weights(
    trained_tokens: int, loss_type: str, max_new_tokens: int, masked: bool = False
) -> tuple[float, float]:
    """``(weight of each trained token, the rollout's share of the step normaliser)`` for ``loss.grpo.
    loss_type``, so that ``sum(w * loss) / sum(normaliser)`` over the step is TRL's aggregation: ``dapo`` /
    ``bnpo`` the token mean, ``grpo`` the mean over rollouts of each one's token mean, ``dr_grpo`` the token
    sum over rollouts x ``max_new_tokens``. A masked rollout trains nothing and keeps its ``grpo`` /
    ``dr_grpo`` share (TRL's means count it)."""
    if loss_type == "grpo":
        return (0.0 if masked else 1.0 / max(trained_tokens, 1)), 1.0
    if loss_type == "dr_grpo":
        return (0.0 if masked else 1.0), float(max_new_tokens)
    return (0.0 if masked else 1.0), (0.0 if masked else float(trained_tokens))


class GrpoGroups:
    """``loss.objective: grpo``: a record's K rollouts -> K policy-gradient targets."""

    def __init__(self, encoder: PromptEncoder, codec: ObjectCodec, cfg: RollmatchConfig):
        self.encoder = encoder
        self.codec = codec
        self.cfg = cfg
        tokenizer = encoder.tokenizer
        # Media placeholders the model expands into vision features: a sampled one cannot be trained on.
        vocab = tokenizer.get_vocab()
        self.media_token_ids = {int(vocab[token]) for token in MEDIA_TOKENS if token in vocab}

    def targets(
        self, record: Record, encoded: EncodedPrompt, group: Sequence[Rollout]
    ) -> list[tuple[TargetSequence, Counter[str], PolicyTokens]]:
        return self.targets_of_groups([(record, encoded, group)])[0]

    def targets_of_groups(
        self, groups: Sequence[tuple[Record, EncodedPrompt, Sequence[Rollout]]]
    ) -> list[list[tuple[TargetSequence, Counter[str], PolicyTokens]]]:
        """Each record's K rollouts -> K targets; ``scale_rewards: batch`` divides by the std of every
        reward in ``groups`` (one rollout call's)."""
        grpo = self.cfg.loss.grpo
        scored_groups = [self._rewards(record, encoded, group) for record, encoded, group in groups]
        advantages = batch_advantages(
            [[r.value for r in rewards] for _, rewards in scored_groups], grpo.scale_rewards
        )
        return [
            self._group_targets(group, scored, rewards, group_advantages)
            for (_, _, group), (scored, rewards), group_advantages in zip(
                groups, scored_groups, advantages, strict=True
            )
        ]

    def _rewards(
        self, record: Record, encoded: EncodedPrompt, group: Sequence[Rollout]
    ) -> tuple[list[ScoredResponse], list[DetectionReward]]:
        grpo = self.cfg.loss.grpo
        gt = self.encoder.gt_objects(record, encoded)
        crowds = self.encoder.ignore_regions(record, encoded)  # a prediction there costs no reward
        scored = [
            score_response(
                self.codec,
                rollout.response_token_ids,
                gt,
                extent=self.encoder.frame_extent(encoded),
                hit_max_tokens=rollout.hit_max_tokens,
                matching=self.cfg.matching,
                ignore_regions=crowds,
            )
            for rollout in group
        ]
        rewards = [
            detection_reward(
                s,
                kind=grpo.reward,
                invalid_reward=grpo.invalid_reward,
                duplicate_penalty=grpo.duplicate_penalty,
            )
            if self._media_cut(rollout) is None
            else DetectionReward(value=grpo.invalid_reward, malformed=True, f1=0.0, duplicates=0)
            for s, rollout in zip(scored, group, strict=True)
        ]
        return scored, rewards

    def _group_targets(
        self,
        group: Sequence[Rollout],
        scored: Sequence[ScoredResponse],
        rewards: Sequence[DetectionReward],
        advantages: Sequence[float],
    ) -> list[tuple[TargetSequence, Counter[str], PolicyTokens]]:
        grpo = self.cfg.loss.grpo
        values = [r.value for r in rewards]
        group_sums: Counter[str] = Counter(
            {"grpo/groups": 1, "grpo/groups_zero_std": int(max(values) == min(values))}
        )
        out = []
        for index, (rollout, score, reward, advantage) in enumerate(
            zip(group, scored, rewards, advantages, strict=True)
        ):
            ids, behaviour = self._sampled_tokens(rollout)
            masked = grpo.mask_truncated_completions and rollout.hit_max_tokens
            weight, normaliser = policy_token_weights(
                len(ids), grpo.loss_type, self.cfg.rollout.max_new_tokens, masked
            )
            target = TargetSequence(
                token_ids=ids, weights=[weight] * len(ids), num_prefix_tokens=len(ids), text=rollout.text
            )
            sums: Counter[str] = Counter(score.counts().to_sums())
            sums.update(
                {
                    "samples": 1,
                    "rollout/count": 1,
                    "rollout/tokens": len(rollout.response_token_ids),
                    "rollout/weight_version_sum": rollout.weight_version,
                    "grpo/rollouts": 1,
                    "grpo/reward_sum": reward.value,
                    "grpo/reward_sq_sum": reward.value * reward.value,
                    "grpo/malformed": int(reward.malformed),
                    "grpo/masked_truncated": int(masked),
                    "grpo/advantage_abs_sum": abs(advantage),
                }
            )
            if index == 0:
                sums.update(group_sums)
            policy = PolicyTokens(
                [advantage] * len(ids),
                behaviour,
                weight_version=rollout.weight_version,
                normaliser=None if normaliser == weight * len(ids) else normaliser,
            )
            out.append((target, sums, policy))
        return out

    def _sampled_tokens(self, rollout: Rollout) -> tuple[list[int], list[float]]:
        """The rollout's sampled ids (the stop token appended when it stopped on one) and their log-probs."""
        logprobs = rollout.response_logprobs
        if logprobs is None or len(logprobs) != len(rollout.response_token_ids):
            raise BackendError(
                f"sample {rollout.sample_id!r}: the {rollout.provenance.backend} rollout carries "
                f"{'no' if logprobs is None else len(logprobs)} behaviour log-probs for "
                f"{len(rollout.response_token_ids)} tokens; loss.objective: grpo needs one per sampled token"
            )
        ids, values = list(rollout.response_token_ids), list(logprobs)
        cut = self._media_cut(rollout)
        if cut is not None:  # malformed (floor reward): train the tokens before the placeholder only
            return ids[:cut], values[:cut]
        if rollout.stop_logprob is not None and rollout.stop_token_id is not None:
            ids.append(rollout.stop_token_id)
            values.append(rollout.stop_logprob)
        return ids, values

    def _media_cut(self, rollout: Rollout) -> int | None:
        """Index of the first media placeholder the rollout sampled, or None."""
        return next(
            (i for i, token in enumerate(rollout.response_token_ids) if token in self.media_token_ids), None
        )
