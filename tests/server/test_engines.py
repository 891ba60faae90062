"""The HF server engine in process: request preparation equals the trainer's encoding; loads validate first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from rollmatch.errors import SyncError
from rollmatch.protocol import InferRequest, encode_image
from rollmatch.server.engines import HFServerEngine, pixel_inputs
from rollmatch.server.prompt_preparer import PreparedPrompt


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> HFServerEngine:
    return HFServerEngine(str(tiny_model_dir), max_model_len=2048)


def test_token_prompts_get_the_trainers_pixels_and_mm_token_types(
    engine: HFServerEngine, raccoon_requests: list[Any]
) -> None:
    for request in raccoon_requests:
        wire = InferRequest(
            prompt_token_ids=request.prompt_token_ids, images=[encode_image(i) for i in request.images]
        )
        prepared = engine.preparer.prepare(wire, 0)
        inputs = pixel_inputs(engine.preparer, prepared)
        assert inputs.prompt_token_ids == request.prompt_token_ids
        assert inputs.mm_token_type_ids == request.mm_token_type_ids
        assert torch.equal(inputs.image_grid_thw, request.image_grid_thw)
        assert torch.equal(inputs.pixel_values, request.pixel_values)


def test_a_wrong_image_is_caught_before_generation(
    engine: HFServerEngine, raccoon_requests: list[Any]
) -> None:
    small = Image.new("RGB", (56, 56))  # another size: another number of image tokens
    prompt = PreparedPrompt("mixed", raccoon_requests[0].prompt_token_ids, [small])
    expected = r"'mixed': the prompt holds \d+ <\|image_pad\|> tokens but the server's processor makes 4 "
    with pytest.raises(ValueError, match=expected):
        pixel_inputs(engine.preparer, prompt)


def test_weight_loads_are_validated_before_anything_changes(engine: HFServerEngine) -> None:
    name = "model.language_model.layers.0.self_attn.q_proj.weight"
    before = engine.model.state_dict()[name].clone()
    good = (name, torch.zeros_like(before))
    with pytest.raises(SyncError, match=r"'model\.bogus\.weight' is not a parameter of the served model"):
        engine.load_weights([good, ("model.bogus.weight", torch.zeros(2))])
    with pytest.raises(SyncError, match=r"received shape \(3,\), the served model has"):
        engine.load_weights([good, ("lm_head.weight", torch.zeros(3))])
    assert torch.equal(engine.model.state_dict()[name], before)
    engine.load_weights([good])
    assert torch.count_nonzero(engine.model.state_dict()[name]) == 0
    engine.load_weights([(name, before)])
