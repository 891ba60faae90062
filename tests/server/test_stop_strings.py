"""Stop strings on the server: the response is cut before the first stop string, the token ids keep
only whole tokens before it, and finding the cut costs a logarithmic number of decodes."""

from __future__ import annotations

from typing import Any

import pytest

from rollmatch.server.prompt_preparer import trim_at_stop_strings


class _CountingTokenizer:
    """The real tokenizer, counting ``decode`` calls (the cost under test)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer, self.decodes = tokenizer, 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.decodes += 1
        return str(self.tokenizer.decode(ids, **kwargs))


def _reference(ids: list[int], text: str, stop: str, tokenizer: Any) -> tuple[list[int], str]:
    """The cut by brute force: the most tokens whose text is a prefix of the text before the stop."""
    before = text[: text.find(stop)]
    kept = max(
        n
        for n in range(len(ids) + 1)
        if before.startswith(tokenizer.decode(ids[:n], skip_special_tokens=False))
    )
    return ids[:kept], before


@pytest.mark.parametrize(
    "body",
    ["word " * 600, "ünïcödé 箱子 " * 150, '{"bbox": [1, 2, 3, 4], "label": "raccoon"} ' * 60],
    ids=["ascii", "multibyte", "json"],
)
def test_the_cut_matches_brute_force_and_costs_log_n_decodes(tiny_tokenizer: Any, body: str) -> None:
    # Pins: the cut used to decode every prefix up to the stop (O(N) decodes of O(N) tokens per
    # response); now O(log N), with the same result.
    text = body + "STOP" + " tail"
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    decoded = tiny_tokenizer.decode(ids, skip_special_tokens=False)
    counting = _CountingTokenizer(tiny_tokenizer)
    trimmed = trim_at_stop_strings(ids, decoded, ["STOP", "never"], counting)
    assert trimmed == _reference(ids, decoded, "STOP", tiny_tokenizer)
    assert counting.decodes <= 2 * len(ids).bit_length() + 8, (counting.decodes, len(ids))
    assert trim_at_stop_strings(ids, decoded, ["absent"], counting) is None
