"""Object-list serialization and token-exact strict parsing of rollouts (pure: no torch, no I/O).

Owns: the :class:`ObjectCodec` protocol, the default ``qwen_json`` codec (:class:`QwenJsonCodec`),
:class:`ParseResult`, the element validator shared by every format (:func:`validate_element`),
per-token character offsets of a token-id sequence (:func:`decode_with_offsets`) and per-character
roles of a serialization (used for loss weights).
Leaves out: picking a codec by name (``detection.object_formats``), matching
(``detection.matching``), target construction (``detection.targets``) and anything about prompts
or models; the tokenizer is passed in.

Format (one line, ``json.dumps`` separators, ``ensure_ascii=False``)::

    [{"bbox_2d": [x1, y1, x2, y2], "label": "red square"}, {"bbox_2d": [...], "label": "..."}]

Strict parse of the response token ids (docs/detection.md):

1. cut at the first EOS id; decode token by token into exact character spans;
2. scan the JSON list (depth, strings, escapes); a top-level element is *complete* only at the
   closing ``}`` of an object at depth 1; a top-level value that is not an object stops the scan
   (``not_object``), so the prefix never holds one;
3. validate each complete element with ``json.loads`` on its exact text; invalid ones are counted
   by reason and excluded from the objects, never repaired;
4. the prefix is the token ids through the last complete element. Earlier tokens are never
   re-tokenized: only the one token holding the cut (e.g. ``"},`` or ``"}]``) is re-encoded for
   its kept part, and the prefix must decode back to the same text; if it does not (or the cut
   token starts inside a multi-byte character), the cut moves back one element (the dropped
   elements are counted as ``cut_mismatch``). With no complete element, or no leading ``[``, the
   prefix is the ids of ``[``;
5. ``truncated``: the response hit ``max_new_tokens``, or it ended inside the list (between or
   inside elements). A list that stops at an error or closes is not truncated.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollmatch.detection.json_scan import (
    ListScan,
    char_roles,
    scan_json_list,
)
from rollmatch.detection.objects import DetObject, canonical_order
from rollmatch.errors import ConfigError, ConfigProblem

# A complete element that fails validation is counted under one of these reasons.
ELEMENT_REASONS: tuple[str, ...] = (
    "bad_json",  # json.loads rejects the element's exact text
    "bad_keys",  # keys other than exactly bbox_2d + label (or a repeated key)
    "bad_label",  # label is not a string
    "empty_label",  # label is empty or only whitespace
    "bad_coord",  # bbox_2d is not 4 integers (bool is not an int) in [0, max_x] / [0, max_y]
    "degenerate_box",  # x2 <= x1 or y2 <= y1
    "digit_coord",  # coord_tokens: a coordinate written in digits, not as one coordinate token
    "misplaced_coord",  # coord_tokens: a coordinate token outside bbox_2d, or not 4 in it
)
# At most one of these per response: why the scan of the list stopped or what was dropped.
LIST_REASONS: tuple[str, ...] = (
    "not_a_list",  # the response does not start with "["
    "not_object",  # a top-level element that is not an object (number, literal, string, array)
    "bad_structure",  # junk between elements, a trailing comma or a mismatched bracket
    "text_after_list",  # non-whitespace after the closing "]"
    "cut_mismatch",  # complete elements dropped because their cut did not re-encode exactly
)


class Tokenizer(Protocol):
    """The part of a Hugging Face fast tokenizer the codec uses."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(
        self, token_ids: list[int], skip_special_tokens: bool = ..., clean_up_tokenization_spaces: bool = ...
    ) -> str: ...


@dataclass
class ParseResult:
    """The strict parse of one response (see the module docstring for the rules)."""

    objects: list[DetObject]  # valid complete elements inside the prefix, in rollout order
    prefix_token_ids: list[int]  # ids through the last complete element; else the ids of "["
    prefix_text: str
    num_complete: int  # complete top-level elements inside the prefix, valid + invalid
    invalid: dict[str, int]  # reason (ELEMENT_REASONS, LIST_REASONS) -> count
    truncated: bool  # hit max_new_tokens, or the response ended inside the list (not at an error)
    has_complete_element: bool  # False -> the prefix is exactly "["
    response_text: str = ""  # the decoded response, cut at the first EOS (for logs)
    closed: bool = False  # the list's closing "]" was seen
    # Per complete element inside the prefix (num_complete entries): where it ends in prefix_text,
    # and whether it is valid (the valid ones are `objects`, in order). Used to cut a target early.
    element_ends: list[int] = field(default_factory=list)
    element_valid: list[bool] = field(default_factory=list)
    # valid elements labelled with the noise label, taken out of `objects` before matching
    # (detection.noise_objects.drop_noise_objects; 0 when nothing is dropped)
    noise_objects: int = 0


class ObjectCodec(Protocol):
    """A serialization of object lists that can be strictly parsed back from token ids."""

    name: str

    def serialize(self, objects: Sequence[DetObject]) -> str:
        """The whole list in canonical order, on one line."""
        ...

    def serialize_in_order(self, objects: Sequence[DetObject]) -> str:
        """The whole list in the order given (a reordered-GT target keeps the rollout's order)."""
        ...

    def append_fragment(self, objects: Sequence[DetObject], after_element: bool) -> str:
        """Text that continues a prefix with ``objects`` (canonical order) and closes the list."""
        ...

    def parse(
        self, response_token_ids: Sequence[int], *, extent: tuple[int, int], hit_max_tokens: bool
    ) -> ParseResult:
        """Strictly parse a response; never raises on model output."""
        ...

    def char_roles(self, text: str) -> bytes:
        """One role per character of a serialization prefix (``json_scan.STRUCTURE/VALUE/TEXT``)."""
        ...


@dataclass(frozen=True)
class DecodedTokens:
    """A token-id sequence decoded with exact character offsets.

    Tokens are grouped: a group is the smallest run of tokens that decodes to whole characters (a
    byte-level BPE token can end inside a multi-byte UTF-8 character; the group ends with the token
    that completes it). ``groups[g] = (first_token, end_token, char_start, char_end)``.
    """

    text: str
    groups: list[tuple[int, int, int, int]] = field(default_factory=list)

    def token_spans(self) -> list[tuple[int, int]]:
        """Per token, the character span of its group."""
        spans: list[tuple[int, int]] = []
        for first, end, start, stop in self.groups:
            spans.extend([(start, stop)] * (end - first))
        return spans


def decode_with_offsets(tokenizer: Tokenizer, token_ids: Sequence[int]) -> DecodedTokens:
    """Decode ``token_ids`` incrementally into text and per-token-group character spans.

    Incremental detokenization as in vLLM: each step decodes a short window starting at the last
    point where the text was whole characters, so the cost is linear in the length and the joined
    text equals ``tokenizer.decode(token_ids)`` for byte-level BPE tokenizers.
    """
    ids = list(token_ids)
    decode = _window_decoder(tokenizer)
    parts: list[str] = []
    groups: list[tuple[int, int, int, int]] = []
    length = 0
    prefix_offset = read_offset = 0
    for k in range(len(ids)):
        prefix_text = decode(ids[prefix_offset:read_offset])
        new_text = decode(ids[prefix_offset : k + 1])
        # A trailing U+FFFD means the window ends inside a multi-byte character: wait for more.
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            groups.append((read_offset, k + 1, length, length + len(delta)))
            parts.append(delta)
            length += len(delta)
            prefix_offset, read_offset = read_offset, k + 1
    if read_offset < len(ids):  # flush what never became whole characters
        delta = decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])) :]
        groups.append((read_offset, len(ids), length, length + len(delta)))
        parts.append(delta)
    return DecodedTokens(text="".join(parts), groups=groups)


class QwenJsonCodec:
    """The ``qwen_json`` format: ``[{"bbox_2d": [x1, y1, x2, y2], "label": "..."}, ...]``."""

    name = "qwen_json"

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Sequence[int]):
        if not eos_token_ids:
            raise ConfigError(
                [ConfigProblem("eos_token_ids", list(eos_token_ids), "pass the tokenizer's EOS id(s)")]
            )
        self.tokenizer = tokenizer
        self._decode_window = _window_decoder(tokenizer)
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        self.open_token_ids = list(tokenizer.encode("[", add_special_tokens=False))
        opened = tokenizer.decode(self.open_token_ids, skip_special_tokens=False)
        if opened != "[":
            raise ConfigError(
                [
                    ConfigProblem(
                        "tokenizer", opened, 'the tokenizer must encode "[" so that it decodes back to "["'
                    )
                ]
            )

    # ------------------------------------------------------------------ serialization
    def serialize(self, objects: Sequence[DetObject]) -> str:
        return self.serialize_in_order(canonical_order(objects))

    def serialize_in_order(self, objects: Sequence[DetObject]) -> str:
        return "[" + ", ".join(self._element_text(o) for o in objects) + "]"

    def append_fragment(self, objects: Sequence[DetObject], after_element: bool) -> str:
        elements = ", ".join(self._element_text(o) for o in canonical_order(objects))
        if not elements:
            return "]"
        return (", " if after_element else "") + elements + "]"

    def char_roles(self, text: str) -> bytes:
        return char_roles(text)

    def _element_text(self, obj: DetObject) -> str:
        """One element's text; a subclass changes how coordinates are written (coordinate tokens)."""
        return _element_text(obj)

    # ------------------------------------------------------------------ parsing
    def parse(
        self, response_token_ids: Sequence[int], *, extent: tuple[int, int], hit_max_tokens: bool
    ) -> ParseResult:
        ids = _cut_at_eos(response_token_ids, self.eos_token_ids)
        decoded = decode_with_offsets(self.tokenizer, ids)
        scanned = self._scan_text(ids, decoded)
        scan = scan_json_list(scanned)
        invalid: dict[str, int] = {}
        if scan.stop_reason is not None:
            invalid[scan.stop_reason] = 1
        checked = [self._element(scanned[s:e], decoded.text[s:e], extent) for s, e in scan.elements]

        kept, prefix_ids = self._cut(ids, decoded, scan)
        if kept < len(scan.elements):
            invalid["cut_mismatch"] = len(scan.elements) - kept
        objects: list[DetObject] = []
        for result in checked[:kept]:
            if isinstance(result, DetObject):
                objects.append(result)
            else:
                invalid[result] = invalid.get(result, 0) + 1
        cut_char = scan.elements[kept - 1][1] if kept else 0
        return ParseResult(
            objects=objects,
            prefix_token_ids=prefix_ids,
            prefix_text=decoded.text[:cut_char] if kept else "[",
            num_complete=kept,
            invalid=invalid,
            truncated=hit_max_tokens or scan.ended_early,
            has_complete_element=kept > 0,
            response_text=decoded.text,
            closed=scan.closed,
            element_ends=[end for _, end in scan.elements[:kept]],
            element_valid=[isinstance(result, DetObject) for result in checked[:kept]],
        )

    def _scan_text(self, ids: list[int], decoded: DecodedTokens) -> str:
        """The text the JSON scan reads (offsets as in ``decoded.text``); a subclass may stand in
        for tokens that are not JSON (coordinate tokens)."""
        return decoded.text

    def _element(self, scanned: str, original: str, extent: tuple[int, int]) -> DetObject | str:
        """One complete element (its scanned and its decoded text) -> object or invalid reason."""
        return validate_element(scanned, extent)

    def _cut(self, ids: list[int], decoded: DecodedTokens, scan: ListScan) -> tuple[int, list[int]]:
        """(number of elements kept, prefix ids): the latest element end that re-encodes exactly."""
        group_ends = [g[3] for g in decoded.groups]
        for kept in range(len(scan.elements), 0, -1):
            cut_char = scan.elements[kept - 1][1]
            group = decoded.groups[bisect_right(group_ends, cut_char - 1)]
            prefix = self._prefix_through(ids, decoded.text, group, cut_char)
            if prefix is not None:
                redecoded = self.tokenizer.decode(
                    prefix, skip_special_tokens=False, clean_up_tokenization_spaces=False
                )
                if redecoded == decoded.text[:cut_char]:
                    return kept, prefix
        return 0, list(self.open_token_ids)

    def _prefix_through(
        self, ids: list[int], text: str, group: tuple[int, int, int, int], cut_char: int
    ) -> list[int] | None:
        """The ids through character ``cut_char``, ending in ``group``; None if the cut needs more
        than the token holding it re-encoded.

        Groups start on character boundaries, so the group's tokens decode on their own. The cut
        token is the last one whose preceding tokens decode to a prefix of ``text`` ending before
        the cut; it must hold the cut character itself (not start inside a multi-byte character
        that it completes). Its kept part alone is re-encoded; every token before it is kept as is,
        even a stray byte that decodes to U+FFFD.
        """
        first, end, start, stop = group
        if stop == cut_char:
            return ids[:end]
        kept_text = text[start:cut_char]
        for token in range(end - 1, first - 1, -1):
            head = self._decode_window(ids[first:token])
            if len(head) < len(kept_text) and kept_text.startswith(head):
                if not self._decode_window(ids[first : token + 1]).startswith(kept_text):
                    return None  # the cut token starts mid-character: keeping it alone is impossible
                tail = self.tokenizer.encode(kept_text[len(head) :], add_special_tokens=False)
                return ids[:token] + list(tail)
        return None


def validate_element(text: str, extent: tuple[int, int]) -> DetObject | str:
    """One complete element's exact text as a :class:`DetObject`, or the reason (``ELEMENT_REASONS``)
    it is invalid; coordinates must lie in ``[0, extent[0]] x [0, extent[1]]``."""
    try:
        value = json.loads(text, object_pairs_hook=_object_from_pairs)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError; so is an over-long int
        return "bad_json"
    if not isinstance(value, dict):
        return "not_object"
    if isinstance(value, _RepeatedKeyObject) or set(value) != {"bbox_2d", "label"}:
        return "bad_keys"
    label, box = value["label"], value["bbox_2d"]
    if not isinstance(label, str):
        return "bad_label"
    if not label.strip():
        return "empty_label"
    if not (isinstance(box, list) and len(box) == 4 and all(type(v) is int for v in box)):
        return "bad_coord"
    x1, y1, x2, y2 = box
    max_x, max_y = extent
    if not (0 <= x1 <= max_x and 0 <= x2 <= max_x and 0 <= y1 <= max_y and 0 <= y2 <= max_y):
        return "bad_coord"
    if x2 <= x1 or y2 <= y1:
        return "degenerate_box"
    return DetObject(label=label, bbox=(x1, y1, x2, y2))


# ---------------------------------------------------------------------------------------- helpers
def _window_decoder(tokenizer: Tokenizer) -> Callable[[list[int]], str]:
    """``decode(ids)`` with special tokens kept and no space clean-up.

    A Hugging Face fast tokenizer's Rust backend decodes exactly like its ``decode`` with these
    settings, ~4x faster; the offsets decode twice per token, so it is used when present.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda window: backend.decode(window, skip_special_tokens=False)
    return lambda window: tokenizer.decode(
        window, skip_special_tokens=False, clean_up_tokenization_spaces=False
    )


def _element_text(obj: DetObject) -> str:
    return json.dumps({"bbox_2d": list(obj.bbox), "label": obj.label}, ensure_ascii=False)


def _cut_at_eos(token_ids: Sequence[int], eos_token_ids: frozenset[int]) -> list[int]:
    ids = [int(i) for i in token_ids]
    for k, token in enumerate(ids):
        if token in eos_token_ids:
            return ids[:k]
    return ids


class _RepeatedKeyObject(dict):
    """A JSON object that repeated a key (``json.loads`` would silently keep the last value)."""


def _object_from_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    return obj if len(obj) == len(pairs) else _RepeatedKeyObject(obj)
