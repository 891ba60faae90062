"""Segments -> model inputs: one padding-free packed row, or a right-padded batch.

Owns: :func:`pack_row` (the exact packed layout), :func:`pad_batch` (the unpacked path, also the
reference the packed path is tested against), :func:`model_inputs` (the forward kwargs) and
:func:`enable_packed_attention` (the per-segment ``sdpa`` kernel for packed rows). Leaves out:
which segments form a row (``packing.binpack`` / ``packing.carry``) and the loss
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

Speed: transformers' ``sdpa`` path computes a packed row as one (L x L) masked attention, so its
cost grows with the *row* length squared (on CPU a 2048-token row of a tiny model then trains
slower than its samples one at a time). :func:`enable_packed_attention` switches a model's
``sdpa`` to a kernel that attends within each segment separately (what ``flash_attention_2``
does with packed position ids on GPU): the same numbers, at the cost of the segments' lengths
squared. It falls back to plain ``sdpa`` (with its mask) whenever a call is not a packed row, so
padded batches and generation are unaffected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from rollmatch.errors import PackingError
from rollmatch.models.wrappers import transformers_model
from rollmatch.packing.segment import Segment

Batch = dict[str, torch.Tensor | None]

# Registered with transformers' attention and mask interfaces by :func:`enable_packed_attention`.
PACKED_SDPA = "rollmatch_packed_sdpa"

# Keys of a batch that are forward kwargs; the rest (weights, unlikelihood_weights, segment_lengths and,
# for policy-gradient rows, advantages and behaviour_logprobs) feed the loss.
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
    without images; ``attention_mask`` None; ``segment_lengths`` (n,) long; and
    ``unlikelihood_weights`` (1, L) when any segment has them (first token 0, as for ``weights``).
    """
    _require_segments(segments, "pack_row")
    weights = [s.weights.to(torch.float32).clone() for s in segments]
    for w in weights:
        w[0] = 0.0
    text_positions = torch.cat([torch.arange(s.length, dtype=torch.long) for s in segments])
    mrope_positions = torch.cat([s.position_ids for s in segments], dim=1)
    position_ids = torch.cat([text_positions[None], mrope_positions], dim=0)[:, None, :]
    pixel_values, image_grid_thw = _vision_inputs(segments)
    row: Batch = {
        "input_ids": torch.cat([s.input_ids for s in segments])[None],
        "weights": torch.cat(weights)[None],
        "mm_token_type_ids": torch.cat([s.mm_token_type_ids for s in segments])[None],
        "position_ids": position_ids,
        "pixel_values": pixel_values,
        "image_grid_thw": image_grid_thw,
        "attention_mask": None,
        "segment_lengths": torch.tensor([s.length for s in segments], dtype=torch.long),
        **_policy_tensors(segments, lambda values: torch.cat(values)[None]),
    }
    if any(s.unlikelihood_weights is not None for s in segments):
        flags = [_unlikelihood_of(s) for s in segments]
        for u in flags:
            u[0] = 0.0
        row["unlikelihood_weights"] = torch.cat(flags)[None]
    return row


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

    def padded(values: list[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros((batch_size, longest), dtype=torch.float32)
        for row, value in enumerate(values):
            out[row, : value.shape[0]] = value
        return out

    batch: Batch = {
        "input_ids": input_ids,
        "weights": weights,
        "mm_token_type_ids": mm_types,
        "attention_mask": attention_mask,
        "pixel_values": pixel_values,
        "image_grid_thw": image_grid_thw,
        "segment_lengths": torch.tensor([s.length for s in segments], dtype=torch.long),
        **_policy_tensors(segments, padded),
    }
    if any(s.unlikelihood_weights is not None for s in segments):
        flags = torch.zeros((batch_size, longest), dtype=torch.float32)
        for row, s in enumerate(segments):
            flags[row, 1 : s.length] = _unlikelihood_of(s)[1:]
        batch["unlikelihood_weights"] = flags
    return batch


def _policy_tensors(
    segments: Sequence[Segment], join: Callable[[list[torch.Tensor]], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``advantages``, ``behaviour_logprobs``, ``behaviour_versions`` and ``sequence_ids`` of
    policy-gradient segments (all or none of a row)."""
    carrying = [s.advantages is not None and s.behaviour_logprobs is not None for s in segments]
    if not any(carrying):
        return {}
    if not all(carrying):
        raise PackingError(
            "a row mixes policy-gradient segments (advantages, behaviour log-probs) with teacher-forced ones: "
            f"{[s.sample_id for s, has in zip(segments, carrying, strict=True) if not has]} carry none"
        )
    return {
        "advantages": join([s.advantages for s in segments if s.advantages is not None]),
        "behaviour_logprobs": join(
            [s.behaviour_logprobs for s in segments if s.behaviour_logprobs is not None]
        ),
        # per token: the weight version that sampled it (-1: unknown) and its rollout's index in the row
        "behaviour_versions": join(
            [
                torch.full((s.length,), float(-1 if s.behaviour_version is None else s.behaviour_version))
                for s in segments
            ]
        ),
        "sequence_ids": join([torch.full((s.length,), float(i)) for i, s in enumerate(segments)]),
    }


def model_inputs(batch: Batch) -> dict[str, Any]:
    """The kwargs for ``model(**...)``: the forward inputs of ``batch`` plus ``use_cache=False``."""
    kwargs: dict[str, Any] = {key: batch[key] for key in MODEL_INPUT_KEYS if key in batch}
    kwargs["use_cache"] = False
    return kwargs


def enable_packed_attention(model: torch.nn.Module) -> str:
    """Give a ``sdpa`` model the per-segment attention kernel for packed rows; returns the kernel in force.

    Other implementations are left as they are: ``flash_attention_2`` already attends per segment
    and ``eager`` stays exact through the packed mask (only slower). Wrappers (DDP, PEFT) are fine.
    """
    base = transformers_model(model)
    current = str(base.config._attn_implementation)
    if current != "sdpa":
        return current
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    # The packed mask is still built (cheap next to attention): a call the kernel does not
    # recognise as a packed row falls back to masked sdpa and stays exact.
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)
    base.set_attn_implementation(PACKED_SDPA)
    return PACKED_SDPA


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: causal ``sdpa`` per segment of a packed row, else plain ``sdpa``.

    Shapes as in transformers: query (1, heads, L, d), key/value (1, kv_heads, L, d); returns
    (1, L, heads, d). Segments are where the text ``position_ids`` (1, L) restart.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = _packed_segment_bounds(query, key, position_ids, kwargs)
    if bounds is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, position_ids=position_ids, **kwargs
        )
    outputs = [
        sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, **kwargs)[0]
        for a, b in bounds
    ]
    return torch.cat(outputs, dim=1), None


def _packed_segment_bounds(
    query: torch.Tensor, key: torch.Tensor, position_ids: torch.Tensor | None, kwargs: dict[str, Any]
) -> list[tuple[int, int]] | None:
    """``[(start, end), ...]`` of the segments of a packed row, or None when this is not one."""
    length = query.shape[2]
    if (
        position_ids is None
        or position_ids.dim() != 2
        or position_ids.shape != (1, length)
        or query.shape[0] != 1
        or key.shape[2] != length  # decoding with a cache: not a packed training row
        or kwargs.get("sliding_window") is not None  # the window lives in the mask only
        or kwargs.get("cache") is not None
    ):
        return None
    restarts = (torch.nonzero(torch.diff(position_ids[0]) != 1).flatten() + 1).tolist()
    if not restarts:
        return None
    starts = [0, *restarts]
    return list(zip(starts, [*restarts, length], strict=True))


def _unlikelihood_of(segment: Segment) -> torch.Tensor:
    """The segment's unlikelihood weights (a copy), zeros when it has none."""
    if segment.unlikelihood_weights is None:
        return torch.zeros(segment.length, dtype=torch.float32)
    return segment.unlikelihood_weights.to(torch.float32).clone()


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
