"""Target-vs-SFT token-id differences (``rollmatch diagnose``), on hand-built rollouts."""

from __future__ import annotations

from rollmatch.detection.codec import QwenJsonCodec
from rollmatch.detection.matching import hungarian_match
from rollmatch.detection.target_diffs import (
    DIAGNOSED_TARGETS,
    TargetDiffTotals,
    positional_mismatches,
    target_diff,
)
from tests.detection.test_supervised_targets import (
    A_SEEN,
    B_SEEN,
    EXTENT,
    FALSE_POSITIVE,
    GTS,
    element,
)


def diff_of(codec: QwenJsonCodec, objects: list) -> object:
    text = "[" + ", ".join(element(o) for o in objects) + "]"
    parse = codec.parse(
        codec.tokenizer.encode(text, add_special_tokens=False), extent=EXTENT, hit_max_tokens=False
    )
    match = hungarian_match(parse.objects, GTS)
    eos = codec.tokenizer.convert_tokens_to_ids(codec.tokenizer.eos_token)
    return target_diff(parse, GTS, match, codec=codec, tokenizer=codec.tokenizer, eos_token_id=eos)


def test_a_canonical_rollout_with_a_miss_differs_only_where_the_targets_keep_its_own_tokens(
    codec: QwenJsonCodec,
) -> None:
    # A then B in canonical order, C missed: the supervised targets are SFT's ids, the unsupervised
    # ones hold the rollout's own coordinates
    diff = diff_of(codec, [A_SEEN, B_SEEN])
    assert diff.mismatched["prefix_fn_matched_supervise"] == 0
    assert diff.mismatched["prefix_fn_all_supervise"] == 0
    assert diff.mismatched["reordered_gt"] == 0
    assert diff.mismatched["prefix_fn_matched_none"] > 0 and diff.mismatched["prefix_fn_all_none"] > 0
    assert not diff.reordered_only_appended_miss  # equal to SFT: C sits where SFT puts it anyway


def test_reordered_gt_differing_only_by_an_appended_miss_is_counted(codec: QwenJsonCodec) -> None:
    # canonical order is A, B, C (A and B share a row, left to right); the rollout found A then C and
    # missed B, so its target A, C, B differs from SFT's only by where the miss sits
    diff = diff_of(codec, [A_SEEN, GTS[2]])
    assert diff.mismatched["reordered_gt"] > 0 and diff.reordered_only_appended_miss
    # B before A: the found objects themselves are reordered
    assert not diff_of(codec, [B_SEEN, A_SEEN]).reordered_only_appended_miss


def test_a_false_positive_first_leaves_supervise_matched_equal_to_sft_but_not_keep_all(
    codec: QwenJsonCodec,
) -> None:
    diff = diff_of(codec, [FALSE_POSITIVE, A_SEEN, B_SEEN])
    assert diff.mismatched["prefix_fn_matched_supervise"] == 0  # cut at the false positive: all appended
    assert diff.mismatched["prefix_fn_all_supervise"] > 0  # the false positive stays in the context


def test_totals_give_rates_per_target(codec: QwenJsonCodec) -> None:
    totals = TargetDiffTotals()
    for objects in ([A_SEEN, B_SEEN], [FALSE_POSITIVE, A_SEEN, B_SEEN], [A_SEEN, GTS[2]]):
        totals.add(diff_of(codec, objects))
    summary = totals.summary()
    assert set(summary) == set(DIAGNOSED_TARGETS)
    assert summary["prefix_fn_all_supervise"]["differs_frac"] == round(2 / 3, 4)
    assert summary["prefix_fn_matched_supervise"]["differs_frac"] == round(1 / 3, 4)
    assert summary["reordered_gt"]["only_appended_miss_frac"] == 1.0
    assert all(0 <= v["token_mismatch_frac"] <= 1 for v in summary.values())
    assert summary["prefix_fn_matched_supervise"]["token_mismatch_frac"] > 0


def test_positional_mismatches_count_the_longer_tail() -> None:
    assert positional_mismatches([1, 2, 3], [1, 2, 3]) == 0
    assert positional_mismatches([1, 9, 3, 4], [1, 2, 3]) == 2
