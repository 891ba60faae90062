"""Prompt-prefix alignment: a backend that used other prompt ids is an error naming the position."""

from __future__ import annotations

import pytest

from rollmatch.errors import PromptAlignmentError
from rollmatch.rollout.alignment import check_prompt_alignment, first_mismatch
from rollmatch.rollout.types import Decoding, Rollout, RolloutProvenance


def _rollout(prompt_ids: list[int]) -> Rollout:
    return Rollout(
        sample_id="s0",
        prompt_token_ids=prompt_ids,
        response_token_ids=[],
        text="",
        finish_reason="stop",
        weight_version=0,
        provenance=RolloutProvenance(backend="fake_server", seed=0, decoding=Decoding()),
    )


def test_first_mismatch():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 9, 3]) == 1
    assert first_mismatch([1, 2, 3], [1, 2]) == 2
    assert first_mismatch([1, 2], [1, 2, 3]) == 2


def test_forced_mismatch_names_position_and_tokens(tiny_tokenizer):
    ids = tiny_tokenizer.encode("<|im_start|>user\nfind the boxes<|im_end|>", add_special_tokens=False)
    other = list(ids)
    other[3] = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    check_prompt_alignment(_rollout(list(ids)), ids, tiny_tokenizer)  # equal: no error
    with pytest.raises(PromptAlignmentError) as err:
        check_prompt_alignment(_rollout(other), ids, tiny_tokenizer)
    message = str(err.value)
    assert "position 3" in message
    assert repr(tiny_tokenizer.convert_ids_to_tokens(ids[3])) in message
    assert "'<|im_end|>'" in message
    assert "fake_server" in message
