"""Detection counts, parse counts and COCO mAP (pycocotools) on hand cases and real annotations."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from rollmatch.detection.codec import ParseResult
from rollmatch.detection.matching import MatchResult, hungarian_match
from rollmatch.detection.metrics import AnswerCounts, DetectionCounts, ParseCounts, coco_map, duplicate_counts
from rollmatch.detection.objects import DetObject, to_frame
from rollmatch.errors import DataError, RollmatchError

RACCOON = Path("/work/shared/data/raccoon/data/raccoon_labels.csv")
FISH = DetObject("fish", (0, 0, 100, 100))
SHARK = DetObject("shark", (200, 200, 400, 300))


def test_detection_counts_accumulate_and_merge() -> None:
    counts = DetectionCounts()
    counts.add(MatchResult(pairs=[(0, 1, 0.8), (2, 0, 0.6)], fn=[2], fp=[1]), n_pred=3, n_gt=3)
    counts.add(MatchResult(pairs=[], fn=[0], fp=[]), n_pred=0, n_gt=1)
    assert (counts.tp, counts.fp, counts.fn) == (2, 1, 2)
    assert counts.precision == pytest.approx(2 / 3) and counts.recall == pytest.approx(2 / 4)
    assert counts.f1 == pytest.approx(2 * 2 / (2 * 2 + 1 + 2)) and counts.mean_iou == pytest.approx(0.7)
    total = counts.merge(DetectionCounts(tp=1, fp=0, fn=0, iou_sum=1.0))
    assert (total.tp, total.mean_iou) == (3, pytest.approx(2.4 / 3)) and counts.tp == 2
    assert DetectionCounts.from_sums(total.to_sums()) == total
    assert counts.as_metrics() == {
        "match/precision": pytest.approx(2 / 3),
        "match/recall": 0.5,
        "match/f1": pytest.approx(4 / 7),
        "match/mean_iou": pytest.approx(0.7),
        "match/fn": 2.0,
        "match/fp": 1.0,
    }


def test_detection_counts_edge_cases() -> None:
    assert (DetectionCounts().precision, DetectionCounts().recall, DetectionCounts().f1) == (1.0, 1.0, 1.0)
    only_missed = DetectionCounts(fn=3)
    assert (only_missed.precision, only_missed.recall, only_missed.mean_iou) == (0.0, 0.0, 0.0)
    with pytest.raises(RollmatchError, match="does not fit 2 predictions"):
        DetectionCounts().add(hungarian_match([FISH], [FISH]), n_pred=2, n_gt=1)


def test_parse_counts() -> None:
    counts = ParseCounts()
    base = {"prefix_token_ids": [1], "prefix_text": "[", "has_complete_element": True}
    counts.add(
        ParseResult(objects=[FISH, SHARK], num_complete=3, invalid={"bad_coord": 1}, truncated=False, **base)
    )
    counts.add(
        ParseResult(
            objects=[], num_complete=1, invalid={"bad_coord": 1, "cut_mismatch": 1}, truncated=True, **base
        )
    )
    assert (counts.responses, counts.truncated) == (2, 1)
    assert counts.as_metrics() == {
        "parse/valid": 2.0,
        "parse/invalid_bad_coord": 2.0,
        "parse/invalid_cut_mismatch": 1.0,
    }


def test_coco_map_perfect_predictions_score_one() -> None:
    gts = [[FISH, SHARK], [DetObject("fish", (500, 500, 600, 650))]]
    preds = [[(o, 0.9) for o in image] for image in gts]
    result = coco_map(preds, gts, labels=["fish", "shark"])
    assert result == {"map": 1.0, "map_50": 1.0, "map_75": 1.0, "unknown_label_predictions": 0.0}


def test_coco_map_hand_case() -> None:
    # One category, two GT boxes, one found (high score) + one false positive (lower score):
    # precision 1 up to recall 0.5 -> 51 of COCO's 101 recall points.
    gts = [[FISH], [DetObject("fish", (500, 500, 600, 650))]]
    preds = [[(FISH, 0.9), (DetObject("fish", (800, 800, 900, 900)), 0.3)], []]
    result = coco_map(preds, gts, labels=["fish"])
    assert result["map_50"] == pytest.approx(51 / 101) and result["map"] == pytest.approx(51 / 101)
    # A box with IoU 0.6 counts at IoU 0.5 but not at 0.75.
    shifted = [[(DetObject("fish", (0, 0, 100, 60)), 0.8)], [(DetObject("fish", (500, 500, 600, 650)), 0.9)]]
    result = coco_map(shifted, gts, labels=["fish"])
    assert result["map_50"] == pytest.approx(1.0) and result["map_75"] == pytest.approx(51 / 101)


def test_coco_map_edge_cases() -> None:
    gts = [[FISH]]
    assert coco_map([[]], gts, labels=["fish"])["map"] == 0.0
    unknown = coco_map([[(DetObject("whale", (0, 0, 100, 100)), 0.9), (FISH, 0.8)]], gts, labels=["fish"])
    assert unknown["map"] == pytest.approx(1.0) and unknown["unknown_label_predictions"] == 1.0
    assert math.isnan(coco_map([[]], [[]], labels=["fish"])["map"])
    with pytest.raises(DataError, match="predictions for 2 images but GT for 1"):
        coco_map([[], []], gts, labels=["fish"])
    with pytest.raises(DataError, match=r"GT labels \['shark'\]"):
        coco_map([[]], [[SHARK]], labels=["fish"])


def test_coco_map_on_real_raccoon_boxes() -> None:
    images: dict[str, list[DetObject]] = {}
    for line in RACCOON.read_text().splitlines()[1:]:
        name, width, height, label, *xyxy = line.split(",")
        box = to_frame([float(v) for v in xyxy], (int(width), int(height)), "norm1000", (0, 0))
        images.setdefault(name, []).append(DetObject(label, box))
    gts = list(images.values())
    assert len(gts) == 200 and sum(len(g) for g in gts) == 217
    perfect = coco_map([[(o, 1.0) for o in g] for g in gts], gts, labels=["raccoon"])
    assert perfect["map"] == pytest.approx(1.0)
    half = coco_map(
        [[(o, 1.0) for o in g] if i % 2 == 0 else [] for i, g in enumerate(gts)], gts, labels=["raccoon"]
    )
    found = sum(len(g) for g in gts[::2]) / 217
    assert half["map_50"] == pytest.approx(
        sum(1 for r in range(101) if r / 100 <= found + 1e-9) / 101, abs=1e-6
    )


def test_answer_counts_duplicates_exact_count_and_recall_by_gt_count() -> None:
    a, b = DetObject("fish", (0, 0, 100, 100)), DetObject("shark", (300, 300, 400, 400))
    near_a = DetObject("fish", (0, 0, 100, 90))  # IoU 0.9 with a, same label
    near_a_other = DetObject("shark", (0, 0, 95, 100))  # IoU 0.95 with a, another label
    assert duplicate_counts([a, near_a, near_a_other, b]) == (1, 2)
    counts = AnswerCounts()
    counts.add([a, b], MatchResult(pairs=[(0, 0, 1.0), (1, 1, 1.0)]), 2)  # exact, all found
    counts.add([a, near_a], MatchResult(pairs=[(0, 0, 1.0)], fp=[1], fn=[1, 2]), 3)  # 1 of 3 found
    counts.add([], MatchResult(fn=list(range(9))), 9)  # crowded image: 9 GT, nothing found
    assert (counts.images, counts.exact_count, counts.duplicates) == (3, 1, 1)
    assert counts.recall_by_gt_count() == {"2": 1.0, "3": pytest.approx(1 / 3), "8+": 0.0}
    assert AnswerCounts.from_sums(counts.to_sums()) == counts
    assert counts.as_metrics(valid_objects=4)["answers/duplicate_rate"] == 0.25
