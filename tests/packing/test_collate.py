"""Row and batch layouts: what the model receives for packed and padded training."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from rollmatch.errors import PackingError
from rollmatch.packing.collate import (
    PACKED_SDPA,
    enable_packed_attention,
    model_inputs,
    pack_row,
    packed_sdpa_attention,
    pad_batch,
)
from rollmatch.packing.segment import Segment


def test_pack_row_layout(text_segment: Callable[..., Segment]) -> None:
    a, b = text_segment("a", 4), text_segment("b", 3)
    a.weights = torch.ones(4)
    b.weights = torch.full((3,), 2.0)
    b.position_ids = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]])
    row = pack_row([a, b])
    assert torch.equal(row["input_ids"], torch.cat([a.input_ids, b.input_ids])[None])
    assert row["weights"].tolist() == [[0.0, 1.0, 1.0, 1.0, 0.0, 2.0, 2.0]]
    assert float(a.weights[0]) == 1.0, "pack_row must not modify the segment"
    assert row["position_ids"].shape == (4, 1, 7)
    assert row["position_ids"][0, 0].tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert row["position_ids"][1:, 0, 4:].tolist() == b.position_ids.tolist()
    assert row["attention_mask"] is None and row["pixel_values"] is None and row["image_grid_thw"] is None
    assert row["segment_lengths"].tolist() == [4, 3]


def test_pack_row_concatenates_vision_inputs_in_order(
    family_segments: Callable[[str], list[Segment]], text_segment: Callable[..., Segment]
) -> None:
    images = family_segments("qwen2_5_vl")[:3]
    row = pack_row([images[0], text_segment("text-only", 5), images[1], images[2]])
    assert torch.equal(row["pixel_values"], torch.cat([s.pixel_values for s in images]))
    assert torch.equal(row["image_grid_thw"], torch.cat([s.image_grid_thw for s in images]))
    assert row["mm_token_type_ids"].shape == row["input_ids"].shape
    assert int(row["mm_token_type_ids"].sum()) == sum(int(s.mm_token_type_ids.sum()) for s in images)


def test_pad_batch_layout(text_segment: Callable[..., Segment]) -> None:
    a, b = text_segment("a", 4), text_segment("b", 2)
    batch = pad_batch([a, b], pad_token_id=99)
    assert batch["input_ids"][1].tolist() == [*b.input_ids.tolist(), 99, 99]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["weights"][1, 2:].tolist() == [0.0, 0.0] and float(batch["weights"][0, 0]) == 0.0
    assert torch.equal(batch["weights"][0, 1:], a.weights[1:])
    assert "position_ids" not in batch


def test_unlikelihood_weights_ride_along_only_when_a_segment_has_them(
    text_segment: Callable[..., Segment],
) -> None:
    a, b = text_segment("a", 4), text_segment("b", 3)
    assert "unlikelihood_weights" not in pack_row([a, b]) and "unlikelihood_weights" not in pad_batch(
        [a, b], 0
    )
    b.unlikelihood_weights = torch.tensor([3.0, 0.0, 0.5])
    row = pack_row([a, b])
    assert row["unlikelihood_weights"].tolist() == [[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5]]  # first token 0
    assert float(b.unlikelihood_weights[0]) == 3.0, "pack_row must not modify the segment"
    batch = pad_batch([b, a], pad_token_id=0)
    assert batch["unlikelihood_weights"].tolist() == [[0.0, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]]
    assert "unlikelihood_weights" not in model_inputs(row)


def test_model_inputs_and_empty_input(text_segment: Callable[..., Segment]) -> None:
    row = pack_row([text_segment("a", 3)])
    kwargs = model_inputs(row)
    assert kwargs["use_cache"] is False
    assert set(kwargs) == {
        "input_ids",
        "attention_mask",
        "position_ids",
        "pixel_values",
        "image_grid_thw",
        "mm_token_type_ids",
        "use_cache",
    }
    for fn in (pack_row, lambda s: pad_batch(s, 0)):
        with pytest.raises(PackingError, match="no segments"):
            fn([])


class AttentionStandIn(torch.nn.Module):
    """The two attributes transformers' sdpa reads from an attention module (causal, grouped KV)."""

    is_causal = True
    num_key_value_groups = 2


def test_packed_kernel_equals_block_diagonal_masked_sdpa() -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 3, 7]
    length = sum(lengths)
    query = torch.randn(1, 4, length, 8, generator=gen)
    key, value = torch.randn(1, 2, length, 8, generator=gen), torch.randn(1, 2, length, 8, generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    segment = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    mask = (causal & (segment[:, None] == segment[None, :]))[None, None]

    packed, _ = packed_sdpa_attention(AttentionStandIn(), query, key, value, None, position_ids=positions)
    reference = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(2, dim=1), value.repeat_interleave(2, dim=1), attn_mask=mask
    ).transpose(1, 2)
    torch.testing.assert_close(packed, reference, rtol=1e-5, atol=1e-6)

    # Not a packed row (no restart): plain causal sdpa over the whole sequence, i.e. a leak here.
    whole, _ = packed_sdpa_attention(
        AttentionStandIn(), query, key, value, None, position_ids=torch.arange(length)[None]
    )
    assert not torch.allclose(whole, reference, atol=1e-3)
    torch.testing.assert_close(whole[:, :5], reference[:, :5], rtol=1e-5, atol=1e-6)  # first segment agrees


def test_enable_packed_attention_is_idempotent(kernel_models: Callable[[str, str], Any]) -> None:
    model = kernel_models("qwen2_vl", "packed")
    assert model.config._attn_implementation == PACKED_SDPA
    assert model.config.vision_config._attn_implementation == PACKED_SDPA
    assert enable_packed_attention(model) == PACKED_SDPA
