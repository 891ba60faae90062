"""``summarize``: training sums -> logged metrics through the one detection metrics path."""

from __future__ import annotations

from collections import Counter

import pytest

from rollmatch.detection.codec import ParseResult
from rollmatch.detection.matching import MatchResult
from rollmatch.detection.metrics import DetectionCounts, ParseCounts
from rollmatch.detection.objects import DetObject
from rollmatch.detection.scoring import ScoreCounts, ScoredResponse
from rollmatch.training.metric_summary import METRIC_FAMILIES, server_metrics, summarize

FISH = DetObject("fish", (0, 0, 100, 100))


def scored(
    preds: list[DetObject], gts: list[DetObject], match: MatchResult, **parse: object
) -> ScoredResponse:
    result = ParseResult(
        objects=preds,
        prefix_token_ids=[1],
        prefix_text="[",
        num_complete=len(preds),
        invalid=dict(parse.get("invalid", {})),  # type: ignore[call-overload]
        truncated=bool(parse.get("truncated", False)),
        has_complete_element=bool(preds),
    )
    return ScoredResponse(parse=result, match=match, gt_objects=tuple(gts))


def rollout_sums(responses: list[ScoredResponse]) -> Counter[str]:
    """What the rollout channel emits per rollout, added up (as over micro-steps and ranks)."""
    sums: Counter[str] = Counter()
    for response in responses:
        sums.update(response.counts().to_sums())
        sums.update({"rollout/count": 1, "rollout/tokens": 10, "rollout/seconds": 0.5, "samples": 1})
    return sums


def test_match_and_parse_metrics_come_from_the_detection_counts() -> None:
    responses = [
        scored(
            [FISH, FISH], [FISH], MatchResult(pairs=[(0, 0, 0.8)], fn=[], fp=[1]), invalid={"bad_coord": 2}
        ),
        scored([], [FISH, FISH], MatchResult(pairs=[], fn=[0, 1], fp=[]), truncated=True),
    ]
    out = summarize(rollout_sums(responses), steps=2)
    counts = ScoreCounts()
    for response in responses:
        counts.add(response)
    assert (counts.detection.tp, counts.detection.fp, counts.detection.fn) == (1, 1, 2)
    for name, value in counts.detection.as_metrics(per=2).items():
        assert out[name] == pytest.approx(value), name
    assert out["match/f1"] == pytest.approx(2 / (2 + 1 + 2)) and out["match/fn"] == 1.0
    assert out["parse/valid"] == 1.0 and out["parse/invalid_bad_coord"] == 1.0
    assert out["rollout/truncated_frac"] == 0.5 and out["rollout/count"] == 1.0
    assert out["rollout/len_mean"] == 10 and out["rollout/tokens_per_s"] == 20


def test_rollouts_with_nothing_to_find_and_nothing_found_score_like_detection_counts() -> None:
    # No GT and no prediction: DetectionCounts' convention (a perfect 1.0), not 0.
    out = summarize(rollout_sums([scored([], [], MatchResult())]), steps=1)
    assert DetectionCounts().f1 == 1.0
    assert (out["match/precision"], out["match/recall"], out["match/f1"]) == (1.0, 1.0, 1.0)


def test_sums_round_trip() -> None:
    counts = ScoreCounts(
        parsing=ParseCounts(responses=3, valid=4, truncated=1, invalid={"not_object": 2}),
        detection=DetectionCounts(tp=3, fp=1, fn=2, iou_sum=2.25),
    )
    assert ScoreCounts.from_sums(counts.to_sums()) == counts
    assert DetectionCounts.from_sums(counts.to_sums()) == counts.detection


def test_steps_without_rollouts_log_no_rollout_metrics() -> None:
    out = summarize({"samples": 8, "loss/weight": 40.0}, steps=2)
    assert out == {"samples": 4.0, "loss/weight": 20.0}
    assert len(METRIC_FAMILIES) >= 4


def test_rollout_count_regulation_and_bucket_metrics() -> None:
    """Two rollouts: one stops after the first of four GT objects, one finds its single GT and repeats it."""
    four = [DetObject("fish", (i * 100, 0, i * 100 + 90, 90)) for i in range(4)]
    responses = [
        scored([four[0]], four, MatchResult(pairs=[(0, 0, 0.9)], fn=[1, 2, 3], fp=[])),
        scored([FISH, FISH], [FISH], MatchResult(pairs=[(0, 0, 1.0)], fn=[], fp=[1])),
    ]
    out = summarize(rollout_sums(responses), steps=2, count_buckets=[1, 2])
    assert out["rollout/count_error"] == pytest.approx((-3 + 1) / 2)
    assert out["rollout/count_mae"] == pytest.approx((3 + 1) / 2)
    # thirds of 4 GT: [first, middle, middle, last]; the single GT is middle
    assert out["rollout/recall_first_third"] == 1.0
    assert out["rollout/recall_middle_third"] == pytest.approx(1 / 3)
    assert out["rollout/recall_last_third"] == 0.0
    assert out["rollout/kendall_tau"] == 0.0  # no rollout has two matched objects
    assert out["match/gt_count_1/precision"] == 0.5 and out["match/gt_count_1/recall"] == 1.0
    assert out["match/gt_count_2+/recall"] == 0.25 and out["match/gt_count_2+/images"] == 0.5
    default = summarize(rollout_sums(responses), steps=2)  # default edges: 1-3, 4-7, ...
    assert default["match/gt_count_4-7/f1"] == pytest.approx(2 / (2 + 3))
    assert "match/gt_count_1-3/f1" in default and "match/gt_count_1/f1" not in default


def test_server_failovers_are_reported_on_steps_without_a_rollout_call() -> None:
    """A failed weight push marks a server down at the start of a step in which no rollout call ran (an
    async learner whose actor made none): the failover is still logged; healthy needs calls."""
    assert server_metrics(Counter({"servers/failovers": 1}), steps=1) == {
        "servers/failovers": 1.0,
        "servers/resent_calls": 0.0,
    }
    sums = Counter({"servers/calls": 4, "servers/healthy_sum": 6, "servers/resent_calls": 2})
    assert server_metrics(sums, steps=2) == {
        "servers/failovers": 0.0,
        "servers/resent_calls": 1.0,
        "servers/healthy": 1.5,
    }
    assert server_metrics(Counter({"rollout/count": 3}), steps=1) == {}  # no server in the run
