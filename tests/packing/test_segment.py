"""Segments: prompt + response joined with per-segment mRoPE; bad inputs fail by sample id."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rollmatch.errors import PackingError
from rollmatch.packing.segment import Segment, build_segment, find_rope_index


@pytest.fixture
def qwen25(family_models: Callable[[str], tuple[Any, Any]], real_data: None) -> tuple[Any, Any]:
    return family_models("qwen2_5_vl")


def test_segment_layout(qwen25: tuple[Any, Any], family_segments: Callable[[str], list[Segment]]) -> None:
    _, processor = qwen25
    segment = family_segments("qwen2_5_vl")[0]
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    length = segment.length
    assert segment.position_ids.shape == (3, length) and segment.position_ids.dtype == torch.long
    assert torch.equal(segment.mm_token_type_ids == 1, segment.input_ids == image_token)
    first_response = (
        int(torch.nonzero(segment.weights).min()) - 4
    )  # response_weights: 4 zero-weight tokens first
    assert int(segment.mm_token_type_ids[first_response:].sum()) == 0
    assert float(segment.weights[:first_response].abs().sum()) == 0.0
    # Text after the image continues one position past the largest position used so far, on all three axes.
    response_positions = segment.position_ids[:, first_response:]
    start = int(segment.position_ids[:, :first_response].max()) + 1
    expected = torch.arange(start, start + length - first_response).expand(3, -1)
    assert torch.equal(response_positions, expected)
    # The image grid (t, h, w) shows up in the vision positions: h and w each take (grid / merge) values.
    _, grid_h, grid_w = segment.image_grid_thw[0].tolist()
    vision = segment.position_ids[:, segment.mm_token_type_ids == 1]
    assert len(vision[1].unique()) == grid_h // 2 and len(vision[2].unique()) == grid_w // 2
    assert segment.weight_sum == pytest.approx(float(segment.weights[1:].sum()))


def test_oversized_segment_names_sample_and_key(
    qwen25: tuple[Any, Any], segment_encoder: Callable[..., Segment]
) -> None:
    model, processor = qwen25
    with pytest.raises(PackingError, match=r"'raccoon-10' has \d+ tokens.*`training.global_max_length` = 50"):
        segment_encoder(model, processor, "raccoon-10", max_length=50)


def _prompt(processor: Any, sample_loader: Callable[[str], tuple[Any, str]]) -> Any:
    image, _ = sample_loader("raccoon-1")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Detect."}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(text=[text], images=[image], return_tensors="pt", return_mm_token_type_ids=True)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"response_weights": [1.0, 1.0]}, "3 response ids but 2 response weights"),
        ({"response_weights": [1.0, -1.0, 1.0]}, "finite and >= 0"),
        ({"pixel_values": None}, r"image tokens but pixel_values=None"),
        ({"image_grid_thw": torch.tensor([[1, 8, 8]])}, r"implies 16 image tokens"),
        ({"prompt_mm_token_type_ids": [0, 1]}, "mm_token_type_ids"),
    ],
)
def test_inconsistent_inputs_fail_by_sample(
    qwen25: tuple[Any, Any],
    sample_loader: Callable[[str], tuple[Any, str]],
    change: dict[str, Any],
    match: str,
) -> None:
    model, processor = qwen25
    enc = _prompt(processor, sample_loader)
    kwargs: dict[str, Any] = {
        "sample_id": "bad-1",
        "prompt_ids": enc.input_ids[0],
        "response_ids": [11, 12, 13],
        "response_weights": [1.0, 1.0, 1.0],
        "pixel_values": enc.pixel_values,
        "image_grid_thw": enc.image_grid_thw,
        "prompt_mm_token_type_ids": enc.mm_token_type_ids[0],
        "max_length": 4096,
    }
    with pytest.raises(PackingError, match=match) as info:
        build_segment(model, **{**kwargs, **change})
    assert "'bad-1'" in str(info.value)


@pytest.fixture
def single_rank_group(tmp_path: Path) -> Iterator[None]:
    assert not dist.is_initialized(), "another test left a default process group behind"
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_rope_index_found_through_ddp_and_peft(
    tiny_model_dirs: dict[str, Path], single_rank_group: None
) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dirs["qwen3_vl"], dtype=torch.float32)
    expected = model.model.get_rope_index
    assert find_rope_index(model) == expected
    assert find_rope_index(model.model) == expected
    assert find_rope_index(DistributedDataParallel(model)) == expected
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    assert find_rope_index(peft_model) == expected
    assert find_rope_index(DistributedDataParallel(peft_model)) == expected
    with pytest.raises(PackingError, match=r"Linear has no `get_rope_index`.*set `model.path`"):
        find_rope_index(torch.nn.Linear(2, 2))
