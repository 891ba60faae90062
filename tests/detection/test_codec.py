"""Strict token-exact parsing and serialization of the qwen_json codec, on real tokenizers."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from rollmatch.detection.codec import QwenJsonCodec, decode_with_offsets
from rollmatch.detection.object_formats import build_codec
from rollmatch.detection.objects import DetObject, canonical_order
from rollmatch.errors import ConfigError

EOS = "<|im_end|>"

EXTENT = (1000, 1000)
A = DetObject("red square", (10, 20, 300, 400))
B = DetObject("blue circle", (500, 20, 700, 90))
C = DetObject("fish", (5, 600, 100, 700))


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def decode(tokenizer: PreTrainedTokenizerFast, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def single_token(tokenizer: PreTrainedTokenizerFast, text: str) -> int:
    ids = encode(tokenizer, text)
    assert len(ids) == 1, f"test precondition: {text!r} must be one token of the tokenizer, got {ids}"
    return ids[0]


# ------------------------------------------------------------------------------------ serialization
def test_serialize_is_canonical_one_line_json(codec: QwenJsonCodec) -> None:
    text = codec.serialize([C, B, A])
    assert text == (
        '[{"bbox_2d": [10, 20, 300, 400], "label": "red square"}, '
        '{"bbox_2d": [500, 20, 700, 90], "label": "blue circle"}, '
        '{"bbox_2d": [5, 600, 100, 700], "label": "fish"}]'
    )
    assert json.loads(text)[0] == {"bbox_2d": [10, 20, 300, 400], "label": "red square"}
    assert codec.serialize([]) == "[]"
    assert (
        codec.serialize([DetObject("红色 é", (1, 2, 3, 4))])
        == '[{"bbox_2d": [1, 2, 3, 4], "label": "红色 é"}]'
    )


def test_append_fragment_forms(codec: QwenJsonCodec) -> None:
    element_b = '{"bbox_2d": [500, 20, 700, 90], "label": "blue circle"}'
    element_c = '{"bbox_2d": [5, 600, 100, 700], "label": "fish"}'
    assert codec.append_fragment([C, B], after_element=True) == f", {element_b}, {element_c}]"
    assert codec.append_fragment([C, B], after_element=False) == f"{element_b}, {element_c}]"
    assert codec.append_fragment([], after_element=True) == "]"
    assert codec.append_fragment([], after_element=False) == "]"


def test_build_codec_names_the_key_on_unknown_format(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    eos = qwen_tokenizer.convert_tokens_to_ids(EOS)
    assert build_codec("qwen_json", qwen_tokenizer, [eos]).name == "qwen_json"
    with pytest.raises(ConfigError, match=r"custom\.object_format = 'yaml'.*coord_tokens.*qwen_json"):
        build_codec("yaml", qwen_tokenizer, [eos])
    with pytest.raises(ConfigError, match="eos_token_ids"):
        QwenJsonCodec(qwen_tokenizer, [])


# ------------------------------------------------------------------------------------ offsets
def test_decode_with_offsets_groups_split_multibyte_characters(
    qwen_tokenizer: PreTrainedTokenizerFast,
) -> None:
    text = '"红色 é" ok'
    ids = encode(qwen_tokenizer, text)
    decoded = decode_with_offsets(qwen_tokenizer, ids)
    assert decoded.text == decode(qwen_tokenizer, ids) == text
    assert len(ids) > len(text), "test precondition: CJK characters are split into byte tokens"
    spans = decoded.token_spans()
    assert len(spans) == len(ids)
    red = text.index("红")
    # every byte token of 红 maps to the span of exactly that character
    red_tokens = [ids[k] for k, span in enumerate(spans) if span == (red, red + 1)]
    assert len(red_tokens) >= 2 and decode(qwen_tokenizer, red_tokens) == "红"
    # groups tile the text and the token list without gaps
    assert [g[0] for g in decoded.groups[1:]] == [g[1] for g in decoded.groups[:-1]]
    assert [g[2] for g in decoded.groups[1:]] == [g[3] for g in decoded.groups[:-1]]
    assert decoded.groups[-1][1] == len(ids) and decoded.groups[-1][3] == len(text)


def test_decode_with_offsets_flushes_a_cut_off_character(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = encode(qwen_tokenizer, "[红")
    decoded = decode_with_offsets(qwen_tokenizer, ids[:-1])  # ends inside the 3-byte character
    assert decoded.text == decode(qwen_tokenizer, ids[:-1])
    assert decoded.text.startswith("[") and decoded.text.endswith("\ufffd")


def test_offsets_through_the_plain_tokenizer_interface_match_the_fast_path(
    qwen_tokenizer: PreTrainedTokenizerFast,
) -> None:
    class PlainTokenizer:
        """Only ``encode``/``decode`` (no Rust backend): the generic path of the codec."""

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return qwen_tokenizer.encode(text, add_special_tokens=add_special_tokens)

        def decode(self, ids: list[int], **kwargs: bool) -> str:
            return qwen_tokenizer.decode(ids, **kwargs)

    ids = encode(qwen_tokenizer, '[{"bbox_2d": [1, 2, 3, 4], "label": "红色 é"}, {"bb')
    for cut in range(len(ids) + 1):  # includes cuts inside the split characters
        assert decode_with_offsets(PlainTokenizer(), ids[:cut]) == decode_with_offsets(
            qwen_tokenizer, ids[:cut]
        )


# ------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("which", ["codec", "fused_codec"])
def test_every_truncation_of_a_serialization_keeps_exactly_the_complete_elements(
    which: str, request: pytest.FixtureRequest
) -> None:
    codec: QwenJsonCodec = request.getfixturevalue(which)
    tokenizer = codec.tokenizer
    objects = canonical_order([A, B, C, DetObject("红色 é", (1, 2, 3, 4))])
    text = codec.serialize(objects)
    element_ends = [len(codec.serialize(objects[: i + 1])) - 1 for i in range(len(objects))]
    ids = encode(tokenizer, text)
    for cut in range(len(ids) + 1):
        parse = codec.parse(ids[:cut], extent=EXTENT, hit_max_tokens=cut < len(ids))
        seen = len(decode(tokenizer, ids[:cut]))
        complete = sum(1 for end in element_ends if end <= seen)
        assert parse.objects == objects[:complete], cut
        assert parse.num_complete == complete and parse.has_complete_element == (complete > 0)
        assert parse.invalid == ({} if cut else {"not_a_list": 1})
        assert parse.truncated == (cut < len(ids))
        expected_prefix = text[: element_ends[complete - 1]] if complete else "["
        assert parse.prefix_text == expected_prefix
        assert decode(tokenizer, parse.prefix_token_ids) == expected_prefix
        if complete:  # every token before the one holding the closing `}` is kept as produced
            close = element_ends[complete - 1] - 1
            before = max(k for k in range(cut + 1) if len(decode(tokenizer, ids[:k])) <= close)
            assert parse.prefix_token_ids[:before] == ids[:before]
    assert parse.closed and parse.response_text == text


def test_fused_closing_tokens_are_cut_and_reencoded(codec: QwenJsonCodec) -> None:
    tokenizer = codec.tokenizer
    close_comma, close_list = single_token(tokenizer, '"},'), single_token(tokenizer, '"}]')
    element_a = '[{"bbox_2d": [10, 20, 300, 400], "label": "red square'
    # `"},` holds the end of element A and the separator: the cut keeps `"}` only.
    ids = [*encode(tokenizer, element_a), close_comma, *encode(tokenizer, ' {"bbox_2d": [5')]
    parse = codec.parse(ids, extent=EXTENT, hit_max_tokens=True)
    assert parse.objects == [A] and parse.truncated
    assert parse.prefix_text == element_a + '"}'
    assert parse.prefix_token_ids == [
        *ids[: len(ids) - 1 - len(encode(tokenizer, ' {"bbox_2d": [5'))],
        *encode(tokenizer, '"}'),
    ]
    assert decode(tokenizer, parse.prefix_token_ids) == parse.prefix_text
    # `"}]` ends element A and the list: same cut, and the list is closed.
    parse = codec.parse([*encode(tokenizer, element_a), close_list], extent=EXTENT, hit_max_tokens=False)
    assert parse.objects == [A] and parse.closed and not parse.truncated
    assert parse.prefix_token_ids == [*encode(tokenizer, element_a), single_token(tokenizer, '"}')]


def test_tokens_spanning_element_boundaries_are_cut(fused_codec: QwenJsonCodec) -> None:
    tokenizer = fused_codec.tokenizer
    text = fused_codec.serialize([A, B])
    ids = encode(tokenizer, text)
    boundary = text.index("}, {") + 1
    spans = decode_with_offsets(tokenizer, ids).token_spans()
    assert any(s < boundary < e for s, e in spans), "test precondition: one token spans the element boundary"
    parse = fused_codec.parse(ids[:-1], extent=EXTENT, hit_max_tokens=True)
    assert parse.objects == [A]
    assert decode(tokenizer, parse.prefix_token_ids) == text[:boundary]


def test_text_after_eos_is_ignored(codec: QwenJsonCodec) -> None:
    tokenizer = codec.tokenizer
    eos = tokenizer.convert_tokens_to_ids(EOS)
    first = encode(tokenizer, codec.serialize([A]))
    parse = codec.parse(
        [*first, eos, *encode(tokenizer, codec.serialize([B, C]))], extent=EXTENT, hit_max_tokens=False
    )
    assert parse.objects == [A] and parse.closed and not parse.truncated
    assert parse.response_text == codec.serialize([A])
    # EOS in the middle of the list: what came before is kept, the list is reported truncated.
    ids = encode(tokenizer, codec.serialize([A, B]))
    cut = len(encode(tokenizer, codec.serialize([A]))) + 3
    parse = codec.parse([*ids[:cut], eos, *ids[cut:]], extent=EXTENT, hit_max_tokens=False)
    assert parse.objects == [A] and parse.truncated and not parse.closed


@pytest.mark.parametrize(
    ("response", "reason"),
    [
        ("Sure! Here are the objects.", "not_a_list"),
        ('```json\n[{"bbox_2d": [1, 2, 3, 4], "label": "a"}]', "not_a_list"),
        ('[{"bbox_2d": [1, 2, 3, 4], "label": "a"]', "bad_structure"),
        ("[, {", "bad_structure"),
        ('[{"bbox_2d": [1, 2, 3, 4}, "label": "a"}]', "bad_structure"),
        ("[hello]", "bad_structure"),
        ("[1, 2, 3", "not_object"),
        ('["red square"]', "not_object"),
        ("[[10, 20, 300, 400]]", "not_object"),
    ],
)
def test_non_json_responses_give_the_bare_prefix(codec: QwenJsonCodec, response: str, reason: str) -> None:
    parse = codec.parse(encode(codec.tokenizer, response), extent=EXTENT, hit_max_tokens=False)
    assert parse.prefix_text == "[" and parse.prefix_token_ids == encode(codec.tokenizer, "[")
    assert not parse.has_complete_element and parse.objects == [] and parse.num_complete == 0
    assert parse.invalid == {reason: 1}
    assert not parse.truncated  # the scan stopped at an error, not at the end of the response


def test_structure_error_keeps_the_elements_before_it(codec: QwenJsonCodec) -> None:
    first = '[{"bbox_2d": [10, 20, 300, 400], "label": "red square"}'
    for junk in [", ]", ' {"bbox_2d": [1, 2, 3, 4], "label": "a"}]', ", <|im_start|>"]:
        parse = codec.parse(encode(codec.tokenizer, first + junk), extent=EXTENT, hit_max_tokens=False)
        assert parse.objects == [A] and parse.prefix_text == first and parse.invalid == {"bad_structure": 1}
        # a list written to its end with an error inside is not truncated (rollout/truncated_frac)
        assert not parse.truncated


def test_non_object_values_are_never_complete_elements(codec: QwenJsonCodec) -> None:
    # `[1, 2, 3` keeps just `[`: top-level numbers, strings and arrays never enter the prefix.
    for text in ["[1, 2, 3", "[1, 2, 3]", '["red square", "fish"]', "[[1, 2, 3, 4], "]:
        parse = codec.parse(encode(codec.tokenizer, text), extent=EXTENT, hit_max_tokens=False)
        assert parse.prefix_text == "[" and parse.prefix_token_ids == encode(codec.tokenizer, "[")
        assert parse.num_complete == 0 and parse.invalid == {"not_object": 1} and not parse.truncated
    # after a complete object, a non-object value stops the scan: the object stays, nothing after it
    first = '[{"bbox_2d": [10, 20, 300, 400], "label": "red square"}'
    text = first + ', 42, {"bbox_2d": [500, 20, 700, 90], "label": "blue circle"}]'
    parse = codec.parse(encode(codec.tokenizer, text), extent=EXTENT, hit_max_tokens=False)
    assert parse.objects == [A] and parse.prefix_text == first and parse.num_complete == 1
    assert parse.invalid == {"not_object": 1} and not parse.truncated and not parse.closed


def test_a_stray_byte_before_the_cut_token_is_kept_as_produced(codec: QwenJsonCodec) -> None:
    tokenizer = codec.tokenizer
    stray = tokenizer.convert_tokens_to_ids(bytes_to_unicode()[0x80])  # a lone continuation byte
    assert decode(tokenizer, [stray]) == "\ufffd", "test precondition: one token for the invalid byte"
    close_comma = single_token(tokenizer, '"},')
    head = encode(tokenizer, '[{"bbox_2d": [10, 20, 300, 400], "label": "red square')
    ids = [*head, stray, close_comma, *encode(tokenizer, ' {"bbox_2d": [5')]
    parse = codec.parse(ids, extent=EXTENT, hit_max_tokens=True)
    assert parse.objects == [DetObject("red square\ufffd", A.bbox)]
    # the stray byte shares a decode group with `"},`; only `"},` is re-encoded (for its `"}`)
    assert parse.prefix_token_ids == [*head, stray, *encode(tokenizer, '"}')]
    assert decode(tokenizer, parse.prefix_token_ids) == parse.prefix_text


def test_text_after_the_list_is_counted(codec: QwenJsonCodec) -> None:
    text = codec.serialize([A]) + "\nThat is all."
    parse = codec.parse(encode(codec.tokenizer, text), extent=EXTENT, hit_max_tokens=False)
    assert parse.objects == [A] and parse.closed and parse.invalid == {"text_after_list": 1}
    parse = codec.parse(encode(codec.tokenizer, "[]\n"), extent=EXTENT, hit_max_tokens=False)
    assert parse.closed and parse.invalid == {} and parse.prefix_text == "[" and not parse.truncated


INVALID_ELEMENTS = {
    "bad_json": ['{"bbox_2d": [1, 2, 3, 4], "label": "a",}', '{"bbox_2d": [1, 2, 3, 4], "label": "a\nb"}'],
    "bad_keys": [
        '{"bbox": [1, 2, 3, 4], "label": "a"}',
        '{"bbox_2d": [1, 2, 3, 4], "label": "a", "score": 0.9}',
        '{"bbox_2d": [1, 2, 3, 4], "label": "a", "label": "b"}',
    ],
    "bad_label": ['{"bbox_2d": [1, 2, 3, 4], "label": 7}'],
    "empty_label": ['{"bbox_2d": [1, 2, 3, 4], "label": ""}', '{"bbox_2d": [1, 2, 3, 4], "label": "  "}'],
    "bad_coord": [
        '{"bbox_2d": [1, 2, 3.0, 4], "label": "a"}',
        '{"bbox_2d": [1, 2, true, 4], "label": "a"}',
        '{"bbox_2d": [1, 2, 3], "label": "a"}',
        '{"bbox_2d": [1, 2, 1001, 4], "label": "a"}',
        '{"bbox_2d": [-1, 2, 3, 4], "label": "a"}',
        '{"bbox_2d": "1, 2, 3, 4", "label": "a"}',
    ],
    "degenerate_box": ['{"bbox_2d": [3, 2, 3, 4], "label": "a"}', '{"bbox_2d": [1, 5, 3, 4], "label": "a"}'],
}


@pytest.mark.parametrize("reason", sorted(INVALID_ELEMENTS))
def test_each_invalid_reason_is_counted_and_excluded(codec: QwenJsonCodec, reason: str) -> None:
    bad = INVALID_ELEMENTS[reason]
    good = '{"bbox_2d": [10, 20, 300, 400], "label": "red square"}'
    text = "[" + ", ".join([good, *bad]) + "]"
    parse = codec.parse(encode(codec.tokenizer, text), extent=EXTENT, hit_max_tokens=False)
    assert parse.objects == [A]
    assert parse.invalid == {reason: len(bad)}
    assert parse.num_complete == 1 + len(bad)
    # invalid elements stay in the prefix as written (the model's own tokens); they are never repaired
    assert parse.prefix_text == text[:-1] and parse.closed


def test_valid_variants_are_accepted(codec: QwenJsonCodec) -> None:
    text = '[ {"label": "a", "bbox_2d": [0, 0, 1000, 1000]} ,{"bbox_2d":[1,2,3,4],"label":"\\u7ea2"}]'
    parse = codec.parse(encode(codec.tokenizer, text), extent=EXTENT, hit_max_tokens=False)
    assert parse.objects == [DetObject("a", (0, 0, 1000, 1000)), DetObject("红", (1, 2, 3, 4))]
    assert parse.invalid == {}


def test_extent_is_per_axis(codec: QwenJsonCodec) -> None:
    text = '[{"bbox_2d": [0, 0, 640, 480], "label": "a"}, {"bbox_2d": [0, 0, 480, 640], "label": "b"}]'
    parse = codec.parse(encode(codec.tokenizer, text), extent=(640, 480), hit_max_tokens=False)
    assert parse.objects == [DetObject("a", (0, 0, 640, 480))] and parse.invalid == {"bad_coord": 1}


def test_hit_max_tokens_marks_truncation_even_when_closed(codec: QwenJsonCodec) -> None:
    parse = codec.parse(encode(codec.tokenizer, codec.serialize([A])), extent=EXTENT, hit_max_tokens=True)
    assert parse.truncated and parse.closed and parse.objects == [A]


def test_a_cut_that_does_not_reencode_moves_back_one_element(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    class DriftingTokenizer:
        """Injects a fault: the re-encoded kept part of a cut token decodes to different text."""

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            ids = qwen_tokenizer.encode(text, add_special_tokens=add_special_tokens)
            return ids + qwen_tokenizer.encode(" ", add_special_tokens=False) if text == '"}' else ids

        def decode(self, ids: list[int], **kwargs: bool) -> str:
            return qwen_tokenizer.decode(ids, **kwargs)

    codec = QwenJsonCodec(DriftingTokenizer(), [qwen_tokenizer.convert_tokens_to_ids(EOS)])
    single_token(qwen_tokenizer, '"},')  # A's cut falls inside this token and needs a re-encode
    text = codec.serialize([A, B])
    ids = encode(qwen_tokenizer, text)
    parse = codec.parse(ids[:-2], extent=EXTENT, hit_max_tokens=True)
    assert parse.objects == [] and parse.prefix_text == "[" and parse.invalid == {"cut_mismatch": 1}


def test_loaded_tokenizer_parses_like_the_built_one(
    tiny_tokenizer: PreTrainedTokenizerFast, random_list_text: Callable[[random.Random], str]
) -> None:
    codec = QwenJsonCodec(tiny_tokenizer, [tiny_tokenizer.convert_tokens_to_ids(EOS)])
    rng = random.Random(1)
    for _ in range(5):
        text = random_list_text(rng)
        parse = codec.parse(encode(tiny_tokenizer, text), extent=EXTENT, hit_max_tokens=False)
        assert [{"bbox_2d": list(o.bbox), "label": o.label} for o in parse.objects] == json.loads(text)
