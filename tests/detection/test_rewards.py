"""GRPO rewards on hand-made rollouts (matched, missed, false positive, duplicate, invalid, truncated)
and group-normalised advantages, from inline inputs."""

from __future__ import annotations

import math

import pytest

from rollmatch.config.schema import MatchingConfig
from rollmatch.detection.codec import QwenJsonCodec
from rollmatch.detection.objects import DetObject
from rollmatch.detection.rewards import ADVANTAGE_EPS, batch_advantages, detection_reward, group_advantages
from rollmatch.detection.scoring import score_response

EXTENT = (1000, 1000)
FISH = DetObject("fish", (100, 100, 300, 300))
SHARK = DetObject("shark", (500, 500, 700, 700))
GT = [FISH, SHARK]


def reward_of(codec: QwenJsonCodec, text: str, *, hit_max_tokens: bool = False, **settings: object):
    ids = codec.tokenizer.encode(text, add_special_tokens=False)
    scored = score_response(
        codec, ids, GT, extent=EXTENT, hit_max_tokens=hit_max_tokens, matching=MatchingConfig()
    )
    return detection_reward(scored, **settings)


def listed(codec: QwenJsonCodec, objects: list[DetObject]) -> str:
    return codec.serialize_in_order(objects)


def test_every_gt_matched_scores_one(codec: QwenJsonCodec) -> None:
    reward = reward_of(codec, listed(codec, GT))
    assert reward.value == 1.0 and not reward.malformed


def test_a_missed_object_scores_two_tp_over_predictions_plus_gt(codec: QwenJsonCodec) -> None:
    reward = reward_of(codec, listed(codec, [FISH]))  # TP 1, P 1, G 2: 2 / 3
    assert reward.value == pytest.approx(2 / 3, rel=1e-12)


def test_a_false_positive_lowers_precision(codec: QwenJsonCodec) -> None:
    ghost = DetObject("fish", (800, 50, 900, 150))
    reward = reward_of(codec, listed(codec, [*GT, ghost]))  # TP 2, P 3, G 2: 4 / 5
    assert reward.value == pytest.approx(0.8, rel=1e-12)


def test_a_duplicate_is_a_false_positive_and_can_be_penalised(codec: QwenJsonCodec) -> None:
    again = DetObject("fish", (100, 100, 300, 290))  # IoU 0.95 with the first fish
    text = listed(codec, [FISH, again, SHARK])
    plain = reward_of(codec, text)  # TP 2, P 3, G 2: 4 / 5
    penalised = reward_of(codec, text, duplicate_penalty=0.3)  # minus 0.3 x 1 duplicate / 3 predictions
    assert plain.value == pytest.approx(0.8, rel=1e-12) and plain.duplicates == 1
    assert penalised.value == pytest.approx(0.8 - 0.1, rel=1e-12)


def test_an_invalid_element_counts_as_a_prediction(codec: QwenJsonCodec) -> None:
    text = '[{"bbox_2d": [100, 100, 300, 300], "label": "fish"}, {"bbox_2d": [9, 9, 1, 1], "label": "x"}]'
    reward = reward_of(codec, text)  # the degenerate box is invalid: TP 1, P 2, G 2: 2 / 4
    assert reward.value == pytest.approx(0.5, rel=1e-12) and not reward.malformed


@pytest.mark.parametrize(
    ("text", "hit_max_tokens"),
    [
        ('[{"bbox_2d": [100, 100, 300, 300], "label": "fish"}', True),  # hit max_new_tokens
        ('[{"bbox_2d": [100, 100, 300, 300], "label": "fi', False),  # ended inside an element
        ("the fish is at the top left", False),  # not a list
        ('[{"bbox_2d": [100, 100, 300, 300], "label": "fish"}] done', False),  # text after the list
    ],
)
def test_a_malformed_rollout_scores_the_floor(codec: QwenJsonCodec, text: str, hit_max_tokens: bool) -> None:
    reward = reward_of(codec, text, hit_max_tokens=hit_max_tokens, invalid_reward=-0.5)
    assert reward.malformed and reward.value == -0.5


def test_f1_iou_weighs_each_match_by_its_iou(codec: QwenJsonCodec) -> None:
    half = DetObject("shark", (500, 500, 700, 600))  # IoU 0.5 with the shark
    reward = reward_of(codec, listed(codec, [FISH, half]), kind="f1_iou")  # 2 (1 + 0.5) / 4
    assert reward.value == pytest.approx(0.75, rel=1e-9)
    assert reward_of(codec, listed(codec, [FISH, half])).value == pytest.approx(1.0, rel=1e-12)


def test_no_gt_and_an_empty_list_scores_one(codec: QwenJsonCodec) -> None:
    scored = score_response(
        codec,
        codec.tokenizer.encode("[]", add_special_tokens=False),
        [],
        extent=EXTENT,
        hit_max_tokens=False,
        matching=MatchingConfig(),
    )
    assert detection_reward(scored).value == 1.0


def test_group_advantages_are_centred_and_scaled_by_the_group_std() -> None:
    rewards = [1.0, 0.5, 0.0, 0.5]
    std = math.sqrt((0.25 + 0 + 0.25 + 0) / 3)  # unbiased, as TRL's torch.std and verl
    assert group_advantages(rewards, "group") == pytest.approx(
        [0.5 / (std + ADVANTAGE_EPS), 0.0, -0.5 / (std + ADVANTAGE_EPS), 0.0], rel=1e-12
    )
    assert group_advantages(rewards, "none") == pytest.approx([0.5, 0.0, -0.5, 0.0], rel=1e-12)
    assert group_advantages([0.3, 0.3, 0.3], "group") == [0.0, 0.0, 0.0]  # no signal in the group
    assert group_advantages([], "group") == []


def test_batch_scaling_divides_by_the_std_of_every_reward() -> None:
    """TRL's ``scale_rewards: batch``: centred within each group, divided by the std of all rewards."""
    groups = [[1.0, 0.0], [0.5, 0.5, 0.2]]
    flat = [1.0, 0.0, 0.5, 0.5, 0.2]
    mean = sum(flat) / 5
    std = math.sqrt(sum((r - mean) ** 2 for r in flat) / 4)
    out = batch_advantages(groups, "batch")
    assert out[0] == pytest.approx([0.5 / (std + ADVANTAGE_EPS), -0.5 / (std + ADVANTAGE_EPS)], rel=1e-12)
    assert out[1] == pytest.approx(
        [0.1 / (std + ADVANTAGE_EPS)] * 2 + [-0.2 / (std + ADVANTAGE_EPS)], rel=1e-9
    )
    assert batch_advantages(groups, "group")[0] == group_advantages(groups[0], "group")
