"""Prompt-prefix token-id alignment: a backend must have used exactly the trainer's prompt ids.

A mismatch means the rollout was conditioned on a different prompt than the one the trainer will
teacher-force on (template, image-token expansion or tokenizer drift) — training on it would be
silently wrong, so it is an error naming the first mismatching position and both tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollmatch.errors import PromptAlignmentError
from rollmatch.rollout.types import Rollout


def first_mismatch(expected: Sequence[int], got: Sequence[int]) -> int | None:
    """Index of the first differing position (a length difference counts), or None if equal."""
    for i, (a, b) in enumerate(zip(expected, got, strict=False)):
        if a != b:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


def check_prompt_alignment(rollout: Rollout, expected_ids: Sequence[int], tokenizer: Any) -> None:
    """Raise :class:`PromptAlignmentError` unless the rollout's prompt ids equal ``expected_ids``."""
    pos = first_mismatch(expected_ids, rollout.prompt_token_ids)
    if pos is None:
        return

    def token_at(ids: Sequence[int]) -> str:
        return repr(tokenizer.convert_ids_to_tokens(int(ids[pos]))) if pos < len(ids) else "<end of prompt>"

    raise PromptAlignmentError(
        f"sample {rollout.sample_id!r}: backend {rollout.provenance.backend!r} used different prompt token "
        f"ids than the trainer encoded, first mismatch at position {pos}: trainer {token_at(expected_ids)} "
        f"vs backend {token_at(rollout.prompt_token_ids)} (lengths {len(expected_ids)} vs "
        f"{len(rollout.prompt_token_ids)}). The backend must receive the trainer's prompt token ids; check "
        "that the server/engine loads the same tokenizer, chat template and processor as the trainer."
    )
