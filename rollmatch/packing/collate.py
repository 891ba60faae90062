"""Segments -> model inputs: one padding-free packed row, or a right-padded batch.

Owns: :func:`pack_row` (the exact packed layout), :func:`pad_batch` (the unpacked path, also the
reference the packed path is tested against) and :func:`model_inputs` (the forward kwargs).
Leaves out: which segments form a row (``packing.binpack`` / ``packing.carry``) and the loss
(``training.losses``).

Why a packed row is exact (transformers 5.x Qwen-VL models):

- ``position_ids`` has shape (4, 1, L). Row 0 is the text position restarting at 0 per segment;
  the model derives the packed-sequence attention mask from it (a new segment is where the
  position does not increase by one), so no token attends across a segment boundary. Rows 1-3 are
  each segment's own mRoPE positions, so every token sees the rotary angles of a separate forward.
- ``attention_mask`` is ``None`` and the forward must run with ``use_cache=False``: with a cache
  object present transformers skips packed-sequence detection and segments silently attend to
  each other. :func:`model_inputs` always sets it.
- Each segment's first token gets weight 0: its "prediction" would come from the previous
  segment's last logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rollmatch.errors import PackingError
from rollmatch.packing.segment import Segment

Batch = dict[str, torch.Tensor | None]

# Keys of a batch that are forward kwargs; the rest (weights, segment_lengths) feed the loss.
MODEL_INPUT_KEYS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "pixel_values",
    "image_grid_thw",
    "mm_token_type_ids",
)


def pack_row(segments: Sequence[Segment]) -> Batch:
    """One padding-free row of ``segments`` in order (see the module docstring for the layout).

    Returns ``input_ids``, ``weights``, ``mm_token_type_ids`` (1, L); ``position_ids`` (4, 1, L);
    ``pixel_values`` (concatenated in segment order) and ``image_grid_thw`` (stacked), or None
    without images; ``attention_mask`` None; ``segment_lengths`` (n,) long.
    """
    _require_segments(segments, "pack_row")
    weights = [s.weights.to(torch.float32).clone() for s in segments]
    for w in weights:
        w[0] = 0.0
    text_positions = torch.cat([torch.arange(s.length, dtype=torch.long) for s in segments])
    mrope_positions = torch.cat([s.position_ids for s in segments], dim=1)
    position_ids = torch.cat([text_positions[None], mrope_positions], dim=0)[:, None, :]
    pixel_values, image_grid_thw = _vision_inputs(segments)
    return {
        "input_ids": torch.cat([s.input_ids for s in segments])[None],
        "weights": torch.cat(weights)[None],
        "mm_token_type_ids": torch.cat([s.mm_token_type_ids for s in segments])[None],
        "position_ids": position_ids,
        "pixel_values": pixel_values,
        "image_grid_thw": image_grid_thw,
        "attention_mask": None,
        "segment_lengths": torch.tensor([s.length for s in segments], dtype=torch.long),
    }


def pad_batch(segments: Sequence[Segment], pad_token_id: int) -> Batch:
    """Right-padded (B, Lmax) batch, one segment per row, for the unpacked path.

    Padding has ``attention_mask`` 0, weight 0 and token type 0. No ``position_ids``: the model
    computes mRoPE itself from ``mm_token_type_ids`` and ``attention_mask``.
    """
    _require_segments(segments, "pad_batch")
    longest = max(s.length for s in segments)
    batch_size = len(segments)
    input_ids = torch.full((batch_size, longest), pad_token_id, dtype=torch.long)
    weights = torch.zeros((batch_size, longest), dtype=torch.float32)
    mm_types = torch.zeros((batch_size, longest), dtype=torch.long)
    attention_mask = torch.zeros((batch_size, longest), dtype=torch.long)
    for row, s in enumerate(segments):
        input_ids[row, : s.length] = s.input_ids
        weights[row, 1 : s.length] = s.weights[1:]
        mm_types[row, : s.length] = s.mm_token_type_ids
        attention_mask[row, : s.length] = 1
    pixel_values, image_grid_thw = _vision_inputs(segments)
    return {
        "input_ids": input_ids,
        "weights": weights,
        "mm_token_type_ids": mm_types,
        "attention_mask": attention_mask,
        "pixel_values": pixel_values,
        "image_grid_thw": image_grid_thw,
        "segment_lengths": torch.tensor([s.length for s in segments], dtype=torch.long),
    }


def model_inputs(batch: Batch) -> dict[str, Any]:
    """The kwargs for ``model(**...)``: the forward inputs of ``batch`` plus ``use_cache=False``."""
    kwargs: dict[str, Any] = {key: batch[key] for key in MODEL_INPUT_KEYS if key in batch}
    kwargs["use_cache"] = False
    return kwargs


def batch_to(batch: Batch, device: torch.device | str, dtype: torch.dtype | None = None) -> Batch:
    """Move every tensor of ``batch`` to ``device``; ``pixel_values`` also to ``dtype`` when given."""
    moved: Batch = {}
    for key, value in batch.items():
        if value is None:
            moved[key] = None
        elif key == "pixel_values" and dtype is not None:
            moved[key] = value.to(device=device, dtype=dtype)
        else:
            moved[key] = value.to(device)
    return moved


def _vision_inputs(segments: Sequence[Segment]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    with_images = [s for s in segments if s.pixel_values is not None]
    if not with_images:
        return None, None
    pixel_values = torch.cat([s.pixel_values for s in with_images if s.pixel_values is not None])
    grids = [s.image_grid_thw for s in with_images if s.image_grid_thw is not None]
    return pixel_values, torch.cat(grids, dim=0)


def _require_segments(segments: Sequence[Segment], caller: str) -> None:
    if not segments:
        raise PackingError(f"{caller} got no segments; a row or batch needs at least one")
