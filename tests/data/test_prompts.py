"""Prompt encoding on real raccoon photographs with the tiny Qwen2.5-VL / Qwen3-VL processors."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from PIL import Image
from resolved_runs import resolve_for

from rollmatch.config.schema import DataConfig, RollmatchConfig
from rollmatch.data.prompts import EncodedPrompt, PromptEncoder, load_rgb, set_pixel_bounds
from rollmatch.data.records import Record, RecordObject
from rollmatch.detection.objects import from_frame
from rollmatch.errors import ConfigError, DataError
from rollmatch.rollout.types import RolloutRequest


@pytest.fixture(scope="module")
def raccoon(real_data_dir: Path) -> Callable[[int], Record]:
    """``raccoon(n)``: the record of raccoon-<n> read inline from its VOC xml."""
    return lambda number: raccoon_record(real_data_dir / "raccoon", number)


def raccoon_record(folder: Path, number: int) -> Record:
    """The VOC annotation of raccoon-<number> (VOC pixel corners used as xyxy)."""
    root = ET.parse(folder / "annotations" / f"raccoon-{number}.xml").getroot()
    objects = tuple(
        RecordObject(
            obj.findtext("name", ""),
            tuple(float(obj.findtext(f"bndbox/{key}", "")) for key in ("xmin", "ymin", "xmax", "ymax")),
        )
        for obj in root.iter("object")
    )
    return Record(
        id=f"raccoon-{number}",
        images=(str(folder / "images" / f"raccoon-{number}.jpg"),),
        width=int(root.findtext("size/width", "")),
        height=int(root.findtext("size/height", "")),
        objects=objects,
    )


@pytest.fixture(scope="module")
def encoder(tiny_model_dir: Path) -> PromptEncoder:
    return PromptEncoder.from_pretrained(tiny_model_dir, DataConfig())


def _check_consistent(encoder: PromptEncoder, encoded: EncodedPrompt) -> None:
    ids = encoded.input_ids
    assert len(encoded.mm_token_type_ids) == len(ids)
    image_positions = [i for i, t in enumerate(ids) if t == encoder.image_token_id]
    assert [i for i, t in enumerate(encoded.mm_token_type_ids) if t == 1] == image_positions
    merged = int(encoded.image_grid_thw.prod(dim=1).sum()) // encoder.merge_size**2
    assert len(image_positions) == merged
    assert encoded.pixel_values.shape[0] == int(encoded.image_grid_thw.prod(dim=1).sum())
    for (w, h), (_, grid_h, grid_w) in zip(encoded.frame_sizes, encoded.image_grid_thw.tolist(), strict=True):
        assert (w, h) == (grid_w * encoder.patch_size, grid_h * encoder.patch_size)
    tail = encoder.tokenizer.decode(ids[-10:])
    assert tail.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert encoder.tokenizer.decode(ids).count("<|vision_start|>") == len(encoded.images)


@pytest.mark.parametrize("number", [1, 150])  # raccoon-150 is a grayscale JPEG
def test_encode_real_images(encoder: PromptEncoder, number: int, raccoon: Callable[[int], Record]) -> None:
    record = raccoon(number)
    encoded = encoder.encode(record)
    assert encoded.sample_id == record.id
    assert encoded.image_sizes == [record.image_size]
    assert all(image.mode == "RGB" for image in encoded.images)
    assert encoded.messages[0]["content"][0] == {"type": "image", "image": record.images[0]}
    assert encoded.messages[0]["content"][-1] == {"type": "text", "text": DataConfig().prompt}
    _check_consistent(encoder, encoded)


def test_grayscale_source_is_loaded_as_rgb(real_data_dir: Path) -> None:
    path = real_data_dir / "raccoon" / "images" / "raccoon-150.jpg"
    with Image.open(path) as raw:
        assert raw.mode == "L"
    image = load_rgb(path)
    assert image.mode == "RGB" and image.size == (275, 183)


def test_encoding_drives_hf_generate(
    encoder: PromptEncoder, loaded_tiny, raccoon: Callable[[int], Record]
) -> None:
    model, _ = loaded_tiny
    encoded = encoder.encode(raccoon(150))
    with torch.no_grad():
        out = model.generate(**encoded.model_inputs(), max_new_tokens=3, do_sample=False)
    assert out[0, : len(encoded.input_ids)].tolist() == encoded.input_ids
    assert out.shape[1] > len(encoded.input_ids)


def test_to_request_carries_the_encoding(encoder: PromptEncoder, raccoon: Callable[[int], Record]) -> None:
    encoded = encoder.encode(raccoon(1))
    request = encoded.to_request()
    assert isinstance(request, RolloutRequest)
    assert request.sample_id == "raccoon-1" and request.prompt_token_ids == encoded.input_ids
    assert request.prompt_token_ids is not encoded.input_ids
    assert request.images == encoded.images and request.messages == encoded.messages
    assert torch.equal(request.image_grid_thw, encoded.image_grid_thw)
    assert request.mm_token_type_ids == encoded.mm_token_type_ids


@pytest.mark.parametrize("frame", ["norm1000", "pixels"])
@pytest.mark.parametrize("number", [1, 150, 119])  # 119 has three raccoons
def test_gt_objects_round_trip(
    tiny_model_dir: Path, frame: str, number: int, raccoon: Callable[[int], Record]
) -> None:
    encoder = PromptEncoder.from_pretrained(tiny_model_dir, DataConfig(coord_frame=frame))
    record = raccoon(number)
    encoded = encoder.encode(record)
    objects = encoder.gt_objects(record, encoded)
    max_x, max_y = encoder.frame_extent(encoded)
    assert (max_x, max_y) == ((1000, 1000) if frame == "norm1000" else encoded.frame_sizes[0])
    assert len(objects) == len(record.objects)
    assert [o.bbox[1] for o in objects] == sorted(o.bbox[1] for o in objects)
    width, height = record.image_size
    unit_x, unit_y = width / max_x, height / max_y  # one frame unit, in original pixels
    matched_sources = set()
    for obj in objects:
        assert obj.label == "raccoon" and all(isinstance(v, int) for v in obj.bbox)
        assert 0 <= obj.bbox[0] < obj.bbox[2] <= max_x and 0 <= obj.bbox[1] < obj.bbox[3] <= max_y
        back = from_frame(obj.bbox, record.image_size, frame, encoded.frame_sizes[0])
        source = min(
            record.objects, key=lambda o, b=back: sum(abs(x - y) for x, y in zip(o.bbox, b, strict=True))
        )
        matched_sources.add(source.bbox)
        for got, want, unit in zip(back, source.bbox, (unit_x, unit_y, unit_x, unit_y), strict=True):
            assert abs(got - want) <= unit, (obj, source)
    assert len(matched_sources) == len(record.objects)  # every source box comes back exactly once


def test_two_images_in_one_record(encoder: PromptEncoder, raccoon: Callable[[int], Record]) -> None:
    first, second = raccoon(1), raccoon(150)
    record = Record(id="pair", images=first.images + second.images, width=first.width, height=first.height)
    encoded = encoder.encode(record)
    assert encoded.image_grid_thw.shape == (2, 3)
    assert encoded.image_sizes == [first.image_size, second.image_size]
    _check_consistent(encoder, encoded)


def test_pixel_bounds_from_data_config(tiny_model_dir: Path, raccoon: Callable[[int], Record]) -> None:
    small = PromptEncoder.from_pretrained(tiny_model_dir, DataConfig(max_pixels=28 * 28 * 16))
    assert small.pixel_bounds[1] == 28 * 28 * 16
    encoded = small.encode(raccoon(1))
    width, height = encoded.frame_sizes[0]
    assert width * height <= 28 * 28 * 16 and width % 28 == 0 and height % 28 == 0
    with pytest.raises(ConfigError, match=r"data\.min_pixels"):  # the config's rule, at the door to a run
        resolve_for(RollmatchConfig(data=DataConfig(min_pixels=10_000, max_pixels=5_000)))
    with pytest.raises(ConfigError, match=r"data\.min_pixels"):  # above the checkpoint's saved maximum
        PromptEncoder.from_pretrained(tiny_model_dir, DataConfig(min_pixels=10**9))
    with pytest.raises(ConfigError, match=r"data\.max_pixels"):
        set_pixel_bounds(small.processor, 16, 100)


def test_bad_records_fail_with_one_clear_error(
    encoder: PromptEncoder, tmp_path: Path, raccoon: Callable[[int], Record]
) -> None:
    missing = Record(id="ghost", images=(str(tmp_path / "nope.jpg"),), width=10, height=10)
    with pytest.raises(DataError, match=r"nope\.jpg"):
        encoder.encode(missing)
    not_an_image = tmp_path / "notes.jpg"
    not_an_image.write_text("hello")
    with pytest.raises(DataError, match=r"notes\.jpg"):
        encoder.encode(Record(id="text", images=(str(not_an_image),), width=10, height=10))
    with pytest.raises(DataError, match=r"'empty'.*no image"):
        encoder.encode(Record(id="empty", images=(), width=10, height=10))
    real = raccoon(1)
    wrong_size = Record(id=real.id, images=real.images, width=100, height=100, objects=real.objects)
    encoded = encoder.encode(wrong_size)
    with pytest.raises(DataError, match=r"raccoon-1.*\(100, 100\).*\(650, 417\)"):
        encoder.gt_objects(wrong_size, encoded)


def test_qwen3_family_uses_patch_16(
    tiny_model_dirs: dict[str, Path], raccoon: Callable[[int], Record]
) -> None:
    encoder = PromptEncoder.from_pretrained(tiny_model_dirs["qwen3_vl"], DataConfig(coord_frame="pixels"))
    assert encoder.patch_size == 16
    record = raccoon(150)
    encoded = encoder.encode(record)
    _check_consistent(encoder, encoded)
    assert all(v % 32 == 0 for v in encoded.frame_sizes[0])
    assert encoder.gt_objects(record, encoded)[0].label == "raccoon"
