"""Targets that supervise what the rollout got right: ``reordered_gt`` and ``prefix_fn`` with the
matched prefix supervised (``loss.matched_prefix: supervise``), on hand-built rollouts."""

from __future__ import annotations

import json
import re

import pytest
from resolved_runs import resolve_for

from rollmatch.config.load import load_config
from rollmatch.config.schema import LossConfig, MatchingConfig
from rollmatch.detection.codec import QwenJsonCodec
from rollmatch.detection.matching import hungarian_match
from rollmatch.detection.objects import DetObject
from rollmatch.detection.targets import TargetSequence, build_gt_target, build_matched_target
from rollmatch.errors import ConfigError

EXTENT = (1000, 1000)
A = DetObject("red square", (10, 20, 300, 400))
B = DetObject("blue circle", (500, 20, 700, 90))
C = DetObject("fish", (5, 600, 100, 700))
GTS = [A, B, C]
# The rollout's versions of B and A: right place (IoU 0.5-0.9), off by a few units.
B_SEEN = DetObject("blue circle", (505, 22, 690, 95))
A_SEEN = DetObject("red square", (30, 40, 300, 390))
FALSE_POSITIVE = DetObject("star", (800, 800, 900, 900))
PREFIX_W, DESC_W = 0.5, 0.25


def rollout(codec: QwenJsonCodec, text: str, matching: MatchingConfig | None = None):
    ids = codec.tokenizer.encode(text, add_special_tokens=False)
    parse = codec.parse(ids, extent=EXTENT, hit_max_tokens=False)
    match = hungarian_match(parse.objects, GTS, **(matching or MatchingConfig()).model_dump())
    return parse, match


def target(codec: QwenJsonCodec, text: str, matching: MatchingConfig | None = None, **loss) -> TargetSequence:
    parse, match = rollout(codec, text, matching)
    eos = codec.tokenizer.convert_tokens_to_ids(codec.tokenizer.eos_token)
    return build_matched_target(
        parse, GTS, match, codec=codec, tokenizer=codec.tokenizer, eos_token_id=eos, loss=LossConfig(**loss)
    )


def element(obj: DetObject) -> str:
    return json.dumps({"bbox_2d": list(obj.bbox), "label": obj.label})


def oracle_weights(codec: QwenJsonCodec, t: TargetSequence, prefix_chars: int) -> list[float]:
    """Weights by plain string search: labels DESC_W; coordinates 1; structure PREFIX_W inside the
    first ``prefix_chars`` characters (a token must end there), else 1; EOS 1."""
    labels = {i for o in GTS for m in re.finditer(re.escape(o.label), t.text) for i in range(*m.span())}
    coords = {
        i
        for m in re.finditer(r"\[(\d+), (\d+), (\d+), (\d+)\]", t.text)
        for g in range(1, 5)
        for i in range(*m.span(g))
    }
    weights, position = [], 0
    for token in t.token_ids[:-1]:
        piece = codec.tokenizer.decode([token])
        chars = set(range(position, position + len(piece)))
        position += len(piece)
        if chars & labels:
            weights.append(DESC_W)
        elif position <= prefix_chars and not chars & coords:
            weights.append(PREFIX_W)
        else:
            weights.append(1.0)
    assert position == len(t.text)
    return [*weights, 1.0]


def test_reordered_gt_keeps_the_rollouts_order_with_gt_boxes_and_drops_the_rest(codec: QwenJsonCodec) -> None:
    # B found first, then a false positive, a duplicate of B, an invalid element, then A; C missed
    invalid = '{"bbox_2d": [5, 5, 1, 1], "label": "fish"}'  # degenerate box
    text = (
        "["
        + ", ".join([element(B_SEEN), element(FALSE_POSITIVE), element(B_SEEN), invalid, element(A_SEEN)])
        + "]"
    )
    t = target(codec, text, target="reordered_gt", prefix_weight=PREFIX_W, desc_weight=DESC_W)
    assert t.text == "[" + ", ".join(element(o) for o in (B, A, C)) + "]"
    assert t.dropped_elements == 3  # the false positive, the duplicate, the invalid element
    assert t.num_prefix_tokens == 0  # no rollout token is copied
    assert t.weights == oracle_weights(codec, t, prefix_chars=0)  # every token supervised
    assert t.supervised_tokens == len(t.token_ids)


def test_reordered_gt_of_a_rollout_in_canonical_order_is_the_sft_target(codec: QwenJsonCodec) -> None:
    t = target(codec, "[" + element(A_SEEN) + ", " + element(B_SEEN) + "]", target="reordered_gt")
    eos = codec.tokenizer.convert_tokens_to_ids(codec.tokenizer.eos_token)
    sft = build_gt_target(GTS, codec=codec, tokenizer=codec.tokenizer, eos_token_id=eos)
    assert (t.token_ids, t.weights) == (sft.token_ids, sft.weights)


def test_supervised_prefix_rewrites_matched_elements_to_their_gt(codec: QwenJsonCodec) -> None:
    text = "[" + ", ".join([element(B_SEEN), element(A_SEEN), element(FALSE_POSITIVE)]) + "]"
    loss = {"prefix_weight": PREFIX_W, "desc_weight": DESC_W}
    t = target(codec, text, matched_prefix="supervise", **loss)
    assert t.text == "[" + ", ".join(element(o) for o in (B, A, C)) + "]"
    assert t.dropped_elements == 1  # the false positive after the kept prefix
    prefix_chars = len("[" + element(B) + ", " + element(A))
    assert t.weights == oracle_weights(codec, t, prefix_chars)
    # unsupervised, the same rollout teaches only the tail: the prefix's coordinates weigh 0
    plain = target(codec, text, matched_prefix="none", **loss)
    assert plain.text == "[" + ", ".join(element(o) for o in (B_SEEN, A_SEEN, C)) + "]"
    assert t.supervised_tokens > plain.supervised_tokens


def test_supervised_prefix_corrects_a_matched_label_when_labels_are_ignored(codec: QwenJsonCodec) -> None:
    text = "[" + element(DetObject("fish", B_SEEN.bbox)) + "]"
    ignore = MatchingConfig(label_mode="ignore")
    for mode, label, weight in (("supervise", B.label, 1.0), ("none", "fish", 0.0)):
        t = target(codec, text, ignore, matched_prefix=mode)
        start = t.text.index(label)
        spans, position = [], 0
        for token in t.token_ids[:-1]:
            spans.append((position, position := position + len(codec.tokenizer.decode([token]))))
        label_weights = {
            w for (a, b), w in zip(spans, t.weights, strict=False) if a < start + len(label) and b > start
        }
        assert label_weights == {weight}, mode


def test_a_wrong_first_element_leaves_the_sft_target(codec: QwenJsonCodec) -> None:
    eos = codec.tokenizer.convert_tokens_to_ids(codec.tokenizer.eos_token)
    sft = build_gt_target(GTS, codec=codec, tokenizer=codec.tokenizer, eos_token_id=eos)
    for loss in ({}, {"matched_prefix": "supervise"}):
        t = target(codec, "[" + element(FALSE_POSITIVE) + ", " + element(A_SEEN) + "]", **loss)
        assert (t.token_ids, t.weights) == (sft.token_ids, sft.weights), loss


def test_supervision_needs_a_prefix_fn_target() -> None:
    with pytest.raises(ConfigError, match="reordered_gt already supervises"):
        resolve_for(load_config(None, ["loss.matched_prefix=supervise", "loss.target=reordered_gt"]))
    # keep_prefix: all + supervise is a target of its own (tests/detection/test_context_targets.py)
    supervised = load_config(None, ["loss.matched_prefix=supervise", "loss.keep_prefix=all"])
    assert resolve_for(supervised).config.loss.keep_prefix == "all"
