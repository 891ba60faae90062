"""Ignore (crowd) regions: a prediction on one is neither a match nor a false positive, in matching,
metrics, mAP (as pycocotools scores ``iscrowd`` GT), GRPO rewards and the unlikelihood flags."""

from __future__ import annotations

import pytest

from rollmatch.config.schema import LossConfig, MatchingConfig
from rollmatch.detection.codec import QwenJsonCodec
from rollmatch.detection.matching import hungarian_match
from rollmatch.detection.metrics import DetectionCounts, coco_map
from rollmatch.detection.objects import DetObject
from rollmatch.detection.rewards import detection_reward
from rollmatch.detection.scoring import score_response
from rollmatch.detection.targets import build_matched_target
from tests.detection.test_supervised_targets import EXTENT, GTS, A, B, C, element

CROWD = DetObject("person", (600, 600, 990, 990))
ON_CROWD = DetObject("person", (700, 700, 760, 800))  # wholly inside the crowd box: IoU with it ~0.04
OFF = DetObject("person", (300, 800, 400, 900))


def test_a_prediction_on_a_crowd_region_is_ignored_not_a_false_positive() -> None:
    preds = [A, ON_CROWD, OFF]
    plain = hungarian_match(preds, GTS)
    assert plain.fp == [1, 2] and plain.ignored == []
    crowd = hungarian_match(preds, GTS, ignore_regions=[CROWD])
    assert crowd.pairs == plain.pairs and crowd.fn == plain.fn
    assert crowd.fp == [2] and crowd.ignored == [1]
    # any number of predictions may fall on one region; with no GT at all they are still ignored
    assert hungarian_match([ON_CROWD, ON_CROWD], [], ignore_regions=[CROWD]).ignored == [0, 1]


def test_a_crowd_region_needs_its_label_under_label_mode_require() -> None:
    other = DetObject("bicycle", ON_CROWD.bbox)
    assert hungarian_match([other], GTS, ignore_regions=[CROWD]).fp == [0]
    ignored = hungarian_match([other], GTS, label_mode="ignore", ignore_regions=[CROWD])
    assert ignored.ignored == [0] and ignored.fp == []


def test_a_crowd_region_never_takes_a_prediction_from_a_real_object() -> None:
    # a region covering A: the prediction still matches A
    match = hungarian_match(
        [A], GTS, label_mode="ignore", ignore_regions=[DetObject("x", (0, 0, 1000, 1000))]
    )
    assert [(p, g) for p, g, _ in match.pairs] == [(0, 0)] and match.ignored == []


def test_ignored_predictions_leave_precision_and_f1_as_without_them() -> None:
    counts, without = DetectionCounts(), DetectionCounts()
    counts.add(hungarian_match([A, ON_CROWD], GTS, ignore_regions=[CROWD]), 2, 3)
    without.add(hungarian_match([A], GTS), 1, 3)
    assert (counts.precision, counts.recall, counts.f1) == (without.precision, without.recall, without.f1)
    assert counts.ignored == 1 and DetectionCounts.from_sums(counts.to_sums()) == counts


def test_map_ignores_a_detection_on_a_crowd_region_as_pycocotools_does() -> None:
    labels = ["red square", "blue circle", "fish", "person"]
    gts = [*GTS, OFF]  # one real person besides the crowd
    # the crowd detection is scored highest: as a false positive it would halve the person AP
    predictions = [[(ON_CROWD, 1.0), (A, 0.9), (B, 0.8), (C, 0.7), (OFF, 0.6)]]
    with_crowd = coco_map(predictions, [gts], labels, ignore_regions=[[CROWD]])
    without = coco_map(predictions, [gts], labels)
    assert with_crowd["map_50"] == pytest.approx(1.0)
    assert without["map_50"] < 0.9


def test_grpo_reward_and_unlikelihood_flags_skip_crowd_predictions(codec: QwenJsonCodec) -> None:
    text = "[" + ", ".join(element(o) for o in (A, B, C, ON_CROWD)) + "]"
    ids = codec.tokenizer.encode(text, add_special_tokens=False)

    def scored(regions: list[DetObject]):
        return score_response(
            codec,
            ids,
            GTS,
            extent=EXTENT,
            hit_max_tokens=False,
            matching=MatchingConfig(),
            ignore_regions=regions,
        )

    assert detection_reward(scored([CROWD])).value == 1.0  # every GT found, nothing wrong
    assert detection_reward(scored([])).value == pytest.approx(6 / 7)  # the crowd box as a false positive
    eos = codec.tokenizer.convert_tokens_to_ids(codec.tokenizer.eos_token)
    loss = LossConfig(keep_prefix="all", matched_prefix="supervise", fp_unlikelihood_weight=1.0)

    def flags(regions: list[DetObject]) -> int:
        s = scored(regions)
        t = build_matched_target(
            s.parse, GTS, s.match, codec=codec, tokenizer=codec.tokenizer, eos_token_id=eos, loss=loss
        )
        return sum(1 for u in t.unlikelihood_weights if u > 0)

    assert flags([]) == 1 and flags([CROWD]) == 0  # no mistake to unlearn on a crowd
