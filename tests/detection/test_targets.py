"""Teacher-forcing targets: Y_train = rollout prefix + missed GT + EOS, and per-token weights."""

from __future__ import annotations

import json
import re

import pytest
from tokenizers import Tokenizer, decoders, models, trainers
from transformers import PreTrainedTokenizerFast

from rollmatch.config.schema import LossConfig
from rollmatch.detection.codec import QwenJsonCodec
from rollmatch.detection.matching import hungarian_match
from rollmatch.detection.objects import DetObject
from rollmatch.detection.targets import (
    build_gt_target,
    build_matched_target,
    build_rollout_target,
    leading_matched_elements,
)
from rollmatch.errors import DataError

EXTENT = (1000, 1000)
A = DetObject("red square", (10, 20, 300, 400))
B = DetObject("blue circle", (500, 20, 700, 90))
C = DetObject("fish", (5, 600, 100, 700))
PREFIX_W, DESC_W = 0.5, 0.25


def eos_id(codec: QwenJsonCodec) -> int:
    return codec.tokenizer.convert_tokens_to_ids(codec.tokenizer.eos_token)


def token_texts(codec: QwenJsonCodec, ids: list[int]) -> list[str]:
    return [codec.tokenizer.decode([i], skip_special_tokens=False) for i in ids]


def expected_weights(
    codec: QwenJsonCodec, ids: list[int], text: str, num_prefix: int, labels: list[str]
) -> list[float]:
    """Oracle for ASCII text: character roles found with plain string search, token spans by length."""
    label_chars = {
        i for label in labels for m in re.finditer(re.escape(label), text) for i in range(*m.span())
    }
    coord_chars = {
        i
        for m in re.finditer(r"\[(\d+), (\d+), (\d+), (\d+)\]", text)
        for g in range(1, 5)
        for i in range(*m.span(g))
    }
    weights, position = [], 0
    for index, piece in enumerate(token_texts(codec, ids)):
        chars = set(range(position, position + len(piece)))
        position += len(piece)
        if index < num_prefix:
            weights.append(0.0 if chars & (label_chars | coord_chars) else PREFIX_W)
        else:
            weights.append(DESC_W if chars & label_chars else 1.0)
    assert position == len(text)
    return [*weights, 1.0]


def test_rollout_target_is_prefix_plus_missed_gt(codec: QwenJsonCodec) -> None:
    tokenizer = codec.tokenizer
    rollout_text = codec.serialize([A, B])[:-20]  # B is cut off mid-element
    rollout_ids = tokenizer.encode(rollout_text, add_special_tokens=False)
    parse = codec.parse(rollout_ids, extent=EXTENT, hit_max_tokens=True)
    gts = [C, A]
    match = hungarian_match(parse.objects, gts)
    missed = [gts[g] for g in match.fn]
    target = build_rollout_target(
        parse,
        missed,
        codec=codec,
        tokenizer=tokenizer,
        eos_token_id=eos_id(codec),
        prefix_weight=PREFIX_W,
        desc_weight=DESC_W,
    )
    # The rollout's ids are copied, except the closing `"}` of the last kept element, which is
    # encoded with the tail as the `"},` the model chooses between `"},` and `"}]` at that point.
    assert target.token_ids[: target.num_prefix_tokens] == parse.prefix_token_ids[:-1]
    assert tokenizer.decode(parse.prefix_token_ids[-1:]) == '"}'
    assert target.token_ids[-1] == eos_id(codec) and len(target.weights) == len(target.token_ids)
    assert json.loads(target.text) == [{"bbox_2d": list(o.bbox), "label": o.label} for o in [A, C]]
    assert tokenizer.decode(target.token_ids[:-1], skip_special_tokens=False) == target.text
    assert target.weights == expected_weights(
        codec, target.token_ids[:-1], target.text, target.num_prefix_tokens, ["red square", "fish"]
    )
    pieces = dict(zip(token_texts(codec, target.token_ids), target.weights, strict=True))
    assert pieces['[{"'] == PREFIX_W and pieces["red"] == 0.0 and '"}' not in pieces  # prefix
    assert pieces['"},'] == 1.0  # the decision to go on, at the token free decoding emits
    assert pieces["fish"] == DESC_W and pieces['"}]'] == 1.0 and pieces["<|im_end|>"] == 1.0  # tail


def test_default_weights_train_only_the_tail(codec: QwenJsonCodec) -> None:
    tokenizer = codec.tokenizer
    parse = codec.parse(
        tokenizer.encode(codec.serialize([A]), add_special_tokens=False), extent=EXTENT, hit_max_tokens=False
    )
    target = build_rollout_target(parse, [C], codec=codec, tokenizer=tokenizer, eos_token_id=eos_id(codec))
    assert target.weights[: target.num_prefix_tokens] == [0.0] * target.num_prefix_tokens
    assert target.weights[target.num_prefix_tokens :] == [1.0] * (
        len(target.token_ids) - target.num_prefix_tokens
    )


def test_nothing_missed_closes_the_list(codec: QwenJsonCodec) -> None:
    tokenizer = codec.tokenizer
    parse = codec.parse(
        tokenizer.encode(codec.serialize([A, C]), add_special_tokens=False),
        extent=EXTENT,
        hit_max_tokens=False,
    )
    target = build_rollout_target(parse, [], codec=codec, tokenizer=tokenizer, eos_token_id=eos_id(codec))
    assert target.text == codec.serialize([A, C])
    # The same ids as the GT serialization: the stop is the fused `"}]` token, trained with weight 1.
    assert target.token_ids == [
        *tokenizer.encode(codec.serialize([A, C]), add_special_tokens=False),
        eos_id(codec),
    ]
    assert token_texts(codec, target.token_ids[target.num_prefix_tokens :]) == ['"}]', "<|im_end|>"]
    assert target.weights[target.num_prefix_tokens :] == [1.0, 1.0]


def test_no_complete_element_starts_from_the_bare_bracket(codec: QwenJsonCodec) -> None:
    tokenizer = codec.tokenizer
    parse = codec.parse(
        tokenizer.encode("I see a fish.", add_special_tokens=False), extent=EXTENT, hit_max_tokens=False
    )
    target = build_rollout_target(parse, [C, A], codec=codec, tokenizer=tokenizer, eos_token_id=eos_id(codec))
    assert target.text == codec.serialize([A, C]) and target.num_prefix_tokens == 0
    # The bare "[" joins the tail: the ids are those of the GT serialization (`[{"` fused).
    assert target.token_ids[:-1] == tokenizer.encode(codec.serialize([A, C]), add_special_tokens=False)


def test_invalid_elements_stay_in_the_prefix_but_are_not_matched(codec: QwenJsonCodec) -> None:
    tokenizer = codec.tokenizer
    text = '[{"bbox_2d": [10, 20, 300, 400], "label": "red square"}, {"bbox_2d": [9, 9, 1, 1], "label": "x"}, {"bb'
    parse = codec.parse(tokenizer.encode(text, add_special_tokens=False), extent=EXTENT, hit_max_tokens=True)
    assert parse.objects == [A] and parse.invalid == {"degenerate_box": 1}
    target = build_rollout_target(parse, [C], codec=codec, tokenizer=tokenizer, eos_token_id=eos_id(codec))
    assert [e["label"] for e in json.loads(target.text)] == ["red square", "x", "fish"]


def test_split_multibyte_label_tokens_all_get_the_desc_weight(codec: QwenJsonCodec) -> None:
    tokenizer = codec.tokenizer
    label = DetObject("红色", (1, 2, 3, 4))
    target = build_gt_target(
        [label], codec=codec, tokenizer=tokenizer, eos_token_id=eos_id(codec), desc_weight=DESC_W
    )
    pieces = token_texts(codec, target.token_ids)
    byte_tokens = [k for k, piece in enumerate(pieces) if "\ufffd" in piece]
    assert len(byte_tokens) >= 2, "test precondition: the label is split into byte tokens"
    assert all(target.weights[k] == DESC_W for k in byte_tokens)
    assert sum(1 for w in target.weights if w == DESC_W) == len(byte_tokens)


def test_gt_target_is_the_canonical_serialization(codec: QwenJsonCodec) -> None:
    tokenizer = codec.tokenizer
    target = build_gt_target(
        [C, B, A], codec=codec, tokenizer=tokenizer, eos_token_id=eos_id(codec), desc_weight=DESC_W
    )
    assert target.text == codec.serialize([A, B, C]) and target.num_prefix_tokens == 0
    assert target.token_ids == [*tokenizer.encode(target.text, add_special_tokens=False), eos_id(codec)]
    assert target.weights == expected_weights(
        codec, target.token_ids[:-1], target.text, 0, ["red square", "blue circle", "fish"]
    )
    empty = build_gt_target([], codec=codec, tokenizer=tokenizer, eos_token_id=eos_id(codec))
    assert empty.text == "[]" and empty.weights == [1.0] * len(empty.token_ids)


def test_a_tokenizer_that_cannot_encode_a_label_is_a_data_error() -> None:
    # A character-level tokenizer without byte fallback: unknown characters become <unk>.
    model = Tokenizer(models.BPE(unk_token="<unk>"))
    model.decoder = decoders.Fuse()
    model.train_from_iterator(
        ['[{"bbox_2d": [0123456789], "label": "abcdefghijklmnopqrstuvwxyz "}]'],
        trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<|im_end|>"], show_progress=False),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<|im_end|>", unk_token="<unk>")
    codec = QwenJsonCodec(tokenizer, [tokenizer.eos_token_id])
    ok = build_gt_target(
        [DetObject("red", (1, 2, 3, 4))],
        codec=codec,
        tokenizer=tokenizer,
        eos_token_id=tokenizer.eos_token_id,
    )
    assert json.loads(ok.text)[0]["label"] == "red"
    with pytest.raises(DataError, match="does not round-trip"):
        build_gt_target(
            [DetObject("红", (1, 2, 3, 4))],
            codec=codec,
            tokenizer=tokenizer,
            eos_token_id=tokenizer.eos_token_id,
        )


# ------------------------------------------------------------------ truncated and repetitive rollouts
def repetitive_rollout(codec: QwenJsonCodec, copies: int) -> list[int]:
    """``[A, A, ..., A, {"bbox_2d": [1`` cut by max_new_tokens: a model stuck repeating one object."""
    element = codec.serialize([A])[1:-1]
    text = "[" + ", ".join([element] * copies) + ', {"bbox_2d": [1'
    return codec.tokenizer.encode(text, add_special_tokens=False)


def stop_token_id(codec: QwenJsonCodec) -> int:
    """The token free decoding emits to close the list after an element: the GT serialization's last."""
    return codec.tokenizer.encode(codec.serialize([A]), add_special_tokens=False)[-1]


@pytest.mark.parametrize("keep_prefix", ["matched", "all"])
def test_truncated_repetitive_rollout_ends_in_a_supervised_stop(
    codec: QwenJsonCodec, keep_prefix: str
) -> None:
    parse = codec.parse(repetitive_rollout(codec, copies=5), extent=EXTENT, hit_max_tokens=True)
    assert parse.truncated and len(parse.objects) == 5
    gts = [A, B]
    match = hungarian_match(parse.objects, gts)
    target = build_matched_target(
        parse,
        gts,
        match,
        codec=codec,
        tokenizer=codec.tokenizer,
        eos_token_id=eos_id(codec),
        loss=LossConfig(keep_prefix=keep_prefix, matched_prefix="none"),  # the rollout's own prefix
    )
    elements = json.loads(target.text)
    assert elements[-1]["label"] == B.label  # the missed object is appended
    # It ends in the stop free decoding would emit, then EOS, both with weight 1.
    assert target.token_ids[-2:] == [stop_token_id(codec), eos_id(codec)]
    assert target.weights[-2:] == [1.0, 1.0]
    if keep_prefix == "matched":
        # The repeats are false positives: the prefix ends after the first A, the list has exactly the
        # GT's length, and the repetition the rollout ran into is not in the target at all.
        assert elements == [{"bbox_2d": list(o.bbox), "label": o.label} for o in gts]
        assert target.dropped_elements == 4
        assert target.token_ids[:-1] == codec.tokenizer.encode(codec.serialize(gts), add_special_tokens=False)
        assert sum(w > 0 for w in target.weights[: target.num_prefix_tokens]) == 0
    else:
        assert len(elements) == 6 and target.dropped_elements == 0  # 5 own copies (weight 0) + B


def test_matched_prefix_stops_at_the_first_false_positive_or_invalid_element(codec: QwenJsonCodec) -> None:
    tokenizer = codec.tokenizer
    far = DetObject("fish", (900, 900, 990, 990))  # overlaps no GT
    bad = '{"bbox_2d": [9, 9, 1, 1], "label": "x"}'
    element = {o: codec.serialize([o])[1:-1] for o in (A, B, C, far)}
    cases = {  # rollout elements -> elements kept
        (element[A], element[B], element[far], element[C]): 2,
        (element[far], element[A]): 0,
        (element[A], bad, element[B]): 1,
        (element[A], element[B], element[C]): 3,
    }
    for elements, kept in cases.items():
        text = "[" + ", ".join(elements) + "]"
        parse = codec.parse(
            tokenizer.encode(text, add_special_tokens=False), extent=EXTENT, hit_max_tokens=False
        )
        match = hungarian_match(parse.objects, [A, B, C])
        assert leading_matched_elements(parse, match) == kept, text
        target = build_matched_target(
            parse, [A, B, C], match, codec=codec, tokenizer=tokenizer, eos_token_id=eos_id(codec)
        )
        assert target.text.startswith(text[: parse.element_ends[kept - 1]] if kept else "[")
        assert len(json.loads(target.text)) == 3  # always the GT's length
        assert target.dropped_elements == len(elements) - kept
        assert tokenizer.decode(target.token_ids[:-1], skip_special_tokens=False) == target.text


def test_cutting_inside_fused_tokens_round_trips(fused_codec: QwenJsonCodec, random_list_text) -> None:
    """A tokenizer whose tokens span element boundaries (`"}, {"`): every cut decodes exactly."""
    import random

    tokenizer = fused_codec.tokenizer
    rng = random.Random(1)
    for _ in range(30):
        text = random_list_text(rng)
        parse = fused_codec.parse(
            tokenizer.encode(text, add_special_tokens=False)[:-3], extent=EXTENT, hit_max_tokens=True
        )
        for keep in range(parse.num_complete + 1):
            target = build_rollout_target(
                parse,
                [C],
                codec=fused_codec,
                tokenizer=tokenizer,
                eos_token_id=eos_id(fused_codec),
                keep_elements=keep,
            )
            assert tokenizer.decode(target.token_ids[:-1], skip_special_tokens=False) == target.text
            assert len(json.loads(target.text)) == keep + 1
            assert target.weights[-1] == 1.0


def test_keep_elements_out_of_range_is_an_error(codec: QwenJsonCodec) -> None:
    parse = codec.parse(repetitive_rollout(codec, copies=2), extent=EXTENT, hit_max_tokens=True)
    with pytest.raises(DataError, match="keep_elements = 3"):
        build_rollout_target(
            parse, [], codec=codec, tokenizer=codec.tokenizer, eos_token_id=eos_id(codec), keep_elements=3
        )
