"""The request form of an encoded prompt: what every rollout backend receives.

Owns: :class:`RolloutRequest`. It lives in ``data`` (below ``rollout``) because prompt encoding
builds it (``EncodedPrompt.to_request``) and every rollout backend consumes it;
``rollmatch.rollout.types`` re-exports it beside the backend protocol. Leaves out: how prompts are
encoded (``data.prompts``) and what backends return (``rollout.types.Rollout``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image


@dataclass
class RolloutRequest:
    """One prompt to roll out, as the trainer encoded it.

    ``prompt_token_ids`` are authoritative: a backend must use them (or prove it produced the
    same ids) and return the ids it used. ``pixel_values``/``image_grid_thw``/``mm_token_type_ids``
    are the processor outputs for the same images, for backends that run the HF model directly.
    ``messages`` is the chat form of the prompt for engines that only accept messages.
    """

    sample_id: str
    prompt_token_ids: list[int]
    images: list[Image]
    messages: list[dict[str, Any]] = field(default_factory=list)
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    mm_token_type_ids: list[int] | None = None
