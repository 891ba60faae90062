"""The ``coord_tokens`` object format: every coordinate is one token out of 1,000 quantized bins.

Owns: the token names (:func:`coord_token`, ``<|coord_0|>`` ... ``<|coord_999|>``), the bin mapping
(:func:`to_bin` / :func:`from_bin`: bin ``k`` is ``k / 999`` of the image side), the ids of the
tokens in a tokenizer (:func:`coord_token_ids`) and :class:`CoordTokenCodec`. Leaves out: adding the
tokens to a checkpoint (``models.coord_vocab``) and the coordinate losses (``training.losses``).

Format: the ``qwen_json`` list with each coordinate a coordinate token::

    [{"bbox_2d": [<|coord_12|>, <|coord_40|>, <|coord_300|>, <|coord_512|>], "label": "red square"}]

Boxes live in the ``norm1000`` frame (0..1000, as for ``qwen_json``); a frame value ``v`` is bin
``round(v * 999 / 1000)`` and bin ``k`` parses back to ``round(k * 1000 / 999)`` (at most one unit
of 1000 away: 0.2 px on a 224 px image). The parser is the ``qwen_json`` parser, token-exact: each coordinate-token id
stands in the JSON scan for its bin number (same character offsets), and an element is valid only
if its ``bbox_2d`` holds exactly four coordinate tokens and nothing else: digits typed where a
coordinate token belongs are ``digit_coord``, a coordinate token anywhere else ``misplaced_coord``.
The characters ``<|coord_5|>`` typed as ordinary tokens are not a coordinate token (the scan sees
``<`` and the element is ``bad_json``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from rollmatch.detection.codec import DecodedTokens, QwenJsonCodec, Tokenizer, validate_element
from rollmatch.detection.json_scan import char_roles
from rollmatch.detection.objects import NORM, DetObject
from rollmatch.errors import ConfigError, ConfigProblem

NUM_BINS = 1000
_TOKEN = re.compile(r"<\|coord_(\d{1,3})\|>")
_BBOX_ARRAY = re.compile(r'"bbox_2d"\s*:\s*\[([^\]]*)\]')
_FOUR_TOKENS = re.compile(r"\s*<\|coord_\d{1,3}\|>\s*(?:,\s*<\|coord_\d{1,3}\|>\s*){3}")


def coord_token(k: int) -> str:
    """The text of coordinate token ``k`` (0..999)."""
    return f"<|coord_{k}|>"


def coord_tokens() -> list[str]:
    """All coordinate tokens, bin order."""
    return [coord_token(k) for k in range(NUM_BINS)]


def to_bin(value: float, extent: int = NORM) -> int:
    """Frame value (0..``extent``) -> bin 0..999."""
    return min(NUM_BINS - 1, max(0, round(value * (NUM_BINS - 1) / extent)))


def from_bin(k: int, extent: int = NORM) -> int:
    """Bin 0..999 -> frame value 0..``extent``."""
    return round(k * extent / (NUM_BINS - 1))


def coord_token_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids of ``<|coord_0|>`` ... ``<|coord_999|>`` (bin order); a clear error when missing."""
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    unknown = getattr(tokenizer, "unk_token_id", None)
    ids = [convert(t) for t in coord_tokens()] if convert is not None else []
    if len(ids) != NUM_BINS or any(i is None or i == unknown for i in ids) or len(set(ids)) != NUM_BINS:
        raise ConfigError(
            [
                ConfigProblem(
                    "custom.object_format",
                    "coord_tokens",
                    "the tokenizer lacks the coordinate tokens <|coord_0|>..<|coord_999|>; add them with "
                    "`rollmatch add-coord-tokens --model DIR --out DIR` (or build a tiny model with "
                    "`rollmatch make-tiny-model --coord-tokens`) and point model.path at the result",
                )
            ]
        )
    return [int(i) for i in ids]


def supported_object_formats(tokenizer: Tokenizer) -> list[str]:
    """The object formats ``tokenizer`` can encode: ``qwen_json``, and ``coord_tokens`` with the tokens."""
    try:
        coord_token_ids(tokenizer)
    except ConfigError:
        return ["qwen_json"]
    return ["qwen_json", "coord_tokens"]


class CoordTokenCodec(QwenJsonCodec):
    """``qwen_json`` structure and labels, one coordinate token per coordinate (``norm1000`` boxes)."""

    name = "coord_tokens"

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Sequence[int]):
        super().__init__(tokenizer, eos_token_ids)
        self.coord_ids = coord_token_ids(tokenizer)
        self._bin_of = {token_id: k for k, token_id in enumerate(self.coord_ids)}

    # ------------------------------------------------------------------ serialization
    def _element_text(self, obj: DetObject) -> str:
        coords = ", ".join(coord_token(to_bin(v)) for v in obj.bbox)
        return '{"bbox_2d": [' + coords + '], "label": ' + json.dumps(obj.label, ensure_ascii=False) + "}"

    def char_roles(self, text: str) -> bytes:
        """A coordinate token's characters read as spaces then its bin's digits: structure and value."""
        return char_roles(_shadow_text(text))

    # ------------------------------------------------------------------ parsing
    def _scan_text(self, ids: list[int], decoded: DecodedTokens) -> str:
        """Each coordinate-token id's characters replaced by its bin number (right-aligned, spaces
        before), so the JSON scan reads a number where the token is and offsets stay the same."""
        chars = list(decoded.text)
        for first, end, start, stop in decoded.groups:
            if end - first == 1 and ids[first] in self._bin_of:
                chars[start:stop] = list(str(self._bin_of[ids[first]]).rjust(stop - start))
        return "".join(chars)

    def _element(self, scanned: str, original: str, extent: tuple[int, int]) -> DetObject | str:
        # extent is (NORM, NORM): coord_tokens runs in the norm1000 frame (rule_coord_tokens, checked once
        # when the run is resolved), and bins are read against NUM_BINS - 1 whatever the caller passes.
        del extent
        result = validate_element(scanned, (NUM_BINS - 1, NUM_BINS - 1))
        array = _BBOX_ARRAY.search(original)
        placed = len(_TOKEN.findall(array.group(1))) if array else 0
        if isinstance(result, str):
            # digits where coordinate tokens belong parse as numbers: name that, not bad_coord
            if result == "bad_coord" and array and _has_digits_outside_tokens(array.group(1)):
                return "digit_coord"
            return result
        if not _FOUR_TOKENS.fullmatch(array.group(1) if array else ""):
            return (
                "digit_coord" if array and _has_digits_outside_tokens(array.group(1)) else "misplaced_coord"
            )
        if placed != len(_TOKEN.findall(original)):
            return "misplaced_coord"
        x1, y1, x2, y2 = (from_bin(k) for k in result.bbox)
        return DetObject(label=result.label, bbox=(x1, y1, x2, y2))


def _shadow_text(text: str) -> str:
    return _TOKEN.sub(lambda m: m.group(1).rjust(len(m.group(0))), text)


def _has_digits_outside_tokens(text: str) -> bool:
    return any(c.isdigit() for c in _TOKEN.sub("", text))
