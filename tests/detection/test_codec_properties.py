"""Property tests of the strict parser: arbitrary, mutated and model-like token-id sequences.

Besides "never raises" and the ``ParseResult`` invariants, every parse is checked against the
strict rules of docs/detection.md: the prefix holds only complete objects, only the one token
holding the cut is re-encoded (every earlier token is kept as produced), and ``truncated`` means
the response hit ``max_new_tokens`` or ended inside the list, never that it stopped at an error.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from rollmatch.detection.codec import ELEMENT_REASONS, LIST_REASONS, QwenJsonCodec, decode_with_offsets
from rollmatch.detection.json_scan import scan_json_list
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
    check_strict_rules(codec, response, parse, hit_max_tokens)


def check_strict_rules(codec: QwenJsonCodec, response: list[int], parse, hit_max_tokens: bool) -> None:
    """The strict rules: objects-only prefix, one re-encoded token at most, truncation by cause."""
    if parse.has_complete_element:
        # complete only at the closing `}` of a top-level object: the prefix holds nothing else
        prefix_scan = scan_json_list(parse.prefix_text)
        assert parse.prefix_text.endswith("}") and len(prefix_scan.elements) == parse.num_complete
        assert all(parse.prefix_text[start] == "{" for start, _ in prefix_scan.elements)
        # earlier tokens are never re-tokenized: the ids agree with the response up to the cut
        # token k, and whatever replaces it decodes to a part of what token k itself decoded to
        prefix = parse.prefix_token_ids
        k = next((i for i, (a, b) in enumerate(zip(prefix, response, strict=False)) if a != b), len(prefix))
        if k < len(prefix):
            assert k < len(response)
            assert decode(codec, response[: k + 1]).startswith(parse.prefix_text), (
                f"tokens before the cut token {k} were re-encoded"
            )
    list_stop = {"not_a_list", "not_object", "bad_structure", "text_after_list"} & set(parse.invalid)
    if parse.closed or list_stop:
        assert parse.truncated == hit_max_tokens  # a list written to its end (or an error) is not cut off
    elif decode(codec, response).startswith("["):
        assert parse.truncated  # ended inside the list


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


# ------------------------------------------------------------------- model-like sequences (tiny model)
@pytest.fixture(scope="module")
def tiny_codec(tiny_tokenizer: PreTrainedTokenizerFast) -> QwenJsonCodec:
    """The codec over the tokenizer of the tiny Qwen2.5-VL test model (loaded from its directory)."""
    return QwenJsonCodec(tiny_tokenizer, [tiny_tokenizer.convert_tokens_to_ids(tiny_tokenizer.eos_token)])


# Top-level values a model may write instead of an object, and junk between elements.
NON_OBJECTS = ["42", "-1.5", "true", "null", '"red square"', "[1, 2, 3, 4]", "[]", "{}"]
JUNK = ["", " ", "\n", "hello", ",", "]", "}", "<|im_start|>"]
SEPARATORS = [", ", ",", " , ", "]", "]\n", "] done", " ", ""]
BYTES = bytes_to_unicode()


@st.composite
def model_like_ids(draw: st.DrawFn, tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """A response as a model may decode it, built piece by piece (each piece encoded on its own, so
    token boundaries differ from encoding the whole text): an opening ``[``, elements that are
    objects (some with stray invalid-UTF-8 byte tokens before their closing ``"}``) or other
    values, separators, junk, an optional EOS, and a cut at any token."""

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    ids = encode(draw(st.sampled_from(["[", "[", "[", " [", "```json\n["])))
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.booleans()):
            x1, y1 = draw(st.integers(0, 990)), draw(st.integers(0, 990))
            box = [x1, y1, draw(st.integers(x1 - 5, 1005)), draw(st.integers(y1 - 5, 1005))]
            label = draw(st.sampled_from(["red square", "fish", "", " ", "红色 é", 'a \\"b']))
            body = json.dumps({"bbox_2d": box, "label": label}, ensure_ascii=False)
            ids += encode(body[:-2])  # everything before the closing `"}`
            stray = draw(st.lists(st.sampled_from([0x80, 0xBF, 0xE7, 0xC3, 0xFF]), max_size=2))
            ids += [tokenizer.convert_tokens_to_ids(BYTES[b]) for b in stray]
            ids += encode('"}' + draw(st.sampled_from(SEPARATORS)))  # `"},` / `"}]` fused tokens
        else:
            ids += encode(draw(st.sampled_from(NON_OBJECTS)) + draw(st.sampled_from(SEPARATORS)))
        ids += encode(draw(st.sampled_from(JUNK))) if draw(st.integers(0, 5)) == 0 else []
    if draw(st.booleans()):
        ids.append(tokenizer.convert_tokens_to_ids(tokenizer.eos_token))
    return ids[: draw(st.integers(0, len(ids)))]


@given(data=st.data(), hit_max_tokens=st.booleans())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_model_like_sequences_of_the_tiny_tokenizer_follow_the_strict_rules(
    tiny_codec: QwenJsonCodec, data: st.DataObject, hit_max_tokens: bool
) -> None:
    ids = data.draw(model_like_ids(tiny_codec.tokenizer), label="ids")
    check_parse_invariants(tiny_codec, ids, hit_max_tokens)


@given(data=st.data(), hit_max_tokens=st.booleans())
@PROPERTY_SETTINGS
def test_arbitrary_ids_of_the_tiny_tokenizer_follow_the_strict_rules(
    tiny_codec: QwenJsonCodec, data: st.DataObject, hit_max_tokens: bool
) -> None:
    vocab = len(tiny_codec.tokenizer)
    prefix = tiny_codec.tokenizer.encode("[", add_special_tokens=False) if data.draw(st.booleans()) else []
    ids = prefix + data.draw(st.lists(st.integers(0, vocab - 1), max_size=60))
    check_parse_invariants(tiny_codec, ids, hit_max_tokens)
