"""Strict JSONL loading, validation, writing and RGB image loading (rollmatch.data.records)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from rollmatch.data.records import (
    BOX_TOLERANCE_PX,
    Record,
    RecordObject,
    load_image,
    load_records,
    validate_records,
    write_records,
)
from rollmatch.errors import DataError

W, H = 40, 30


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A dataset folder with one real 40x30 image at images/a.png."""
    (tmp_path / "images").mkdir()
    Image.new("RGB", (W, H), (10, 200, 30)).save(tmp_path / "images" / "a.png")
    return tmp_path


def good(**changes: Any) -> dict[str, Any]:
    line: dict[str, Any] = {
        "id": "a",
        "images": ["images/a.png"],
        "width": W,
        "height": H,
        "objects": [{"label": "red square", "bbox": [1, 2, 11, 12]}],
    }
    line.update(changes)
    return line


def write_lines(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_good_line_loads_with_absolute_image_path_and_float_boxes(folder: Path) -> None:
    path = write_lines(folder / "train.jsonl", [good(), good(id="b", objects=[])])
    records = load_records(path)
    assert records == [
        Record(
            "a",
            (str(folder / "images" / "a.png"),),
            W,
            H,
            (RecordObject("red square", (1.0, 2.0, 11.0, 12.0)),),
        ),
        Record("b", (str(folder / "images" / "a.png"),), W, H, ()),
    ]
    assert all(isinstance(v, float) for v in records[0].objects[0].bbox)
    assert records[0].image_size == (W, H)


def _without_objects() -> dict[str, Any]:
    line = good()
    del line["objects"]
    return line


BAD_LINES = {
    "missing field": (_without_objects(), "missing field(s) 'objects'"),
    "extra field": (good(caption="x"), "unknown field(s) 'caption'"),
    "id not a string": (good(id=5), "field 'id'"),
    "empty id": (good(id=" "), "field 'id'"),
    "images empty": (good(images=[]), "field 'images'"),
    "images not strings": (good(images=[3]), "field 'images[0]'"),
    "missing image file": (good(images=["images/nope.png"]), "field 'images[0]': image file not found"),
    "zero width": (good(width=0), "field 'width'"),
    "negative height": (good(height=-3), "field 'height'"),
    "float width": (good(width=40.5), "field 'width'"),
    "bool width": (good(width=True), "field 'width'"),
    "objects not a list": (good(objects={"label": "x"}), "field 'objects'"),
    "object not a dict": (good(objects=[[1, 2, 3, 4]]), "field 'objects[0]'"),
    "object extra key": (
        good(objects=[{"label": "x", "bbox": [1, 2, 3, 4], "score": 1}]),
        "field 'objects[0]'",
    ),
    "empty label": (good(objects=[{"label": "", "bbox": [1, 2, 3, 4]}]), "field 'objects[0].label'"),
    "label not a string": (good(objects=[{"label": 7, "bbox": [1, 2, 3, 4]}]), "field 'objects[0].label'"),
    "bbox 3 numbers": (good(objects=[{"label": "x", "bbox": [1, 2, 3]}]), "field 'objects[0].bbox'"),
    "bbox with a string": (good(objects=[{"label": "x", "bbox": [1, "2", 3, 4]}]), "field 'objects[0].bbox'"),
    "bbox with a bool": (good(objects=[{"label": "x", "bbox": [1, True, 3, 4]}]), "field 'objects[0].bbox'"),
    "bbox NaN": (
        '{"id": "a", "images": ["images/a.png"], "width": 40, "height": 30, '
        '"objects": [{"label": "x", "bbox": [NaN, 1, 2, 3]}]}',
        "field 'objects[0].bbox'",
    ),
    "x2 <= x1": (good(objects=[{"label": "x", "bbox": [5, 2, 5, 4]}]), "field 'objects[0].bbox': degenerate"),
    "y2 <= y1": (good(objects=[{"label": "x", "bbox": [1, 9, 3, 4]}]), "field 'objects[0].bbox': degenerate"),
    "box past the right edge": (
        good(objects=[{"label": "x", "bbox": [1, 2, W + 2, 4]}]),
        "outside the 40x30",
    ),
    "box above the top": (good(objects=[{"label": "x", "bbox": [1, -1.5, 3, 4]}]), "outside the 40x30"),
    "box fully outside": (good(objects=[{"label": "x", "bbox": [W + 0.2, 2, W + 1, 4]}]), "no area inside"),
    "not json": ('{"id": "a", ', "not valid JSON"),
    "not an object": ("[1, 2]", "must be a JSON object"),
    "empty line": ("", "empty line"),
}


@pytest.mark.parametrize("name", list(BAD_LINES))
def test_each_bad_line_names_file_line_and_field(folder: Path, name: str) -> None:
    bad, expected = BAD_LINES[name]
    path = write_lines(folder / "train.jsonl", [good(id="ok"), bad])
    with pytest.raises(DataError) as err:
        load_records(path)
    message = str(err.value)
    assert message.startswith(f"{path}:2: "), message
    assert expected in message, message


def test_duplicate_id_names_both_lines(folder: Path) -> None:
    path = write_lines(folder / "train.jsonl", [good(id="a"), good(id="b"), good(id="a")])
    with pytest.raises(DataError, match=r"train\.jsonl:3: field 'id': duplicate id 'a' \(first on line 1\)"):
        load_records(path)


def test_one_error_per_line_counts_the_rest(folder: Path) -> None:
    path = write_lines(
        folder / "train.jsonl", [good(id=5, width=0, objects=[{"label": "", "bbox": [1, 2, 3, 4]}])]
    )
    with pytest.raises(
        DataError, match=r":1: field 'id'.*\(\+2 more on this line\).*rollmatch data validate"
    ):
        load_records(path)


@pytest.mark.parametrize(
    ("bbox", "clipped"),
    [
        ([-BOX_TOLERANCE_PX, 0, W + BOX_TOLERANCE_PX, H], (0.0, 0.0, float(W), float(H))),
        ([-0.4, 2.5, 10, H + 0.6], (0.0, 2.5, 10.0, float(H))),
    ],
)
def test_boxes_within_tolerance_are_clipped(
    folder: Path, bbox: list[float], clipped: tuple[float, ...]
) -> None:
    path = write_lines(folder / "train.jsonl", [good(objects=[{"label": "x", "bbox": bbox}])])
    assert load_records(path)[0].objects[0].bbox == clipped


def test_max_samples_reads_only_the_first_records(folder: Path) -> None:
    path = write_lines(folder / "train.jsonl", [good(id="a"), good(id="b"), "not json"])
    assert [r.id for r in load_records(path, max_samples=2)] == ["a", "b"]
    with pytest.raises(DataError, match=":3: not valid JSON"):
        load_records(path, max_samples=3)
    with pytest.raises(DataError, match="max_samples = 0"):
        load_records(path, max_samples=0)


def test_missing_and_empty_files_are_errors(folder: Path) -> None:
    with pytest.raises(DataError, match=r"records file not found: .*nope\.jsonl"):
        load_records(folder / "nope.jsonl")
    (folder / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"empty\.jsonl: no records"):
        load_records(folder / "empty.jsonl")


def test_validate_collects_every_problem_including_real_image_size(folder: Path) -> None:
    lines = [
        good(id="a"),
        good(id="b", width=41),  # the image is 40x30: only validate opens images
        good(id=5, height=0),
        "oops",
        good(id="a"),
    ]
    path = write_lines(folder / "train.jsonl", lines)
    problems = validate_records(path)
    assert len(problems) == 5, problems
    assert problems[0].startswith(f"{path}:2: fields 'width'/'height': record says 41x30")
    assert "is 40x30" in problems[0]
    assert problems[1].startswith(f"{path}:3: field 'id'")
    assert problems[2].startswith(f"{path}:3: field 'height'")
    assert problems[3].startswith(f"{path}:4: not valid JSON")
    assert problems[4].startswith(f"{path}:5: field 'id': duplicate id 'a'")
    assert validate_records(write_lines(folder / "ok.jsonl", [good()])) == []
    assert validate_records(folder / "nope.jsonl") == [f"records file not found: {folder / 'nope.jsonl'}"]


def test_write_then_load_round_trips_with_relative_or_absolute_paths(folder: Path) -> None:
    records = load_records(write_lines(folder / "src.jsonl", [good(), good(id="b", objects=[])]))
    relative = write_records(folder / "out" / "rel.jsonl", records, relative_to=folder / "out")
    assert json.loads(relative.read_text().splitlines()[0])["images"] == ["../images/a.png"]
    absolute = write_records(folder / "abs.jsonl", records)
    first = json.loads(absolute.read_text().splitlines()[0])
    assert first["images"] == [str(folder / "images" / "a.png")]
    assert first["objects"][0]["bbox"] == [1, 2, 11, 12]  # integral floats are written as ints
    assert load_records(relative) == records
    assert load_records(absolute) == records


def test_write_keeps_fractional_coordinates_exactly(folder: Path) -> None:
    obj = RecordObject("x", (0.1, 2.0 / 3.0, 12.345678901234567, 29.999))
    record = Record("a", (str(folder / "images" / "a.png"),), W, H, (obj,))
    path = write_records(folder / "f.jsonl", [record])
    assert load_records(path) == [record]


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "I;16"])
def test_load_image_is_always_rgb(tmp_path: Path, mode: str) -> None:
    path = tmp_path / f"img_{mode.replace(';', '')}.png"
    Image.new(mode, (7, 5)).save(path)
    image = load_image(path)
    assert image.mode == "RGB"
    assert image.size == (7, 5)


def test_load_image_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"image file not found: .*missing\.png"):
        load_image(tmp_path / "missing.png")
    (tmp_path / "broken.jpg").write_bytes(b"not an image")
    with pytest.raises(DataError, match=r"cannot read image .*broken\.jpg"):
        load_image(tmp_path / "broken.jpg")


def test_load_image_converts_the_real_grayscale_raccoons(real_data_dir: Path) -> None:
    for n in (150, 152, 161):
        path = real_data_dir / "raccoon" / "images" / f"raccoon-{n}.jpg"
        with Image.open(path) as raw:
            assert raw.mode == "L"
        image = load_image(path)
        assert image.mode == "RGB"
        assert len(image.getpixel((0, 0))) == 3


def test_line_separators_inside_labels_and_crlf_files(folder: Path) -> None:
    image = str(folder / "images" / "a.png")
    record = Record("a\u2028b", (image,), W, H, (RecordObject("tabby\u2028cat\x0bx", (1.0, 2.0, 3.0, 4.0)),))
    path = write_records(folder / "u.jsonl", [record, Record("c", (image,), W, H, ())])
    assert "\u2028" in path.read_text(encoding="utf-8")  # written raw (ensure_ascii=False)
    assert load_records(path)[0] == record
    crlf = folder / "crlf.jsonl"
    crlf.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    assert load_records(crlf) == load_records(path)


def test_non_utf8_file_is_an_error(folder: Path) -> None:
    path = folder / "latin1.jsonl"
    path.write_bytes(json.dumps(good()).encode() + b"\n" + b'{"id": "\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1\.jsonl: not UTF-8 text"):
        load_records(path)
    problems = validate_records(path)
    assert len(problems) == 1
    assert "not UTF-8 text" in problems[0]
