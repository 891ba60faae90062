"""Noise objects (``loss.noise_objects``, Pix2Seq's sequence augmentation): which target tokens are
supervised in both object formats, the draw (counts, kinds, valid boxes, determinism per seed), and
dropping them from answers before matching."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken

from rollmatch.config.schema import MatchingConfig, NoiseObjectsConfig
from rollmatch.detection.codec import QwenJsonCodec
from rollmatch.detection.coord_tokens import coord_tokens
from rollmatch.detection.json_scan import TEXT, VALUE
from rollmatch.detection.noise_objects import (
    MIN_SIDE,
    drop_noise_objects,
    noise_count,
    noise_rng,
    sample_noise_objects,
)
from rollmatch.detection.object_formats import build_codec
from rollmatch.detection.objects import DetObject, canonical_order
from rollmatch.detection.scoring import score_response
from rollmatch.detection.targets import build_gt_target
from rollmatch.errors import DataError
from rollmatch.models.tiny import build_tokenizer

EXTENT = (1000, 1000)
GTS = [
    DetObject("red square", (100, 120, 260, 300)),
    DetObject("blue circle", (500, 40, 640, 210)),
    DetObject("star", (700, 650, 930, 990)),
]


def noise_cfg(**kwargs: object) -> NoiseObjectsConfig:
    return NoiseObjectsConfig(**{"enabled": True, "pad_to": 8, **kwargs})


@pytest.fixture(scope="module")
def codecs() -> dict[str, QwenJsonCodec]:
    digits = build_tokenizer()
    coords = build_tokenizer()
    coords.add_tokens([AddedToken(t, special=True, normalized=False) for t in coord_tokens()])
    return {
        "qwen_json": build_codec("qwen_json", digits, [digits.eos_token_id]),  # type: ignore[dict-item]
        "coord_tokens": build_codec("coord_tokens", coords, [coords.eos_token_id]),  # type: ignore[dict-item]
    }


def token_roles(codec: QwenJsonCodec, token_ids: list[int]) -> list[tuple[int, int, bytes]]:
    """Per token: its character span and the roles of its characters."""
    from rollmatch.detection.codec import decode_with_offsets

    decoded = decode_with_offsets(codec.tokenizer, token_ids)
    roles = codec.char_roles(decoded.text)
    return [(a, b, roles[a:b]) for a, b in decoded.token_spans()]


@pytest.mark.parametrize("fmt", ["qwen_json", "coord_tokens"])
def test_noise_coordinates_weigh_zero_their_labels_and_the_list_structure_are_supervised(
    codecs: dict[str, QwenJsonCodec], fmt: str
) -> None:
    codec = codecs[fmt]
    cfg = noise_cfg(label_weight=0.25)
    noise = sample_noise_objects(GTS, EXTENT, cfg, noise_rng(0, "r0", 0))
    assert len(noise) == 5 and {o.label for o in noise} == {"noise"}
    eos = codec.tokenizer.eos_token_id
    kw = {"codec": codec, "tokenizer": codec.tokenizer, "eos_token_id": eos}
    plain = build_gt_target(GTS, **kw)
    target = build_gt_target(GTS, noise=noise, noise_label_weight=0.25, **kw)
    real_text = codec.serialize(GTS)
    # the real objects first, in canonical order, then the noise objects, in the order drawn
    assert target.text == codec.serialize_in_order([*canonical_order(GTS), *noise])
    assert target.text.startswith(real_text[:-1] + ", ")
    noise_start = len(real_text) - 1
    close = len(target.text) - 1
    spans = token_roles(codec, target.token_ids[:-1])
    zero = supervised_label = structure = 0
    for (start, stop, roles), weight in zip(spans, target.weights[:-1], strict=True):
        if stop <= noise_start:
            continue  # the real list: checked against the plain target below
        in_noise = roles[max(0, noise_start - start) : max(0, min(stop, close) - start)]
        if VALUE in in_noise:
            assert weight == 0.0, (start, stop, target.text[start:stop])
            zero += 1
        elif TEXT in in_noise:
            assert weight == 0.25, target.text[start:stop]
            supervised_label += 1
        else:
            assert weight == 1.0, target.text[start:stop]
            structure += 1
    assert zero >= 4 * len(noise) if fmt == "coord_tokens" else zero >= len(noise)
    assert supervised_label >= len(noise) and structure >= 2 * len(noise)
    assert target.weights[-1] == 1.0 and target.token_ids[-1] == eos  # "]" and EOS supervised
    # the real objects' tokens weigh as in the plain SFT target (all but the token closing the list)
    real_tokens = len(plain.token_ids) - 2
    assert target.token_ids[: real_tokens - 1] == plain.token_ids[: real_tokens - 1]
    assert target.weights[: real_tokens - 1] == plain.weights[: real_tokens - 1]


@pytest.mark.parametrize("fmt", ["qwen_json", "coord_tokens"])
def test_every_noise_object_is_a_valid_element_the_strict_parser_accepts_and_scoring_drops(
    codecs: dict[str, QwenJsonCodec], fmt: str
) -> None:
    codec = codecs[fmt]
    rng = random.Random(5)
    for trial in range(40):
        cfg = noise_cfg(pad_to=rng.randint(1, 12), jitter=rng.choice([0.05, 0.5, 1.0]))
        gts = GTS[: rng.randint(0, 3)]
        noise = sample_noise_objects(gts, EXTENT, cfg, noise_rng(trial, f"r{trial}", trial))
        assert all(o.bbox[2] - o.bbox[0] >= MIN_SIDE and o.bbox[3] - o.bbox[1] >= MIN_SIDE for o in noise)
        ids = build_gt_target(
            gts,
            codec=codec,
            tokenizer=codec.tokenizer,
            eos_token_id=codec.tokenizer.eos_token_id,
            noise=noise,
        ).token_ids
        parse = codec.parse(ids, extent=EXTENT, hit_max_tokens=False)
        assert parse.invalid == {} and parse.closed and len(parse.objects) == len(gts) + len(noise)
        scored = score_response(
            codec,
            ids,
            gts,
            extent=EXTENT,
            hit_max_tokens=False,
            matching=MatchingConfig(),
            noise_label="noise",
        )
        assert scored.parse.noise_objects == len(noise) and len(scored.parse.objects) == len(gts)
        assert len(scored.match.pairs) == len(gts) and scored.match.fp == []
        kept = scored.parse.element_valid
        assert kept == [True] * len(gts) + [False] * len(noise)
        # without the noise label every noise object is an unmatched prediction
        plain = score_response(
            codec, ids, gts, extent=EXTENT, hit_max_tokens=False, matching=MatchingConfig()
        )
        assert len(plain.match.fp) == len(noise)


def test_dropping_keeps_real_objects_and_invalid_elements_in_place(codecs: dict[str, QwenJsonCodec]) -> None:
    codec = codecs["qwen_json"]
    text = (
        '[{"bbox_2d": [1, 2, 30, 40], "label": "noise"}, {"bbox_2d": [5, 5, 4, 9], "label": "fish"}, '
        '{"bbox_2d": [10, 10, 50, 50], "label": "fish"}]'
    )
    parse = codec.parse(
        codec.tokenizer.encode(text, add_special_tokens=False), extent=EXTENT, hit_max_tokens=False
    )
    dropped = drop_noise_objects(parse, "noise")
    assert [o.label for o in dropped.objects] == ["fish"] and dropped.noise_objects == 1
    assert dropped.element_valid == [False, False, True] and dropped.invalid == {"degenerate_box": 1}
    assert drop_noise_objects(parse, None) is parse


def test_counts_kinds_and_the_draw_is_a_function_of_seed_record_and_step() -> None:
    assert [noise_count(n, noise_cfg(pad_to=4)) for n in (0, 3, 4, 9)] == [4, 1, 0, 0]
    assert noise_count(7, NoiseObjectsConfig(enabled=True, count=2)) == 2
    per = NoiseObjectsConfig(enabled=True, per_object=0.5)
    assert [noise_count(n, per) for n in (0, 1, 3, 4)] == [0, 1, 2, 2]
    cfg = noise_cfg(pad_to=30)
    draw = lambda seed, rid, step: sample_noise_objects(GTS, EXTENT, cfg, noise_rng(seed, rid, step))  # noqa: E731
    assert draw(0, "a", 3) == draw(0, "a", 3)
    assert draw(0, "a", 3) != draw(1, "a", 3) and draw(0, "a", 3) != draw(0, "a", 4)
    assert draw(0, "a", 3) != draw(0, "b", 3)
    # jittered copies stay close to a GT box; random boxes need no GT at all
    jittered = NoiseObjectsConfig(enabled=True, count=50, kinds={"jittered": 1, "shifted": 0, "random": 0})
    boxes = sample_noise_objects(GTS, EXTENT, jittered, random.Random(0))
    assert all(max(_iou(b.bbox, g.bbox) for g in GTS) > 0.5 for b in boxes)
    assert sample_noise_objects([], EXTENT, jittered, random.Random(0)) == []
    only_random = NoiseObjectsConfig(enabled=True, count=20, kinds={"jittered": 0, "shifted": 0, "random": 1})
    assert len(sample_noise_objects([], EXTENT, only_random, random.Random(0))) == 20
    with pytest.raises(DataError, match=r"record 'r9'.*noise.*loss.noise_objects.label"):
        sample_noise_objects(
            [DetObject("noise", (1, 1, 9, 9))], EXTENT, cfg, random.Random(0), sample_id="r9"
        )


def _iou(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    from rollmatch.detection.objects import iou

    return iou(a, b)
