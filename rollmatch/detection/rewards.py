"""Detection rewards of rollouts and group-normalised advantages (pure: no torch).

Owns :func:`detection_reward` (one scored rollout -> :class:`DetectionReward`, from the same strict parse
and Hungarian match the rollout-matching targets use) and :func:`group_advantages` (one record's K
rewards -> K advantages). Leaves out: scoring itself (``detection.scoring``), the loss
(``training.grpo_loss``) and where the K rollouts come from (``training.segment_producers``).

Reward of a rollout (``loss.grpo``), worked examples in docs/detection.md:

- **malformed** (truncated: hit ``max_new_tokens`` or ended inside the list; or the list is not a list,
  has bad structure or text after it, or is never closed): ``invalid_reward`` (the floor);
- otherwise ``f1 = 2 TP / (P + G)`` with ``P`` the predictions (valid objects plus invalid elements,
  which count as false positives, less the predictions on an ignore region), ``G`` the GT objects and
  ``TP`` the matched pairs; ``f1_iou`` replaces
  ``TP`` by the sum of the matched pairs' IoU. No GT and no prediction: 1.
- minus ``duplicate_penalty`` x the duplicate rate (valid predictions with the label of an earlier one and
  IoU >= 0.7 with it, over ``P``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rollmatch.detection.codec import ELEMENT_REASONS, ParseResult
from rollmatch.detection.metrics import duplicate_counts
from rollmatch.detection.scoring import ScoredResponse

RewardKind = Literal["f1", "f1_iou"]
ScaleRewards = Literal["group", "batch", "none"]
# List-level outcomes that make a rollout malformed (``cut_mismatch`` is a tokenizer artefact of the
# cut, not the model's output, so it does not).
MALFORMED_REASONS = ("not_a_list", "not_object", "bad_structure", "text_after_list")
ADVANTAGE_EPS = 1e-4  # added to the group's standard deviation (``scale_rewards: group``)


@dataclass(frozen=True)
class DetectionReward:
    """A rollout's reward and what it was made of."""

    value: float
    malformed: bool  # scored the floor
    f1: float  # the detection term before the duplicate penalty (0 when malformed)
    duplicates: int


def is_malformed(parse: ParseResult) -> bool:
    """Truncated, never closed, or a list-level error (:data:`MALFORMED_REASONS`)."""
    return parse.truncated or not parse.closed or any(parse.invalid.get(r, 0) for r in MALFORMED_REASONS)


def detection_reward(
    scored: ScoredResponse,
    *,
    kind: RewardKind = "f1",
    invalid_reward: float = 0.0,
    duplicate_penalty: float = 0.0,
) -> DetectionReward:
    """The reward of one scored rollout (see the module docstring)."""
    parse = scored.parse
    if is_malformed(parse):
        return DetectionReward(value=invalid_reward, malformed=True, f1=0.0, duplicates=0)
    invalid_elements = sum(parse.invalid.get(reason, 0) for reason in ELEMENT_REASONS)
    # predictions on an ignore (crowd) region are neither hits nor false positives
    predictions = len(parse.objects) + invalid_elements - len(scored.match.ignored)
    total = predictions + len(scored.gt_objects)
    if total == 0:
        f1 = 1.0
    else:
        hits = (
            float(len(scored.match.pairs)) if kind == "f1" else sum(iou for _, _, iou in scored.match.pairs)
        )
        f1 = 2.0 * hits / total
    duplicates = duplicate_counts(parse.objects)[0]
    penalty = duplicate_penalty * duplicates / predictions if predictions else 0.0
    return DetectionReward(value=f1 - penalty, malformed=False, f1=f1, duplicates=duplicates)


def group_advantages(rewards: Sequence[float], scale: ScaleRewards = "group") -> list[float]:
    """Advantages of one record's K rewards: ``r_k - mean``, divided by ``std + ADVANTAGE_EPS`` (the
    unbiased std, as TRL and verl) with ``scale: group``. A group whose rewards are all equal gets zeros."""
    return batch_advantages([rewards], "group" if scale == "batch" else scale)[0]


def batch_advantages(groups: Sequence[Sequence[float]], scale: ScaleRewards = "group") -> list[list[float]]:
    """Advantages of several records' groups: ``r_k - group mean``, divided by ``std + ADVANTAGE_EPS``
    with the unbiased std of the group (``group``) or of every reward in ``groups`` (``batch``), or not
    divided (``none``), as TRL's ``scale_rewards``."""
    centred = [[r - sum(g) / len(g) for r in g] if g else [] for g in groups]
    if scale == "none":
        return centred
    if scale == "batch":
        std = unbiased_std([r for g in groups for r in g])
        return [[c / (std + ADVANTAGE_EPS) for c in g] for g in centred]
    return [
        [c / (unbiased_std(g) + ADVANTAGE_EPS) for c in cg] for g, cg in zip(groups, centred, strict=True)
    ]


def unbiased_std(values: Sequence[float]) -> float:
    """Sample standard deviation (divides by n - 1; 0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
