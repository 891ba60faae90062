"""Noise objects: Pix2Seq's sequence augmentation for the SFT target, and dropping them from answers (pure).

Owns: how many noise objects a record gets (:func:`noise_count`), drawing them
(:func:`sample_noise_objects`: jittered copies of GT boxes, GT boxes moved to a random centre, random
boxes, all labelled ``loss.noise_objects.label``), the per-record random stream
(:func:`noise_rng`: a function of the seed, the record id and the optimizer step), and the scoring side:
the label evaluation drops (:func:`noise_label_of`) and :func:`drop_noise_objects`, which takes them
out of a strict parse before matching. Leaves out: where they sit in the target and how they are
weighted (``detection.targets.build_gt_target``: after the real objects, coordinate tokens at weight 0),
and when they are drawn (``training.segment_producers``).

What is copied from Pix2Seq (Chen et al., 2022, ``data/data_utils.py``: ``augment_bbox``,
``jitter_bbox``, ``shift_bbox``, ``random_bbox``, ``inject_noise_bbox``): the three kinds and their
distributions (a duplicate is a GT box with each side moved by a truncated normal of std 0.05 of the
box's size; a shifted box keeps a GT box's size at a uniform centre; a random box has a uniform centre
and sides |truncated normal| of std 0.5 of the image), padding to a maximum object count, boxes clipped
to the image, noise appended after the real objects, a fresh draw every time a record is trained on,
and the coordinate tokens of noise objects at loss weight 0 while their class is supervised. What
differs: Pix2Seq draws how many of the noise objects are duplicates uniformly in ``[0, n]`` and the rest
half shifted, half random; here each noise object draws its kind from fixed weights (defaults 0.5 /
0.25 / 0.25: the same expected mix). Pix2Seq's real objects are in random order; here they keep the
canonical order of every rollmatch target. Pix2Seq supervises its noise class token at its EOS weight
(0.1); here ``label_weight`` (default 1). At inference Pix2Seq relabels a predicted noise object with
its most likely real class and keeps it, ranked by that class's probability (it decodes to the
maximum length and needs the ranking for mAP); rollmatch's answers carry no confidence, so noise
objects are dropped before matching and scoring, and the answer ends where the model ends it.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence

from rollmatch.config.schema import NoiseObjectsConfig, RollmatchConfig
from rollmatch.detection.codec import ParseResult
from rollmatch.detection.objects import DetObject
from rollmatch.errors import DataError

# A noise box is at least this many frame units on each side: with coordinate tokens (1,000 bins over
# 0..1000) three units never fall into one bin, so the box stays valid (x2 > x1) after quantizing.
MIN_SIDE = 3
_CUT = 2.0  # truncated normals are cut at 2 standard deviations (tf.random.truncated_normal)


def noise_count(real_objects: int, cfg: NoiseObjectsConfig) -> int:
    """How many noise objects a record with ``real_objects`` GT objects gets."""
    if cfg.pad_to is not None:
        return max(0, cfg.pad_to - real_objects)
    if cfg.count is not None:
        return cfg.count
    if cfg.per_object is not None:
        return 0 if real_objects == 0 else max(1, math.floor(real_objects * cfg.per_object + 0.5))
    return 0


def noise_rng(seed: int, sample_id: str, step: int) -> random.Random:
    """The random stream of one record's noise at one optimizer step (string-seeded: stable across
    processes and Python runs, unlike ``hash``)."""
    return random.Random(f"rollmatch-noise:{seed}:{step}:{sample_id}")


def sample_noise_objects(
    gts: Sequence[DetObject],
    extent: tuple[int, int],
    cfg: NoiseObjectsConfig,
    rng: random.Random,
    *,
    sample_id: str = "",
) -> list[DetObject]:
    """``noise_count(len(gts))`` noise objects in the frame of ``gts`` (integers in ``[0, extent]``), each
    of a kind drawn by ``cfg.kinds``'s weights, labelled ``cfg.label``. A record without GT objects draws
    only ``random`` boxes (none when ``kinds.random`` is 0). A GT object labelled ``cfg.label`` is an
    error naming the record: its real objects would be scored as noise."""
    clash = [g for g in gts if g.label == cfg.label]
    if clash:
        raise DataError(
            f"record {sample_id!r} has {len(clash)} object(s) labelled {cfg.label!r}, the noise label "
            "(loss.noise_objects.label); set loss.noise_objects.label to a name no class uses"
        )
    width, height = extent
    if width < MIN_SIDE or height < MIN_SIDE:
        raise DataError(f"record {sample_id!r}: frame extent {extent} is too small for noise boxes")
    kinds = {"random": cfg.kinds.random}
    if gts:
        kinds.update(jittered=cfg.kinds.jittered, shifted=cfg.kinds.shifted)
    names = [name for name, weight in kinds.items() if weight > 0]
    if not names:
        return []
    weights = [kinds[name] for name in names]
    noise: list[DetObject] = []
    for _ in range(noise_count(len(gts), cfg)):
        kind = rng.choices(names, weights)[0]
        if kind == "random":
            box = _random_box(rng, cfg.random_max_side)
        else:
            source = _normalised(rng.choice(list(gts)).bbox, extent)
            box = _jittered(source, rng, cfg.jitter) if kind == "jittered" else _shifted(source, rng)
        noise.append(DetObject(label=cfg.label, bbox=_to_frame(box, extent)))
    return noise


def noise_label_of(cfg: RollmatchConfig) -> str | None:
    """The label whose objects evaluation drops: ``eval.noise_label``, else ``loss.noise_objects.label``
    when noise objects are enabled, else None."""
    if cfg.eval.noise_label is not None:
        return cfg.eval.noise_label
    return cfg.loss.noise_objects.label if cfg.loss.noise_objects.enabled else None


def drop_noise_objects(parse: ParseResult, label: str | None) -> ParseResult:
    """``parse`` without the objects labelled ``label`` (None: unchanged), counted in ``noise_objects``.

    A noise object is a valid element of the answer (the strict parser accepts it); it leaves
    ``objects`` and its element reads as not a prediction (``element_valid`` False), so ``objects``
    stays the valid elements' objects in order."""
    if label is None:
        return parse
    kept: list[DetObject] = []
    element_valid: list[bool] = []
    objects = iter(parse.objects)
    dropped = 0
    for valid in parse.element_valid:
        if not valid:
            element_valid.append(False)
            continue
        obj = next(objects)
        is_noise = obj.label == label
        dropped += is_noise
        element_valid.append(not is_noise)
        if not is_noise:
            kept.append(obj)
    rest = list(objects)  # objects of a ParseResult built without element_valid
    kept.extend(o for o in rest if o.label != label)
    dropped += sum(1 for o in rest if o.label == label)
    return dataclasses.replace(
        parse, objects=kept, element_valid=element_valid, noise_objects=parse.noise_objects + dropped
    )


# ---------------------------------------------------------------------------------------- helpers
Box = tuple[float, float, float, float]  # x1, y1, x2, y2 as fractions of the image side


def _truncated_normal(rng: random.Random, std: float) -> float:
    while True:
        value = rng.gauss(0.0, std)
        if abs(value) <= _CUT * std:
            return value


def _normalised(bbox: Sequence[float], extent: tuple[int, int]) -> Box:
    width, height = extent
    x1, y1, x2, y2 = bbox
    return (x1 / width, y1 / height, x2 / width, y2 / height)


def _jittered(box: Box, rng: random.Random, jitter: float) -> Box:
    """Each side moved by a truncated-normal fraction (std ``jitter``) of the box's width or height."""
    x1, y1, x2, y2 = box
    w, h = x2 - x1, y2 - y1
    return (
        x1 + w * _truncated_normal(rng, jitter),
        y1 + h * _truncated_normal(rng, jitter),
        x2 + w * _truncated_normal(rng, jitter),
        y2 + h * _truncated_normal(rng, jitter),
    )


def _shifted(box: Box, rng: random.Random) -> Box:
    """The box's size at a uniformly random centre."""
    x1, y1, x2, y2 = box
    return _centred(rng.random(), rng.random(), abs(x2 - x1), abs(y2 - y1))


def _random_box(rng: random.Random, max_side: float) -> Box:
    """A uniform centre; sides |truncated normal| of std ``max_side / 2``."""
    cx, cy = rng.random(), rng.random()
    h = abs(_truncated_normal(rng, max_side / 2))
    w = abs(_truncated_normal(rng, max_side / 2))
    return _centred(cx, cy, w, h)


def _centred(cx: float, cy: float, w: float, h: float) -> Box:
    return (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)


def _to_frame(box: Box, extent: tuple[int, int]) -> tuple[int, int, int, int]:
    """Clipped to the image (Pix2Seq's truncation), rounded to the frame, sides at least ``MIN_SIDE``."""
    width, height = extent
    x1, x2 = _side(box[0], box[2], width)
    y1, y2 = _side(box[1], box[3], height)
    return (x1, y1, x2, y2)


def _side(low: float, high: float, size: int) -> tuple[int, int]:
    a, b = sorted((min(max(low, 0.0), 1.0), min(max(high, 0.0), 1.0)))
    start, stop = round(a * size), round(b * size)
    if stop - start < MIN_SIDE:  # grow around the box, inside the image
        stop = min(size, start + MIN_SIDE)
        start = stop - MIN_SIDE
    return start, stop
