"""Hungarian matching: hand cases, config plumbing and real annotations (Aquarium, YOLO labels)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from rollmatch.config.schema import MatchingConfig
from rollmatch.detection.matching import hungarian_match
from rollmatch.detection.objects import DetObject, to_frame
from rollmatch.errors import ConfigError

AQUARIUM = Path("/work/shared/data/aquarium_combined_v2")


def box(label: str, x1: int, y1: int, x2: int, y2: int) -> DetObject:
    return DetObject(label, (x1, y1, x2, y2))


GTS = [box("fish", 0, 0, 100, 100), box("shark", 200, 200, 400, 300), box("fish", 500, 500, 600, 650)]


def test_identical_lists_match_completely_in_any_order() -> None:
    preds = [GTS[2], GTS[0], GTS[1]]
    result = hungarian_match(preds, GTS)
    assert sorted(result.pairs) == [(0, 2, 1.0), (1, 0, 1.0), (2, 1, 1.0)]
    assert result.fn == [] and result.fp == []


def test_disjoint_boxes_are_all_false_positives_and_negatives() -> None:
    preds = [box("fish", 700, 0, 800, 50), box("fish", 900, 900, 1000, 1000)]
    result = hungarian_match(preds, GTS)
    assert result.pairs == [] and result.fn == [0, 1, 2] and result.fp == [0, 1]


@pytest.mark.parametrize(
    ("preds", "gts", "fn", "fp"), [([], GTS, [0, 1, 2], []), (GTS, [], [], [0, 1, 2]), ([], [], [], [])]
)
def test_empty_sides_are_normal(
    preds: list[DetObject], gts: list[DetObject], fn: list[int], fp: list[int]
) -> None:
    result = hungarian_match(preds, gts)
    assert result.pairs == [] and result.fn == fn and result.fp == fp


def test_iou_threshold_gates_pairs() -> None:
    gt = [box("fish", 0, 0, 100, 100)]
    pred = [box("fish", 0, 0, 100, 60)]  # IoU 0.6
    assert hungarian_match(pred, gt, iou_threshold=0.6).pairs == [(0, 0, pytest.approx(0.6))]
    assert hungarian_match(pred, gt, iou_threshold=0.61).pairs == []
    assert hungarian_match(pred, gt, iou_threshold=0.61).fn == [0]
    # no overlap never matches, even at threshold 0
    assert hungarian_match([box("fish", 200, 200, 300, 300)], gt, iou_threshold=0.0).pairs == []


def test_iou_threshold_zero_means_any_overlap() -> None:
    """The edge of ``matching.iou_threshold: 0``: IoU > 0 is required at any threshold, so boxes that
    only touch (IoU exactly 0) never match, while the smallest overlap does."""
    gt = [box("fish", 0, 0, 100, 100)]
    touching = [box("fish", 100, 0, 200, 100)]  # shares the edge x = 100
    one_pixel = [box("fish", 99, 99, 200, 200)]  # IoU 1 / (10_000 + 10_201 - 1)
    assert hungarian_match(touching, gt, iou_threshold=0.0).pairs == []
    assert hungarian_match(touching, gt, iou_threshold=0.0).fp == [0]
    assert hungarian_match(one_pixel, gt, iou_threshold=0.0).pairs == [(0, 0, pytest.approx(1 / 20_200))]
    description = MatchingConfig.model_fields["iou_threshold"].description or ""
    assert "IoU > 0" in description and "only touch never match" in description  # docs/config.md


def test_assignment_maximises_total_iou_not_prediction_order() -> None:
    # Greedy in prediction order pairs (0, 0) and (1, 1): total IoU 0.8 + 0.55. The optimum is 0.69 + 1.0.
    gts = [box("a", 0, 0, 100, 100), box("a", 0, 0, 100, 55)]
    preds = [box("a", 0, 0, 100, 80), box("a", 0, 0, 100, 100)]
    result = hungarian_match(preds, gts)
    assert sorted((p, g) for p, g, _ in result.pairs) == [(0, 1), (1, 0)]


def test_label_mode_require_treats_a_label_mismatch_as_no_match() -> None:
    preds = [box("shark", 0, 0, 100, 100), box("fish", 500, 500, 600, 650)]
    assert len(hungarian_match(preds, GTS, label_mode="ignore").pairs) == 2
    result = hungarian_match(preds, GTS, label_mode="require")
    assert [(p, g) for p, g, _ in result.pairs] == [(1, 2)]
    assert result.fp == [0] and result.fn == [0, 1]


def test_accepts_the_matching_config_and_rejects_bad_settings() -> None:
    config = MatchingConfig(iou_threshold=0.9, label_mode="require")
    pred = [box("fish", 0, 0, 100, 85)]
    assert hungarian_match(pred, GTS[:1], **config.model_dump()).pairs == []
    with pytest.raises(ConfigError, match=r"matching\.label_mode = 'strict'"):
        hungarian_match(pred, GTS, label_mode="strict")
    with pytest.raises(ConfigError, match=r"matching\.iou_threshold = 1\.5"):
        hungarian_match(pred, GTS, iou_threshold=1.5)


def test_costs_of_leaving_objects_unmatched_trade_off_against_poor_pairs() -> None:
    gt = [box("fish", 0, 0, 100, 100)]
    pred = [box("fish", 0, 0, 100, 60)]  # IoU 0.6: pair cost 0.4
    assert len(hungarian_match(pred, gt).pairs) == 1
    assert hungarian_match(pred, gt, fp_cost=0.1, fn_cost=0.1).pairs == []


def load_aquarium_split(split: str) -> list[list[DetObject]]:
    names = (AQUARIUM / "data.yaml").read_text().split("names:")[1].strip().strip("[]").split(",")
    names = [n.strip().strip("'\"") for n in names]
    images = []
    for label_file in sorted((AQUARIUM / split / "labels").glob("*.txt")):
        objects = []
        for line in label_file.read_text().split("\n"):
            if line.strip():
                cls, cx, cy, w, h = line.split()
                xyxy = (
                    float(cx) - float(w) / 2,
                    float(cy) - float(h) / 2,
                    float(cx) + float(w) / 2,
                    float(cy) + float(h) / 2,
                )
                objects.append(DetObject(names[int(cls)], to_frame(xyxy, (1, 1), "norm1000", (1, 1))))
        images.append(objects)
    return images


def test_real_annotations_recover_jittered_shuffled_copies() -> None:
    images = load_aquarium_split("valid")
    assert len(images) == 127 and sum(len(i) for i in images) == 909
    rng = random.Random(0)
    for gts in images:
        preds = [
            DetObject(
                o.label, (o.bbox[0] + rng.randint(0, 1), o.bbox[1], o.bbox[2] + rng.randint(0, 1), o.bbox[3])
            )
            for o in gts
        ]
        rng.shuffle(preds)
        preds.append(box("fish", 0, 0, 1, 1))  # a hallucinated box that overlaps nothing (tiny)
        exact = hungarian_match(gts, gts, label_mode="require")
        assert len(exact.pairs) == len(gts) and all(iou == 1.0 for _, _, iou in exact.pairs)
        result = hungarian_match(preds, gts, label_mode="require")
        assert result.fn == [] and result.fp == [len(preds) - 1]
        assert min(iou for _, _, iou in result.pairs) > 0.5
