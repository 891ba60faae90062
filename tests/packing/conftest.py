"""Packing fixtures: tiny Qwen-VL models of every family and segments of real photographs.

Segments are built the way the trainer builds them: the processor encodes a chat prompt with a real
image (raccoon / aquarium photographs of different sizes, so image grids differ within a row), the
response is the sample's real boxes serialized as a ``qwen_json`` list plus ``<|im_end|>``,
tokenized with the model's tokenizer, with a mix of loss weights (a zero-weight prefix, 1 and 0.5).
"""

from __future__ import annotations

import copy
import json
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from rollmatch.packing.segment import Segment, build_segment

# The shared real datasets live beside the repository (never copied into it).
DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
RACCOON = DATA / "raccoon"
AQUARIUM = DATA / "aquarium_combined_v2" / "valid"
AQUARIUM_NAMES = ["fish", "jellyfish", "penguin", "puffin", "shark", "starfish", "stingray"]
# Photographs of different sizes (-> different image_grid_thw) and object counts.
SAMPLES = ("raccoon-1", "raccoon-10", "raccoon-100", "aquarium:0")


def _raccoon(name: str) -> tuple[Image.Image, list[tuple[str, list[float]]]]:
    root = ET.parse(RACCOON / "annotations" / f"{name}.xml").getroot()
    objects = []
    for obj in root.iter("object"):
        box = obj.find("bndbox")
        assert box is not None
        coords = [float(box.findtext(k, "0")) for k in ("xmin", "ymin", "xmax", "ymax")]
        objects.append((obj.findtext("name", "object"), coords))
    return Image.open(RACCOON / "images" / f"{name}.jpg").convert("RGB"), objects


def _aquarium(index: int) -> tuple[Image.Image, list[tuple[str, list[float]]]]:
    label_file = sorted((AQUARIUM / "labels").glob("*.txt"))[index]
    image = Image.open(AQUARIUM / "images" / f"{label_file.stem}.jpg").convert("RGB")
    width, height = image.size
    objects = []
    for line in label_file.read_text().splitlines():
        cls, cx, cy, w, h = line.split()
        x, y, bw, bh = float(cx) * width, float(cy) * height, float(w) * width, float(h) * height
        objects.append((AQUARIUM_NAMES[int(cls)], [x - bw / 2, y - bh / 2, x + bw / 2, y + bh / 2]))
    return image, objects


def load_sample(key: str) -> tuple[Image.Image, str]:
    """(RGB image, qwen_json response text in norm1000 coordinates) of a real annotated photograph."""
    image, objects = _aquarium(int(key.split(":")[1])) if key.startswith("aquarium:") else _raccoon(key)
    width, height = image.size
    items = []
    for label, (x1, y1, x2, y2) in objects:
        box = [
            round(x1 / width * 1000),
            round(y1 / height * 1000),
            round(x2 / width * 1000),
            round(y2 / height * 1000),
        ]
        items.append(json.dumps({"bbox_2d": box, "label": label}))
    return image, "[" + ", ".join(items) + "]"


def response_weights(n: int) -> list[float]:
    """A zero-weight rollout prefix, then alternating 1.0 / 0.5 (structure vs description-like weights)."""
    return [0.0 if i < 4 else (1.0 if i % 3 else 0.5) for i in range(n)]


def encode_segment(
    model: Any, processor: Any, key: str, max_length: int = 4096, created_step: int = 0
) -> Segment:
    image, response = load_sample(key)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Detect every object."}]}
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc = processor(text=[text], images=[image], return_tensors="pt", return_mm_token_type_ids=True)
    response_ids = processor.tokenizer(response + "<|im_end|>", add_special_tokens=False).input_ids
    return build_segment(
        model,
        sample_id=key,
        prompt_ids=enc.input_ids[0],
        response_ids=response_ids,
        response_weights=response_weights(len(response_ids)),
        pixel_values=enc.pixel_values,
        image_grid_thw=enc.image_grid_thw,
        prompt_mm_token_type_ids=enc.mm_token_type_ids[0],
        max_length=max_length,
        created_step=created_step,
    )


@pytest.fixture(scope="session")
def real_data() -> None:
    if not RACCOON.is_dir() or not AQUARIUM.is_dir():
        pytest.skip(f"the real datasets are not at {DATA.resolve()} (raccoon/, aquarium_combined_v2/)")


def make_text_segment(sample_id: str, length: int, created_step: int = 0) -> Segment:
    """A text-only segment (the buffer only looks at lengths; tensors ride along)."""
    ids = torch.arange(length, dtype=torch.long) + 7
    return Segment(
        sample_id=sample_id,
        input_ids=ids,
        weights=torch.linspace(0.0, 1.0, length),
        pixel_values=None,
        image_grid_thw=None,
        mm_token_type_ids=torch.zeros(length, dtype=torch.long),
        position_ids=torch.arange(length).expand(3, -1).clone(),
        created_step=created_step,
    )


@pytest.fixture(scope="session")
def text_segment() -> Callable[..., Segment]:
    """:func:`make_text_segment` (sample_id, length, created_step=0): no model needed."""
    return make_text_segment


@pytest.fixture(scope="session")
def family_models(tiny_model_dirs: dict[str, Path]) -> Callable[[str], tuple[Any, Any]]:
    """``load(family) -> (model, processor)``: float32, sdpa, eval; loaded once per family.

    Shared: a test that trains must work on a ``copy.deepcopy`` of the model.
    """
    from transformers import AutoModelForImageTextToText, AutoProcessor

    cache: dict[str, tuple[Any, Any]] = {}

    def load(family: str) -> tuple[Any, Any]:
        if family not in cache:
            model = AutoModelForImageTextToText.from_pretrained(
                tiny_model_dirs[family], dtype=torch.float32, attn_implementation="sdpa"
            )
            cache[family] = (model.eval(), AutoProcessor.from_pretrained(tiny_model_dirs[family]))
        return cache[family]

    return load


@pytest.fixture(scope="session")
def family_segments(
    family_models: Callable[[str], tuple[Any, Any]], real_data: None
) -> Callable[[str], list[Segment]]:
    """``segments(family)``: the :data:`SAMPLES` as segments of that family's model (cached)."""
    cache: dict[str, list[Segment]] = {}

    def segments(family: str) -> list[Segment]:
        if family not in cache:
            model, processor = family_models(family)
            cache[family] = [encode_segment(model, processor, key) for key in SAMPLES]
        return cache[family]

    return segments


@pytest.fixture(scope="session")
def segment_encoder(real_data: None) -> Callable[..., Segment]:
    """:func:`encode_segment` (model, processor, sample key, max_length=..., created_step=...)."""
    return encode_segment


@pytest.fixture(scope="session")
def sample_loader(real_data: None) -> Callable[[str], tuple[Image.Image, str]]:
    """:func:`load_sample`: sample key -> (RGB image, qwen_json response text)."""
    return load_sample


@pytest.fixture(scope="session")
def kernel_models(family_models: Callable[[str], tuple[Any, Any]]) -> Callable[[str, str], Any]:
    """``model(family, kernel)``: kernel ``sdpa`` is the shared model, ``packed`` a copy running
    :func:`~rollmatch.packing.collate.enable_packed_attention` (cached)."""
    from rollmatch.packing.collate import PACKED_SDPA, enable_packed_attention

    cache: dict[str, Any] = {}

    def load(family: str, kernel: str) -> Any:
        base, _ = family_models(family)
        if kernel == "sdpa":
            return base
        if family not in cache:
            cache[family] = copy.deepcopy(base)
            assert enable_packed_attention(cache[family]) == PACKED_SDPA
        return cache[family]

    return load
