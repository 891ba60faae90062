"""The ``coord_tokens`` format: one token per coordinate, parsed token-exactly like ``qwen_json``."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken

from rollmatch.detection.codec import ELEMENT_REASONS, LIST_REASONS
from rollmatch.detection.coord_tokens import NUM_BINS, CoordTokenCodec, coord_tokens, from_bin, to_bin
from rollmatch.detection.object_formats import build_codec
from rollmatch.detection.objects import DetObject
from rollmatch.errors import ConfigError
from rollmatch.models.tiny import build_tokenizer

EXTENT = (1000, 1000)
LABELS = ["red square", "blue circle", "green triangle", "fish", "raccoon", "star"]


@pytest.fixture(scope="module")
def codec() -> CoordTokenCodec:
    tokenizer = build_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in coord_tokens()])
    return build_codec("coord_tokens", tokenizer, [tokenizer.eos_token_id])  # type: ignore[return-value]


def encode(codec: CoordTokenCodec, text: str) -> list[int]:
    return codec.tokenizer.encode(text, add_special_tokens=False)


def random_objects(rng: random.Random, count: int) -> list[DetObject]:
    objects = []
    for _ in range(count):
        x1, y1 = rng.randint(0, 990), rng.randint(0, 990)
        objects.append(
            DetObject(rng.choice(LABELS), (x1, y1, rng.randint(x1 + 2, 1000), rng.randint(y1 + 2, 1000)))
        )
    return objects


def test_every_bin_round_trips_and_values_move_at_most_one_unit() -> None:
    assert [to_bin(from_bin(k)) for k in range(NUM_BINS)] == list(range(NUM_BINS))
    assert max(abs(from_bin(to_bin(v)) - v) for v in range(1001)) <= 1


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 6))
def test_serialize_then_parse_round_trips_with_one_token_per_coordinate(
    codec: CoordTokenCodec, seed, count
) -> None:
    objects = random_objects(random.Random(seed), count)
    ids = encode(codec, codec.serialize(objects))
    assert sum(i in codec._bin_of for i in ids) == 4 * count
    parse = codec.parse([*ids, codec.tokenizer.eos_token_id], extent=EXTENT, hit_max_tokens=False)
    assert parse.invalid == {} and parse.closed and not parse.truncated
    expected = sorted(objects, key=lambda o: (o.bbox[1], o.bbox[0], o.bbox[3], o.bbox[2], o.label))
    assert [o.label for o in parse.objects] == [o.label for o in expected]
    for got, want in zip(parse.objects, expected, strict=True):
        assert max(abs(a - b) for a, b in zip(got.bbox, want.bbox, strict=True)) <= 1


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 5), st.data())
def test_truncation_keeps_the_token_exact_prefix_of_complete_elements(codec, seed, count, data) -> None:
    objects = random_objects(random.Random(seed), count)
    ids = encode(codec, codec.serialize(objects))
    cut = data.draw(st.integers(1, len(ids) - 1))
    parse = codec.parse(ids[:cut], extent=EXTENT, hit_max_tokens=True)
    assert parse.truncated and not parse.invalid
    if parse.num_complete:  # the rollout's own ids; only the token holding the cut is re-encoded
        kept = parse.prefix_token_ids
        assert kept[:-1] == ids[: len(kept) - 1]
        assert codec.tokenizer.decode(kept) == parse.prefix_text and parse.prefix_text.endswith("}")
    full = codec.parse(ids, extent=EXTENT, hit_max_tokens=False)
    assert parse.objects == full.objects[: len(parse.objects)]
    assert len(parse.objects) == parse.num_complete


GOOD = '{"bbox_2d": [<|coord_10|>, <|coord_20|>, <|coord_300|>, <|coord_400|>], "label": "fish"}'


@pytest.mark.parametrize(
    ("element", "reason"),
    [
        (GOOD.replace("<|coord_10|>", "10"), "digit_coord"),  # a digit where a coordinate token belongs
        (GOOD.replace("<|coord_10|>, ", ""), "bad_coord"),  # three coordinates
        (GOOD.replace("<|coord_10|>", "<|coord_10|>, <|coord_11|>"), "bad_coord"),  # five
        (GOOD.replace('"fish"', '"fish <|coord_3|>"'), "misplaced_coord"),  # a coordinate token in the label
        (GOOD.replace("<|coord_300|>", "<|coord_5|>"), "degenerate_box"),  # x2 <= x1
        (GOOD.replace('"label": "fish"', '"label": ""'), "empty_label"),
        (GOOD.replace('"label"', '"name"'), "bad_keys"),
    ],
)
def test_every_invalid_element_has_a_reason(codec: CoordTokenCodec, element: str, reason: str) -> None:
    parse = codec.parse(encode(codec, "[" + element + "]"), extent=EXTENT, hit_max_tokens=False)
    assert parse.invalid == {reason: 1} and parse.objects == [] and parse.num_complete == 1
    assert reason in ELEMENT_REASONS


def test_the_characters_of_a_coordinate_token_typed_as_text_are_not_one(codec: CoordTokenCodec) -> None:
    head, tail = GOOD.split("<|coord_10|>")
    ids = (
        encode(codec, "[" + head)
        + encode(codec, "<|coord_")
        + encode(codec, "10|>")
        + encode(codec, tail + "]")
    )
    assert codec.tokenizer.decode(ids) == "[" + GOOD + "]"  # the same text ...
    parse = codec.parse(ids, extent=EXTENT, hit_max_tokens=False)
    assert parse.objects == [] and set(parse.invalid) <= set(ELEMENT_REASONS + LIST_REASONS)  # ... no object
    assert parse.invalid


def test_coordinate_tokens_are_value_characters_for_the_loss_weights(codec: CoordTokenCodec) -> None:
    text = "[" + GOOD + "]"
    roles = codec.char_roles(text)
    token = text.index("<|coord_300|>")
    assert 1 in roles[token : token + len("<|coord_300|>")]  # VALUE: a coordinate, weighted like one


def test_a_tokenizer_without_the_tokens_is_refused_with_the_fix() -> None:
    tokenizer = build_tokenizer()
    with pytest.raises(ConfigError, match="rollmatch add-coord-tokens"):
        build_codec("coord_tokens", tokenizer, [tokenizer.eos_token_id])


def test_unlikelihood_flags_the_first_wrong_coordinate_token_after_own_mistakes(
    codec: CoordTokenCodec,
) -> None:
    from rollmatch.config.schema import LossConfig
    from rollmatch.detection.matching import hungarian_match
    from rollmatch.detection.targets import build_matched_target

    gts = [DetObject("fish", (100, 100, 300, 300)), DetObject("star", (100, 600, 300, 800))]
    # the false positive shares fish's first coordinate and leaves it at the second (y1 500 vs 100)
    false_positive = DetObject("fish", (100, 500, 200, 550))
    text = codec.serialize_in_order([false_positive, gts[0]])
    parse = codec.parse(encode(codec, text), extent=EXTENT, hit_max_tokens=False)
    match = hungarian_match(parse.objects, gts)
    loss = LossConfig(keep_prefix="all", matched_prefix="supervise", fp_unlikelihood_weight=1.0)
    eos = codec.tokenizer.eos_token_id
    t = build_matched_target(
        parse, gts, match, codec=codec, tokenizer=codec.tokenizer, eos_token_id=eos, loss=loss
    )
    flagged = [i for i, u in enumerate(t.unlikelihood_weights) if u > 0]
    assert [codec.tokenizer.convert_ids_to_tokens(t.token_ids[i]) for i in flagged] == [
        coord_tokens()[to_bin(500)]
    ]
    assert flagged[0] < t.token_ids.index(codec.tokenizer.convert_tokens_to_ids(coord_tokens()[to_bin(300)]))
