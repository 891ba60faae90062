"""Character-level scanning of (possibly broken) JSON lists and character roles."""

from __future__ import annotations

import pytest

from rollmatch.detection.json_scan import STRUCTURE, TEXT, VALUE, char_roles, scan_json_list


def roles_string(text: str) -> str:
    return "".join({STRUCTURE: "s", VALUE: "v", TEXT: "t"}[r] for r in char_roles(text))


def test_char_roles_of_an_element() -> None:
    text = '[{"bbox_2d": [1, 22], "label": "a \\"b"}]'
    #          [{"bbox_2d": [   1    ,_   22    ],_   "label":_  "    a_\\"b      "}]
    expected = "s" * 14 + "v" + "ss" + "vv" + "sss" + "s" * 9 + "s" + "t" * 5 + "sss"
    assert roles_string(text) == expected


def test_char_roles_of_cut_off_and_odd_text() -> None:
    assert roles_string('[{"label": "red sq') == "s" * 12 + "tttttt"
    assert roles_string('[{"bb') == "s" * 5  # a key cut off is still structure
    assert roles_string("[-1.5e3, true, null]") == "s" + "v" * 6 + "ss" + "v" * 4 + "ss" + "v" * 4 + "s"
    assert roles_string("") == ""


@pytest.mark.parametrize(
    ("text", "elements", "closed", "stop"),
    [
        ("[]", [], True, None),
        ("[ ]  \n", [], True, None),
        ('[{"a": "}"}, {"b": [1, {"c": 2}]}]', [(1, 11), (13, 33)], True, None),
        ('[{"a": "x\\"}"}', [(1, 14)], False, None),
        ('[{"a": [1, 2', [], False, None),
        # only objects are elements: any other top-level value stops the scan, complete or not
        ("[12, 3", [], False, "not_object"),
        ('[1, "s", [2], true]', [], False, "not_object"),
        ('[{"a": 1}, [2], {"b": 3}]', [(1, 9)], False, "not_object"),
        ('[{"a": 1}, "s"', [(1, 9)], False, "not_object"),
        ("[{}] tail", [(1, 3)], True, "text_after_list"),
        ("[{}, ]", [(1, 3)], False, "bad_structure"),
        ("[{} {}]", [(1, 3)], False, "bad_structure"),
        ("[{]}", [], False, "bad_structure"),
        ("[}", [], False, "bad_structure"),
        (" []", [], False, "not_a_list"),
        ("", [], False, "not_a_list"),
    ],
)
def test_scan_json_list(text: str, elements: list[tuple[int, int]], closed: bool, stop: str | None) -> None:
    scan = scan_json_list(text)
    assert scan.elements == elements
    assert scan.closed == closed and scan.stop_reason == stop
    assert scan.started == text.startswith("[")


@pytest.mark.parametrize(
    ("text", "ended_early"),
    [
        ('[{"a": 1}', True),  # between elements
        ('[{"a": 1}, {"b', True),  # inside an element
        ("[", True),
        ('[{"a": 1}]', False),  # closed
        ('[{"a": 1} {"b": 2}]', False),  # stopped at an error: the list was written to its end
        ('[{"a": 1}, ]', False),
        ("[1, 2, 3", False),
        ("no list", False),
    ],
)
def test_ended_early_only_when_the_text_runs_out_inside_the_list(text: str, ended_early: bool) -> None:
    assert scan_json_list(text).ended_early == ended_early
