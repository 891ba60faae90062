"""Count-regulation and order metrics on hand-made matchings with known answers: Kendall tau,
thirds of the GT list, GT-count buckets, signed count error, and their additive sums."""

from __future__ import annotations

from collections import Counter

import pytest

from rollmatch.detection.count_metrics import CountOrderCounts, count_bucket_label, gt_third, kendall_tau
from rollmatch.detection.matching import MatchResult
from rollmatch.detection.metrics import coco_map
from rollmatch.detection.objects import DetObject


def test_kendall_tau_on_known_permutations() -> None:
    assert kendall_tau([0, 1, 2, 3]) == 1.0
    assert kendall_tau([3, 2, 1, 0]) == -1.0
    # [1, 0, 2, 3]: one discordant pair of six -> (5 - 1) / 6
    assert kendall_tau([1, 0, 2, 3]) == pytest.approx(4 / 6)
    # [2, 0, 3, 1]: concordant (2,3) (0,3) (0,1) = 3, discordant (2,0) (2,1) (3,1) = 3 -> 0
    assert kendall_tau([2, 0, 3, 1]) == 0.0
    assert kendall_tau([5, 9]) == 1.0  # only the order matters, not the values
    assert kendall_tau([4]) is None and kendall_tau([]) is None


def test_gt_thirds_split_by_the_centre_of_each_slot() -> None:
    assert [gt_third(i, 1) for i in range(1)] == [1]
    assert [gt_third(i, 2) for i in range(2)] == [0, 2]
    assert [gt_third(i, 3) for i in range(3)] == [0, 1, 2]
    assert [gt_third(i, 4) for i in range(4)] == [0, 1, 1, 2]
    assert [gt_third(i, 6) for i in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [gt_third(i, 30) for i in range(30)] == [0] * 10 + [1] * 10 + [2] * 10


def test_count_bucket_labels() -> None:
    edges = (1, 4, 8, 13, 20, 26, 31)
    labels = {n: count_bucket_label(n, edges) for n in (0, 1, 3, 4, 7, 8, 12, 13, 19, 20, 25, 26, 30, 31, 90)}
    assert labels == {
        0: "0", 1: "1-3", 3: "1-3", 4: "4-7", 7: "4-7", 8: "8-12", 12: "8-12", 13: "13-19", 19: "13-19",
        20: "20-25", 25: "20-25", 26: "26-30", 30: "26-30", 31: "31+", 90: "31+",
    }  # fmt: skip
    assert [count_bucket_label(n, [0, 1, 2, 5]) for n in (0, 1, 2, 4, 5)] == ["0", "1", "2-4", "2-4", "5+"]
    assert count_bucket_label(2, [3, 6]) == "0-2"


def _answer(order: list[int], n_gt: int, fp: int = 0) -> tuple[MatchResult, int, int]:
    """A matching whose predictions 0..len(order)-1 hit GT ``order[i]``, then ``fp`` false positives."""
    pairs = [(p, g, 0.9) for p, g in enumerate(order)]
    fn = sorted(set(range(n_gt)) - set(order))
    return MatchResult(pairs=pairs, fn=fn, fp=list(range(len(order), len(order) + fp))), len(order) + fp, n_gt


def test_counts_on_a_known_set_of_answers() -> None:
    counts = CountOrderCounts()
    # 6 GT, stops after the first three, in order: count error -3, thirds first 2/2 middle 1/2 last 0/2
    counts.add(*_answer([0, 1, 2], 6))
    # 3 GT listed in reverse, plus one repeat (a false positive): count error +1, tau -1
    counts.add(*_answer([2, 1, 0], 3, fp=1))
    # 1 GT found: tau undefined (one pair), count error 0
    counts.add(*_answer([0], 1))
    summary = counts.summary()
    assert summary["count_error"] == pytest.approx((-3 + 1 + 0) / 3)
    assert summary["count_mae"] == pytest.approx((3 + 1 + 0) / 3)
    assert summary["kendall_tau"] == pytest.approx((1.0 - 1.0) / 2)
    assert counts.tau_images == 2
    # first third: 2 of image 0, 1 of image 1 -> 3/3; middle: 1/2 + 1/1 + 1/1 (1 GT is middle) -> 3/4
    assert (summary["recall_first_third"], summary["recall_middle_third"]) == (1.0, pytest.approx(3 / 4))
    assert summary["recall_last_third"] == pytest.approx(1 / 3)  # 0/2 of image 0, 1/1 of image 1
    buckets = counts.by_bucket([1, 4])
    assert list(buckets) == ["1-3", "4+"]
    images, low = buckets["1-3"]
    assert images == 2 and (low.tp, low.fp, low.fn) == (4, 1, 0)
    images, high = buckets["4+"]
    assert images == 1 and (high.tp, high.fp, high.fn) == (3, 0, 3) and high.recall == 0.5
    metrics = counts.bucket_metrics("eval/", [1, 4])
    assert metrics["eval/gt_count_4+/f1"] == pytest.approx(2 * 3 / (2 * 3 + 3))
    assert metrics["eval/gt_count_1-3/precision"] == pytest.approx(4 / 5)
    assert metrics["eval/gt_count_1-3/images"] == 2


def test_sums_add_up_like_the_counts_they_come_from() -> None:
    answers = [_answer([0, 1, 2], 6), _answer([2, 1, 0], 3, fp=1), _answer([], 0, fp=2), _answer([1, 0], 2)]
    whole = CountOrderCounts()
    summed: Counter[str] = Counter()
    for answer in answers:
        whole.add(*answer)
        one = CountOrderCounts()
        one.add(*answer)
        summed.update(one.to_sums())
    back = CountOrderCounts.from_sums(summed)
    assert back == whole
    assert back.summary() == whole.summary()
    assert back.by_bucket() == whole.by_bucket()
    assert list(whole.by_bucket()) == ["0", "1-3", "4-7"]  # the default edges
    assert CountOrderCounts.from_sums({}).summary() == {
        "count_error": 0.0, "count_mae": 0.0, "recall_first_third": 0.0, "recall_middle_third": 0.0,
        "recall_last_third": 0.0, "kendall_tau": 0.0,
    }  # fmt: skip


def test_uniform_scores_let_trailing_false_positives_outrank_other_images_hits() -> None:
    """Image 1 answers its box then two wrong ones, image 2 its box. Scored by list position (1 - i /
    (n + 1)) both hits rank first: AP 1. Every box at 1.0, pycocotools' stable sort keeps image order:
    hit, miss, miss, hit, so precision at full recall is 2/4 and the 101-point AP is (51 + 50 * 0.5) / 101."""
    a, b = (0, 0, 10, 10), (20, 20, 30, 30)
    wrong = [DetObject("x", (50, 50, 60, 60)), DetObject("x", (70, 70, 80, 80))]
    gts = [[DetObject("x", a)], [DetObject("x", b)]]
    answers = [[DetObject("x", a), *wrong], [DetObject("x", b)]]
    by_position = [[(o, 1.0 - i / (len(p) + 1)) for i, o in enumerate(p)] for p in answers]
    uniform = [[(o, 1.0) for o in p] for p in answers]
    assert coco_map(by_position, gts, ["x"])["map_50"] == pytest.approx(1.0)
    assert coco_map(uniform, gts, ["x"])["map_50"] == pytest.approx((51 + 50 * 0.5) / 101)
