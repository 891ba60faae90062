"""Property tests of the strict parser: arbitrary and mutated token-id sequences never break it."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollmatch.detection.codec import ELEMENT_REASONS, LIST_REASONS, QwenJsonCodec, decode_with_offsets
from rollmatch.detection.objects import DetObject

EXTENT = (1000, 1000)
PROPERTY_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def decode(codec: QwenJsonCodec, ids: list[int]) -> str:
    return codec.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def check_parse_invariants(codec: QwenJsonCodec, ids: list[int], hit_max_tokens: bool) -> None:
    parse = codec.parse(ids, extent=EXTENT, hit_max_tokens=hit_max_tokens)
    eos = codec.tokenizer.convert_tokens_to_ids(codec.tokenizer.eos_token)
    response = ids[: ids.index(eos)] if eos in ids else ids
    response_text = decode(codec, response)
    assert parse.response_text == response_text
    assert decode_with_offsets(codec.tokenizer, response).text == response_text
    if parse.has_complete_element:
        assert decode(codec, parse.prefix_token_ids) == parse.prefix_text
        assert response_text.startswith(parse.prefix_text)
        assert parse.num_complete >= 1
    else:
        assert parse.prefix_text == "["
        assert parse.prefix_token_ids == codec.tokenizer.encode("[", add_special_tokens=False)
        assert parse.num_complete == 0 and parse.objects == []
    assert set(parse.invalid) <= set(ELEMENT_REASONS) | set(LIST_REASONS)
    element_invalid = sum(parse.invalid.get(reason, 0) for reason in ELEMENT_REASONS)
    assert len(parse.objects) + element_invalid == parse.num_complete
    for obj in parse.objects:
        x1, y1, x2, y2 = obj.bbox
        assert 0 <= x1 < x2 <= EXTENT[0] and 0 <= y1 < y2 <= EXTENT[1] and obj.label.strip()
    if hit_max_tokens:
        assert parse.truncated


@given(data=st.data(), hit_max_tokens=st.booleans())
@PROPERTY_SETTINGS
def test_arbitrary_token_ids_never_raise(
    codec: QwenJsonCodec, data: st.DataObject, hit_max_tokens: bool
) -> None:
    # Ids up to the padded embedding size: a model can emit ids the tokenizer does not know.
    vocab = len(codec.tokenizer) + 64
    ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=60))
    check_parse_invariants(codec, ids, hit_max_tokens)


objects_strategy = st.lists(
    st.builds(
        lambda label, x1, y1, w, h: DetObject(label, (x1, y1, min(x1 + w, 1000), min(y1 + h, 1000))),
        st.text(min_size=1, max_size=8).filter(str.strip),
        st.integers(0, 999),
        st.integers(0, 999),
        st.integers(1, 400),
        st.integers(1, 400),
    ),
    max_size=4,
)


@given(objects=objects_strategy, data=st.data())
@PROPERTY_SETTINGS
def test_mutated_serializations_keep_a_token_exact_prefix(
    codec: QwenJsonCodec, fused_codec: QwenJsonCodec, objects: list[DetObject], data: st.DataObject
) -> None:
    for current in (codec, fused_codec):
        ids = current.tokenizer.encode(current.serialize(objects), add_special_tokens=False)
        vocab = len(current.tokenizer)
        for _ in range(data.draw(st.integers(0, 3), label="edits")):
            position = data.draw(st.integers(0, len(ids)), label="position")
            token = data.draw(st.integers(0, vocab - 1), label="token")
            if data.draw(st.booleans(), label="replace") and position < len(ids):
                ids[position] = token
            else:
                ids.insert(position, token)
        ids = ids[: data.draw(st.integers(0, len(ids)), label="truncate")]
        check_parse_invariants(current, ids, hit_max_tokens=False)


@given(objects=objects_strategy)
@PROPERTY_SETTINGS
def test_serialize_tokenize_parse_round_trip(
    codec: QwenJsonCodec, fused_codec: QwenJsonCodec, objects: list[DetObject]
) -> None:
    for current in (codec, fused_codec):
        text = current.serialize(objects)
        parse = current.parse(
            current.tokenizer.encode(text, add_special_tokens=False), extent=EXTENT, hit_max_tokens=False
        )
        assert [(o.label, o.bbox) for o in parse.objects] == [
            (e["label"], tuple(e["bbox_2d"])) for e in json.loads(text)
        ]
        assert parse.closed and not parse.truncated and parse.invalid == {}
        assert parse.prefix_text == text[:-1]
