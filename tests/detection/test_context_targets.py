"""Targets that train after the model's own mistakes (``keep_prefix: all`` + ``matched_prefix:
supervise``), ``loss.missed_weight`` and the false-positive unlikelihood flags, on hand-built rollouts.

The rollout of every test here: B found, a false positive, a duplicate of B, A found; C missed.
"""

from __future__ import annotations

import pytest

from rollmatch.detection.codec import QwenJsonCodec, decode_with_offsets
from rollmatch.detection.objects import DetObject
from rollmatch.detection.targets import TargetSequence, build_gt_target, target_differs_from_sft
from tests.detection.test_supervised_targets import (
    A_SEEN,
    B_SEEN,
    DESC_W,
    FALSE_POSITIVE,
    GTS,
    PREFIX_W,
    A,
    B,
    C,
    element,
    target,
)

# a second, worse copy of B (IoU 0.74 against B_SEEN's 0.84): the duplicate
B_DUP = DetObject("blue circle", (510, 25, 680, 95))
ROLLOUT = "[" + ", ".join(element(o) for o in (B_SEEN, FALSE_POSITIVE, B_DUP, A_SEEN)) + "]"
AFTER_MISTAKES = {"keep_prefix": "all", "matched_prefix": "supervise"}


def weights_by_char(codec: QwenJsonCodec, t: TargetSequence) -> list[tuple[str, float]]:
    """``(token text, weight)`` per response token (EOS left out)."""
    spans = decode_with_offsets(codec.tokenizer, t.token_ids[:-1]).token_spans()
    return [(t.text[a:b], w) for (a, b), w in zip(spans, t.weights, strict=False)]


def weights_in(codec: QwenJsonCodec, t: TargetSequence, start: int, stop: int) -> set[float]:
    spans = decode_with_offsets(codec.tokenizer, t.token_ids[:-1]).token_spans()
    return {w for (a, b), w in zip(spans, t.weights, strict=False) if a < stop and b > start}


def test_keep_all_supervise_rewrites_every_matched_element_also_after_a_false_positive(
    codec: QwenJsonCodec,
) -> None:
    t = target(codec, ROLLOUT, prefix_weight=PREFIX_W, desc_weight=DESC_W, **AFTER_MISTAKES)
    fp, dup = element(FALSE_POSITIVE), element(B_DUP)
    # the context keeps the false positive and the duplicate as the model wrote them; B and A (also
    # after the false positive) are rewritten to their GT; C is appended
    assert t.text == "[" + ", ".join([element(B), fp, dup, element(A), element(C)]) + "]"
    assert t.dropped_elements == 0 and t.num_prefix_tokens == 0
    fp_at, dup_at = t.text.index(fp), t.text.index(dup)
    a_at = t.text.index(element(A))
    assert weights_in(codec, t, fp_at, fp_at + len(fp)) == {0.0}
    assert weights_in(codec, t, dup_at, dup_at + len(dup)) == {0.0}
    # A, after the mistakes, is supervised: its coordinates at 1, its label at desc_weight
    a_coords = t.text.index("[", a_at + 1)
    assert weights_in(codec, t, a_coords + 1, a_coords + 3) == {1.0}
    label_at = t.text.index(A.label, a_at)
    assert weights_in(codec, t, label_at, label_at + len(A.label)) == {DESC_W}
    assert t.unlikelihood_weights == []  # no unlikelihood term unless asked


def test_keep_all_supervise_differs_from_keep_all_without_supervision(codec: QwenJsonCodec) -> None:
    supervised = target(codec, ROLLOUT, **AFTER_MISTAKES)
    plain = target(codec, ROLLOUT, keep_prefix="all", matched_prefix="none")
    # the rollout's own coordinates (unsupervised) vs A's GT coordinates (supervised)
    assert element(A_SEEN) in plain.text and element(A) in supervised.text
    assert supervised.supervised_tokens > plain.supervised_tokens


@pytest.mark.parametrize(
    ("loss", "first_missed"),
    [
        ({"keep_prefix": "all", "matched_prefix": "supervise"}, C),
        ({"keep_prefix": "all", "matched_prefix": "none"}, C),
        # cut at the false positive: A, found after it, is appended with C
        ({"keep_prefix": "matched", "matched_prefix": "supervise"}, A),
        ({"keep_prefix": "matched", "matched_prefix": "none"}, A),
        ({"target": "reordered_gt"}, C),
    ],
)
def test_missed_weight_scales_the_appended_missed_objects_only(
    codec: QwenJsonCodec, loss: dict, first_missed: DetObject
) -> None:
    full = target(codec, ROLLOUT, desc_weight=DESC_W, **loss)
    half = target(codec, ROLLOUT, desc_weight=DESC_W, missed_weight=0.5, **loss)
    assert full.token_ids == half.token_ids
    c_at = full.text.rindex(element(first_missed))
    # everything before the first missed object's separator, the closing "]" and EOS keep their weights
    tokens = weights_by_char(codec, full)
    position = 0
    for index, (piece, weight) in enumerate(tokens):
        start, position = position, position + len(piece)
        if position <= c_at - 2 or position == len(full.text):  # before C's ", " / holds the "]"
            assert half.weights[index] == weight, (piece, loss)
        elif start >= c_at - 2:
            assert half.weights[index] == pytest.approx(0.5 * weight), (piece, loss)
    assert half.weights[-1] == 1.0


def test_missed_weight_leaves_a_target_without_misses_unchanged(codec: QwenJsonCodec) -> None:
    rollout = "[" + ", ".join(element(o) for o in (A_SEEN, B_SEEN, C)) + "]"
    for loss in ({}, AFTER_MISTAKES, {"target": "reordered_gt"}):
        assert (
            target(codec, rollout, **loss).weights
            == target(codec, rollout, missed_weight=0.0, **loss).weights
        )


def flagged(codec: QwenJsonCodec, t: TargetSequence) -> list[tuple[str, int, float]]:
    """``(token text, char offset, unlikelihood weight)`` of each flagged token."""
    spans = decode_with_offsets(codec.tokenizer, t.token_ids[:-1]).token_spans()
    return [(t.text[a:b], a, u) for (a, b), u in zip(spans, t.unlikelihood_weights, strict=False) if u > 0]


@pytest.mark.parametrize("matched_prefix", ["supervise", "none"])
def test_unlikelihood_flags_the_first_token_no_correct_continuation_shares(
    codec: QwenJsonCodec, matched_prefix: str
) -> None:
    t = target(codec, ROLLOUT, keep_prefix="all", matched_prefix=matched_prefix, fp_unlikelihood_weight=0.3)
    assert len(t.unlikelihood_weights) == len(t.token_ids)
    flags = flagged(codec, t)
    # false positive [800, ...]: the remaining GT are A [10, ...] and C [5, ...]: its first coordinate
    # digit "8" is where it leaves both
    fp_coords = t.text.index("[", t.text.index(element(FALSE_POSITIVE)) + 1)
    # duplicate of B [510, ...]: still remaining are A and C; "5" is shared with C's "5", so its
    # second digit "1" is the first one no correct continuation shares
    dup_coords = t.text.index("[", t.text.index(element(B_DUP)) + 1)
    assert flags == [("8", fp_coords + 1, 0.3), ("1", dup_coords + 2, 0.3)]
    # flagged tokens carry no CE weight
    assert all(t.weights[i] == 0 for i, u in enumerate(t.unlikelihood_weights) if u > 0)


def test_unlikelihood_after_every_gt_is_found_flags_the_separator(codec: QwenJsonCodec) -> None:
    # A, B, C all found, then a false positive: the right move was "]", the model wrote ", {"
    rollout = "[" + ", ".join(element(o) for o in (A_SEEN, B_SEEN, C, FALSE_POSITIVE)) + "]"
    t = target(codec, rollout, fp_unlikelihood_weight=1.0, **AFTER_MISTAKES)
    fp_at = t.text.index(element(FALSE_POSITIVE))
    ((piece, at, _),) = flagged(codec, t)
    assert "," in piece and at <= fp_at - 2 < at + len(piece)


def test_unlikelihood_skips_a_false_positive_identical_to_a_remaining_gt(codec: QwenJsonCodec) -> None:
    # C written twice: the first copy is unmatched only because Hungarian gave C to the second one;
    # at its position C was still a correct continuation, so nothing is flagged
    rollout = "[" + ", ".join(element(o) for o in (C, C)) + "]"
    t = target(codec, rollout, fp_unlikelihood_weight=1.0, **AFTER_MISTAKES)
    assert len(flagged(codec, t)) <= 1
    first_c = t.text.index(element(C))
    assert all(at > first_c + len(element(C)) - 1 for _, at, _ in flagged(codec, t))


def test_difference_from_sft_counts_token_ids_not_weights(codec: QwenJsonCodec) -> None:
    eos = codec.tokenizer.convert_tokens_to_ids(codec.tokenizer.eos_token)
    sft = build_gt_target(GTS, codec=codec, tokenizer=codec.tokenizer, eos_token_id=eos)
    # a canonical rollout: the default target rewrites it to SFT's ids, with other weights (structure 0)
    canonical = target(codec, "[" + ", ".join(element(o) for o in (A_SEEN, B_SEEN, C)) + "]")
    assert canonical.token_ids == sft.token_ids and canonical.weights != sft.weights
    assert not target_differs_from_sft(canonical, GTS, codec, codec.tokenizer)
    # after a false positive the context holds it: other ids
    after = target(codec, ROLLOUT, **AFTER_MISTAKES)
    assert target_differs_from_sft(after, GTS, codec, codec.tokenizer)
    # the default target cuts at the false positive: B, then A and C appended; B before A is not the
    # canonical order (both at y=20: left to right), so other ids
    assert target_differs_from_sft(target(codec, ROLLOUT), GTS, codec, codec.tokenizer)


def test_keep_all_supervise_of_a_rollout_without_a_complete_element_is_the_sft_target(
    codec: QwenJsonCodec,
) -> None:
    eos = codec.tokenizer.convert_tokens_to_ids(codec.tokenizer.eos_token)
    sft = build_gt_target(GTS, codec=codec, tokenizer=codec.tokenizer, eos_token_id=eos)
    for text in ("", "[", '[{"bbox_2d": [1, 2'):
        t = target(codec, text, fp_unlikelihood_weight=1.0, **AFTER_MISTAKES)
        assert (t.token_ids, t.weights) == (sft.token_ids, sft.weights), text
        assert not any(t.unlikelihood_weights)
