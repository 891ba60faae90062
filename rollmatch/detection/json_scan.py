"""Character-level scanning of a JSON list as a model writes it (pure: no tokenizer, no torch).

Owns: :func:`scan_json_list`, which finds the complete top-level objects of a possibly truncated
or broken list (depth, strings, escapes; no value is interpreted), and :func:`char_roles`, which
labels every character as structure, value or string text (used for per-token loss weights).
Leaves out: validating elements and anything about tokens (``detection.codec``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

WHITESPACE = " \t\n\r"  # JSON's insignificant whitespace
# A JSON string from its opening quote: any escaped character or any character but `"` and `\`.
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_CLOSER = {"{": "}", "[": "]"}
_SCALAR_START = frozenset("-0123456789tfn")
_SCALAR_END = frozenset(WHITESPACE + ',]}[{"')
_VALUE_START = _SCALAR_START | {'"', "["}  # a JSON value that is not an object
_NUMBER_CHARS = frozenset("0123456789+-.eE")

# Character roles (one byte per character, see char_roles).
STRUCTURE = 0  # brackets, braces, separators, whitespace, keys and the quotes of every string
VALUE = 1  # number and literal characters (in qwen_json: coordinates)
TEXT = 2  # the characters inside a string value (in qwen_json: labels)


@dataclass
class ListScan:
    """Where the complete top-level elements of a list are, and how the scan ended."""

    started: bool  # the text starts with "["
    closed: bool  # the closing "]" was seen
    elements: list[tuple[int, int]] = field(default_factory=list)  # [start, end) per complete object
    stop_reason: str | None = None  # not_a_list | not_object | bad_structure | text_after_list

    @property
    def ended_early(self) -> bool:
        """The text ended inside the list (between or inside elements), not at an error or its ``]``."""
        return self.started and not self.closed and self.stop_reason is None


def scan_json_list(text: str) -> ListScan:
    """Scan ``text`` as the start of a JSON list of objects; never raises.

    An element is complete only at the closing ``}`` of a top-level object (depth 1). A top-level
    value that is not an object (a number, literal, string or array) is never complete: the scan
    stops at its first character (``not_object``). The scan stops, keeping what is complete so
    far, at the end of the text, at the closing ``]``, or at the first structural error.
    """
    if not text.startswith("["):
        return ListScan(started=False, closed=False, stop_reason="not_a_list")
    scan = ListScan(started=True, closed=False)
    pos, expect_separator = 1, False
    while True:
        pos = _skip_whitespace(text, pos)
        if pos >= len(text):
            return scan  # ended between or inside elements: the caller reports truncation
        char = text[pos]
        if char == "]" and (expect_separator or not scan.elements):
            scan.closed = True
            if text[pos + 1 :].strip(WHITESPACE):
                scan.stop_reason = "text_after_list"
            return scan
        if expect_separator:
            if char != ",":
                scan.stop_reason = "bad_structure"
                return scan
            pos, expect_separator = pos + 1, False
            continue
        if char != "{":
            scan.stop_reason = "not_object" if char in _VALUE_START else "bad_structure"
            return scan
        end = _object_end(text, pos)
        if end is None:
            return scan
        if end < 0:
            scan.stop_reason = "bad_structure"
            return scan
        scan.elements.append((pos, end))
        pos, expect_separator = end, True


def char_roles(text: str) -> bytes:
    """One role per character of ``text`` (``STRUCTURE``, ``VALUE`` or ``TEXT``); never raises.

    Strings in key position (in an object, before ``:``) are structure; other strings contribute
    their inner characters as ``TEXT`` (their quotes stay structure). A string cut off by the end of
    ``text`` still counts as text up to the end.
    """
    roles = bytearray(len(text))
    stack: list[str] = []
    expect_key = False
    pos = 0
    while pos < len(text):
        char = text[pos]
        if char == '"':
            end = _string_end(text, pos)
            stop = len(text) if end is None else end - 1
            if not (expect_key and stack and stack[-1] == "{"):
                roles[pos + 1 : stop] = bytes([TEXT]) * max(0, stop - pos - 1)
            pos = len(text) if end is None else end
            continue
        if char in _CLOSER:
            stack.append(char)
            expect_key = char == "{"
        elif char in "}]":
            if stack:
                stack.pop()
            expect_key = False
        elif char == ":":
            expect_key = False
        elif char == ",":
            expect_key = bool(stack) and stack[-1] == "{"
        elif char in _SCALAR_START:
            end = _scalar_end(text, pos)
            roles[pos:end] = bytes([VALUE]) * (end - pos)
            pos = end
            continue
        pos += 1
    return bytes(roles)


# ---------------------------------------------------------------------------------------- helpers
def _skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


def _string_end(text: str, pos: int) -> int | None:
    """Index after the closing quote of the string opened at ``pos``, or None if it is cut off."""
    match = _STRING.match(text, pos)
    return match.end() if match else None


def _scalar_end(text: str, pos: int) -> int:
    end = pos
    while end < len(text) and text[end] not in _SCALAR_END:
        end += 1
    return end


def _object_end(text: str, pos: int) -> int | None:
    """End of the object opened at ``pos``: None if the text ends first, -1 if it is malformed."""
    stack: list[str] = []
    while pos < len(text):
        char = text[pos]
        if char == '"':
            end = _string_end(text, pos)
            if end is None:
                return None
            pos = end
            continue
        if char in _CLOSER:
            stack.append(_CLOSER[char])
        elif char in "}]":
            if not stack or stack[-1] != char:
                return -1
            stack.pop()
            if not stack:
                return pos + 1
        pos += 1
    return None
