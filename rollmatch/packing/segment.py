"""One training sample as a packable segment: ids, loss weights, vision inputs and its own mRoPE.

Owns: :class:`Segment` and :func:`build_segment`, which joins an encoded prompt with a response
target (token ids + per-token loss weights), checks it against the packing limits and computes the
segment's multimodal rotary positions with the model's own ``get_rope_index`` on the segment
alone, which is what makes a packed row exact. Leaves out: joining segments into rows
(``packing.collate``), choosing which segments share a row (``packing.binpack``, ``packing.carry``)
and building the response target (``detection.targets``).

Weight convention: ``weights[t]`` is the loss weight of *predicting* token ``t`` (from the logits
at ``t - 1``); ``weights[0]`` is never used, prompt positions are 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rollmatch.errors import PackingError
from rollmatch.models.wrappers import transformers_model

_CAPACITY_KEY = "training.global_max_length"
# Values of ``mm_token_type_ids``: 0 text, 1 image, 2 video (transformers' Qwen-VL convention).
TEXT_TOKEN_TYPE, IMAGE_TOKEN_TYPE = 0, 1

RopeIndexFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Segment:
    """One sample ready to be packed; every per-token tensor has the segment's length ``L``."""

    sample_id: str
    input_ids: torch.Tensor  # (L,) long: prompt ids + response ids
    weights: torch.Tensor  # (L,) float32: loss weight for predicting token t (0 on the prompt)
    pixel_values: torch.Tensor | None  # (n_patches, patch_dim) of this segment's images, or None
    image_grid_thw: torch.Tensor | None  # (n_img, 3) long, or None
    mm_token_type_ids: torch.Tensor  # (L,) long: 0 text, 1 image
    position_ids: torch.Tensor  # (3, L) long: mRoPE (t, h, w) of this segment alone
    created_step: int = 0  # optimizer step whose rollouts produced it (staleness, logs)
    # (L,) float32 weight of the unlikelihood term -log(1 - p(token t)) (0 on the prompt), or None
    unlikelihood_weights: torch.Tensor | None = None
    # Policy-gradient segments (``loss.objective: grpo``) only, (L,) float32 like ``weights``: the advantage
    # of predicting token t and the log-prob the behaviour policy sampled it with (0 on the prompt).
    advantages: torch.Tensor | None = None
    behaviour_logprobs: torch.Tensor | None = None
    # Policy-gradient segments: the weight version that sampled the rollout (its lag when trained), and its
    # share of the step's loss normaliser when that is not its weight sum (GRPO ``loss_type``).
    behaviour_version: int | None = None
    normaliser: float | None = None

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def weight_sum(self) -> float:
        """The segment's share of the step's loss normaliser: its total loss weight (position 0 excluded,
        it is never predicted), or :attr:`normaliser` where set."""
        return float(self.weights[1:].sum()) if self.normaliser is None else self.normaliser

    @property
    def supervised_tokens(self) -> int:
        """Tokens with a non-zero loss weight (position 0 excluded, as in :attr:`weight_sum`)."""
        return int((self.weights[1:] > 0).sum())


def build_segment(
    model: nn.Module,
    *,
    sample_id: str,
    prompt_ids: Sequence[int] | torch.Tensor,
    response_ids: Sequence[int] | torch.Tensor,
    response_weights: Sequence[float] | torch.Tensor,
    pixel_values: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    prompt_mm_token_type_ids: Sequence[int] | torch.Tensor,
    max_length: int,
    created_step: int = 0,
    response_unlikelihood_weights: Sequence[float] | torch.Tensor | None = None,
    response_advantages: Sequence[float] | None = None,
    response_behaviour_logprobs: Sequence[float] | None = None,
    behaviour_version: int | None = None,
    normaliser: float | None = None,
) -> Segment:
    """Join prompt and response into a :class:`Segment` with its own mRoPE positions.

    ``model`` may be wrapped (DDP, PEFT); its ``get_rope_index`` is found on the Qwen-VL base
    model. Response tokens are text (type 0). ``response_unlikelihood_weights`` (one per response token,
    or None) flag the tokens of the false-positive unlikelihood term. Raises :class:`PackingError` naming ``sample_id``
    when the lengths disagree, the vision inputs do not match the image tokens, or the segment is
    longer than ``max_length`` (``training.global_max_length``).
    """
    prompt = _as_long(prompt_ids)
    response = _as_long(response_ids)
    response_w = torch.as_tensor(response_weights, dtype=torch.float32).reshape(-1)
    prompt_types = _as_long(prompt_mm_token_type_ids)
    _check_parts(sample_id, prompt, response, response_w, prompt_types)
    length = prompt.shape[0] + response.shape[0]
    if length > max_length:
        raise PackingError(
            f"sample {sample_id!r} has {length} tokens ({prompt.shape[0]} prompt + {response.shape[0]} "
            f"response), more than `{_CAPACITY_KEY}` = {max_length}: raise `{_CAPACITY_KEY}`, lower the "
            "image resolution (`data.max_pixels`) or `custom.extra.rollout_matching.max_new_tokens`"
        )
    grid = None if image_grid_thw is None else image_grid_thw.to(torch.long).reshape(-1, 3)
    _check_vision(sample_id, model, prompt_types, pixel_values, grid)

    input_ids = torch.cat([prompt, response])
    mm_types = torch.cat([prompt_types, torch.full_like(response, TEXT_TOKEN_TYPE)])
    weights = torch.cat([torch.zeros(prompt.shape[0], dtype=torch.float32), response_w])
    unlikelihood = None
    if response_unlikelihood_weights is not None and len(response_unlikelihood_weights):
        response_u = torch.as_tensor(response_unlikelihood_weights, dtype=torch.float32).reshape(-1)
        _check_parts(sample_id, prompt, response, response_u, prompt_types)
        unlikelihood = torch.cat([torch.zeros(prompt.shape[0], dtype=torch.float32), response_u])
    rope_index = find_rope_index(model)
    with torch.no_grad():
        positions, _ = rope_index(input_ids[None], mm_token_type_ids=mm_types[None], image_grid_thw=grid)
    return Segment(
        sample_id=sample_id,
        input_ids=input_ids,
        weights=weights,
        pixel_values=pixel_values,
        image_grid_thw=grid,
        mm_token_type_ids=mm_types,
        position_ids=positions[:, 0, :].to(torch.long).cpu(),
        created_step=created_step,
        unlikelihood_weights=unlikelihood,
        advantages=_response_values(sample_id, "advantages", response_advantages, prompt, response),
        behaviour_logprobs=_response_values(
            sample_id, "behaviour log-probs", response_behaviour_logprobs, prompt, response
        ),
        behaviour_version=behaviour_version,
        normaliser=normaliser,
    )


def _response_values(
    sample_id: str, what: str, values: Sequence[float] | None, prompt: torch.Tensor, response: torch.Tensor
) -> torch.Tensor | None:
    """Per-response-token values placed at the response positions of the segment (0 on the prompt)."""
    if values is None:
        return None
    tensor = torch.as_tensor(values, dtype=torch.float32).reshape(-1)
    if tensor.shape[0] != response.shape[0]:
        raise PackingError(
            f"sample {sample_id!r}: {tensor.shape[0]} {what} for {response.shape[0]} response tokens"
        )
    return torch.cat([torch.zeros(prompt.shape[0], dtype=torch.float32), tensor])


def find_rope_index(model: nn.Module) -> RopeIndexFn:
    """The ``get_rope_index`` of a Qwen-VL model, through DDP / PEFT / ForConditionalGeneration wrappers."""
    base = transformers_model(model)
    for candidate in (base, getattr(base, "model", None)):
        fn = getattr(candidate, "get_rope_index", None)
        if callable(fn):
            return fn
    raise PackingError(
        f"{type(model).__name__} has no `get_rope_index` (looked through DDP/PEFT wrappers and `.model`): "
        "training segments need the mRoPE of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL model; set `model.path` to one"
    )


def _as_long(values: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.long).reshape(-1).cpu()


def _check_parts(
    sample_id: str,
    prompt: torch.Tensor,
    response: torch.Tensor,
    response_weights: torch.Tensor,
    prompt_types: torch.Tensor,
) -> None:
    if prompt.shape[0] == 0:
        raise PackingError(
            f"sample {sample_id!r}: empty prompt; every segment starts with its encoded prompt"
        )
    if response.shape[0] != response_weights.shape[0]:
        raise PackingError(
            f"sample {sample_id!r}: {response.shape[0]} response ids but {response_weights.shape[0]} "
            "response weights; the target builder must give one weight per response token"
        )
    if prompt_types.shape[0] != prompt.shape[0]:
        raise PackingError(
            f"sample {sample_id!r}: {prompt.shape[0]} prompt ids but {prompt_types.shape[0]} "
            "mm_token_type_ids; pass the processor's `mm_token_type_ids` for exactly these prompt ids"
        )
    if bool((response_weights < 0).any()) or not bool(torch.isfinite(response_weights).all()):
        raise PackingError(f"sample {sample_id!r}: response weights must be finite and >= 0")


def _check_vision(
    sample_id: str,
    model: nn.Module,
    prompt_types: torch.Tensor,
    pixel_values: torch.Tensor | None,
    grid: torch.Tensor | None,
) -> None:
    n_image_tokens = int((prompt_types == IMAGE_TOKEN_TYPE).sum())
    if grid is None or pixel_values is None:
        if n_image_tokens or grid is not None or pixel_values is not None:
            raise PackingError(
                f"sample {sample_id!r}: {n_image_tokens} image tokens but pixel_values="
                f"{'None' if pixel_values is None else tuple(pixel_values.shape)}, image_grid_thw="
                f"{None if grid is None else grid.tolist()}; pass both vision inputs of the encoded prompt, or neither"
            )
        return
    merge = _spatial_merge_size(model)
    expected_tokens = int(grid.prod(dim=-1).sum()) // (merge * merge)
    expected_patches = int(grid.prod(dim=-1).sum())
    if n_image_tokens != expected_tokens or pixel_values.shape[0] != expected_patches:
        raise PackingError(
            f"sample {sample_id!r}: image_grid_thw {grid.tolist()} implies {expected_tokens} image tokens and "
            f"{expected_patches} patches, got {n_image_tokens} tokens and {pixel_values.shape[0]} patches; "
            "the prompt ids, mm_token_type_ids and vision inputs must come from one processor call"
        )


def _spatial_merge_size(model: nn.Module) -> int:
    # get_rope_index is bound to the Qwen-VL base model, whose config holds the vision settings.
    base_model = find_rope_index(model).__self__
    return int(base_model.config.vision_config.spatial_merge_size)
