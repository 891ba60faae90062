"""Boxes through each family's own frame and real processor: GT pixels -> target text -> parse -> pixels.

Images are sized so that the processor's resize (multiples of patch x merge within min/max pixels)
changes the aspect ratio: a ``pixels`` frame that scaled both sides alike would be caught.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from rollmatch.config.schema import DataConfig
from rollmatch.data.convert import from_voc, from_yolo, read_yolo_names
from rollmatch.data.prompts import EncodedPrompt, PromptEncoder
from rollmatch.data.records import Record, RecordObject
from rollmatch.detection.object_formats import build_codec
from rollmatch.detection.objects import from_frame
from rollmatch.evaluation import prediction_line

FAMILY_FRAMES = {"qwen2_vl": "norm1000", "qwen2_5_vl": "pixels", "qwen3_vl": "norm1000"}
SIZES = [(650, 417), (300, 97), (97, 300), (513, 511)]  # (W, H) of the synthetic images


def _record(folder: Path, size: tuple[int, int]) -> Record:
    width, height = size
    path = folder / f"{width}x{height}.png"
    Image.new("RGB", size, (90, 120, 150)).save(path)
    boxes = [
        (0.0, 0.0, width, height),  # the whole image: both clamps
        (width * 0.13, height * 0.71, width * 0.42, height * 0.99),
        (width - 9.5, 1.25, width - 0.5, 7.75),  # small, at the top right corner
    ]
    objects = tuple(RecordObject(f"obj{i}", box) for i, box in enumerate(boxes))
    return Record(id=path.stem, images=(str(path),), width=width, height=height, objects=objects)


def _round_trip(encoder: PromptEncoder, record: Record) -> tuple[EncodedPrompt, list[tuple[float, ...]]]:
    """GT -> target text (as training serializes it) -> token ids -> strict parse -> original pixels."""
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    encoded = encoder.encode(record)
    text = codec.serialize(encoder.gt_objects(record, encoded))
    ids = [*encoder.tokenizer.encode(text, add_special_tokens=False), encoder.eos_token_id]
    parsed = codec.parse(ids, extent=encoder.frame_extent(encoded), hit_max_tokens=False)
    assert parsed.invalid == {} and len(parsed.objects) == len(record.objects)
    # the frame is the image the model sees: the processor's resize, computed here independently
    processor = encoder.processor.image_processor
    factor = int(processor.patch_size) * int(processor.merge_size)
    low, high = encoder.pixel_bounds
    resized_h, resized_w = smart_resize(
        record.height, record.width, factor=factor, min_pixels=low, max_pixels=high
    )
    assert encoded.frame_sizes[0] == (resized_w, resized_h)
    extent_x, extent_y = (1000, 1000) if encoder.coord_frame == "norm1000" else (resized_w, resized_h)
    by_label = {o.label: o.bbox for o in parsed.objects}
    for source in record.objects:  # the serialized coordinates, scaled independently (clamped at the edges)
        x1, y1, x2, y2 = source.bbox
        expected = (x1 * extent_x / record.width, y1 * extent_y / record.height)
        expected += (x2 * extent_x / record.width, y2 * extent_y / record.height)
        for got, want in zip(by_label[source.label], expected, strict=True):
            assert abs(got - want) <= 1.0, (source, by_label[source.label], expected)
    line = prediction_line(record, encoded, encoder.coord_frame, parsed.objects, text, parsed)
    by_label = {o["label"]: tuple(o["bbox"]) for o in line["objects"]}
    return encoded, [by_label[o.label] for o in record.objects]


def _assert_within_one_resized_pixel(record: Record, encoded: EncodedPrompt, boxes: list) -> None:
    (width, height), (frame_w, frame_h) = record.image_size, encoded.frame_sizes[0]
    unit = (width / frame_w, height / frame_h, width / frame_w, height / frame_h)  # one resized pixel
    for source, back in zip(record.objects, boxes, strict=True):
        for got, want, tolerance in zip(back, source.bbox, unit, strict=True):
            assert abs(got - want) <= tolerance, (record.id, source, back, encoded.frame_sizes[0])


@pytest.mark.parametrize("family", sorted(FAMILY_FRAMES))
def test_gt_boxes_round_trip_in_the_family_frame(
    tiny_model_dirs: dict[str, Path], family: str, tmp_path: Path
) -> None:
    encoder = PromptEncoder.from_pretrained(tiny_model_dirs[family], DataConfig())  # auto
    assert encoder.coord_frame == FAMILY_FRAMES[family]
    aspect_changed = 0
    for size in SIZES:
        record = _record(tmp_path, size)
        encoded, boxes = _round_trip(encoder, record)
        frame_w, frame_h = encoded.frame_sizes[0]
        aspect_changed += abs(frame_w / frame_h - size[0] / size[1]) > 0.01
        if encoder.coord_frame == "pixels":
            assert encoder.frame_extent(encoded) == (frame_w, frame_h)
        _assert_within_one_resized_pixel(record, encoded, boxes)
    assert aspect_changed >= 3  # the resize distorts the aspect ratio of most test images


def test_real_photos_give_the_same_boxes_in_both_frames(
    tiny_model_dirs: dict[str, Path], real_data_dir: Path
) -> None:
    """The same predictions (each photo's GT boxes) evaluated in norm1000 and in pixels: the
    predictions JSONL boxes agree, each within one resized pixel of the source box."""
    aquarium = real_data_dir / "aquarium_combined_v2"
    records = [
        r for r in from_voc(real_data_dir / "raccoon") if r.id in ("raccoon-1", "raccoon-119", "raccoon-150")
    ]
    assert len(records) == 3
    records += [
        r for r in from_yolo(aquarium / "valid", read_yolo_names(aquarium / "data.yaml")) if r.objects
    ][:3]
    # each record's labels made unique, so boxes pair up by label
    records = [
        Record(
            r.id,
            r.images,
            r.width,
            r.height,
            tuple(RecordObject(f"{o.label}{i}", o.bbox) for i, o in enumerate(r.objects)),
        )
        for r in records
    ]
    model_dir = tiny_model_dirs["qwen2_5_vl"]
    encoders = {
        f: PromptEncoder.from_pretrained(model_dir, DataConfig(coord_frame=f)) for f in ("norm1000", "pixels")
    }
    for record in records:
        results = {frame: _round_trip(encoder, record) for frame, encoder in encoders.items()}
        encoded = results["pixels"][0]
        _assert_within_one_resized_pixel(record, encoded, results["norm1000"][1])
        _assert_within_one_resized_pixel(record, encoded, results["pixels"][1])
        (width, height), (frame_w, frame_h) = record.image_size, encoded.frame_sizes[0]
        for a, b in zip(results["norm1000"][1], results["pixels"][1], strict=True):
            for got, other, unit in zip(a, b, (width / frame_w, height / frame_h) * 2, strict=True):
                assert abs(got - other) <= unit
    assert from_frame((0, 0, 1000, 1000), (650, 417), "norm1000", (0, 0)) == (0.0, 0.0, 650.0, 417.0)
