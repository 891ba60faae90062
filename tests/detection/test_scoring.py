"""The one scoring path: strict parse + matching with the configured ``matching.*``."""

from __future__ import annotations

from rollmatch.config.schema import MatchingConfig
from rollmatch.detection.codec import QwenJsonCodec
from rollmatch.detection.objects import DetObject
from rollmatch.detection.scoring import ScoreCounts, score_response

EXTENT = (1000, 1000)
FISH = DetObject("fish", (100, 100, 300, 300))
SHARK = DetObject("shark", (500, 500, 700, 700))


def encode(codec: QwenJsonCodec, objects: list[DetObject]) -> list[int]:
    return codec.tokenizer.encode(codec.serialize(objects), add_special_tokens=False)


def test_score_response_honours_the_matching_settings(codec: QwenJsonCodec) -> None:
    # the model found the fish's box with the shark's label, and half of the shark's box
    preds = [DetObject("shark", FISH.bbox), DetObject("shark", (500, 500, 700, 600))]
    ids = encode(codec, preds)

    def score(**matching: object):
        return score_response(
            codec,
            ids,
            [FISH, SHARK],
            extent=EXTENT,
            hit_max_tokens=False,
            matching=MatchingConfig(**matching),
        )

    default = score()  # label-aware by default: the fish box with a shark label is no match
    assert [(p, g) for p, g, _ in default.match.pairs] == [(1, 1)] and default.missed == [FISH]
    geometry = score(label_mode="ignore")
    assert [(p, g) for p, g, _ in geometry.match.pairs] == [(0, 0), (1, 1)] and geometry.missed == []
    strict_iou = score(iou_threshold=0.6, label_mode="ignore")  # the shark half-box has IoU 0.5
    assert [(p, g) for p, g, _ in strict_iou.match.pairs] == [(0, 0)] and strict_iou.missed == [SHARK]
    counts = ScoreCounts()
    for scored in (geometry, default, strict_iou):
        counts.add(scored)
    assert (counts.detection.tp, counts.detection.fp, counts.detection.fn) == (4, 2, 2)
    assert counts.parsing.responses == 3 and counts.parsing.valid == 6
    assert counts.to_sums()["match/tp"] == 4 and ScoreCounts.from_sums(counts.to_sums()) == counts


def test_parse_outcomes_reach_the_counts(codec: QwenJsonCodec) -> None:
    ids = codec.tokenizer.encode('[{"bbox_2d": [1, 2, 3, 4], "label": "fish"}, 42', add_special_tokens=False)
    scored = score_response(codec, ids, [FISH], extent=EXTENT, hit_max_tokens=True, matching=MatchingConfig())
    assert scored.parse.invalid == {"not_object": 1} and scored.missed == [FISH]
    sums = scored.counts().to_sums()
    assert sums["parse/truncated"] == 1 and sums["parse/invalid_not_object"] == 1 and sums["match/fp"] == 1
