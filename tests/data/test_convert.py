"""Converters on the real datasets (../shared/data) and on small inline folders for the error paths."""

from __future__ import annotations

import csv
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from rollmatch.data.convert import from_coco, from_voc, from_yolo, natural_key, read_yolo_names
from rollmatch.data.records import Record, RecordObject, load_records, write_records
from rollmatch.errors import DataError

AQUARIUM_NAMES = ["fish", "jellyfish", "penguin", "puffin", "shark", "starfish", "stingray"]
# From ../shared/data/README.md (valid + test); they count the source's two zero-area boxes.
AQUARIUM_BOXES_PER_CLASS = {
    "fish": 708,
    "jellyfish": 309,
    "penguin": 186,
    "puffin": 109,
    "shark": 95,
    "starfish": 38,
    "stingray": 48,
}


def test_natural_key_orders_numbers_numerically() -> None:
    names = ["raccoon-10.xml", "raccoon-2.xml", "raccoon-1.xml", "raccoon-100.xml"]
    assert sorted(names, key=natural_key) == [
        "raccoon-1.xml",
        "raccoon-2.xml",
        "raccoon-10.xml",
        "raccoon-100.xml",
    ]


# ---------------------------------------------------------------------------------------- VOC (real)
@pytest.fixture(scope="module")
def raccoon(real_data_dir: Path) -> list[Record]:
    dropped: list[str] = []
    records = from_voc(real_data_dir / "raccoon", dropped=dropped)
    assert dropped == []
    return records


def test_raccoon_counts_match_the_readme(raccoon: list[Record]) -> None:
    assert len(raccoon) == 200
    assert sum(len(r.objects) for r in raccoon) == 217
    assert Counter(len(r.objects) for r in raccoon) == {1: 184, 2: 15, 3: 1}
    assert {o.label for r in raccoon for o in r.objects} == {"raccoon"}
    assert [r.id for r in raccoon[:12]] == [f"raccoon-{n}" for n in range(1, 13)]
    assert len({(r.width, r.height) for r in raccoon}) == 133


def test_raccoon_boxes_equal_the_independent_csv(raccoon: list[Record], real_data_dir: Path) -> None:
    """The source's csv holds the same boxes as its xml (VOC's 1-based pixel indices): every converted
    box must equal a csv row moved to the 0-based frame."""
    expected: dict[str, list[tuple[float, ...]]] = {}
    sizes: dict[str, tuple[int, int]] = {}
    with (real_data_dir / "raccoon" / "data" / "raccoon_labels.csv").open() as f:
        for row in csv.DictReader(f):
            stem = row["filename"].removesuffix(".jpg")
            xmin, ymin, xmax, ymax = (float(row[k]) for k in ("xmin", "ymin", "xmax", "ymax"))
            expected.setdefault(stem, []).append((xmin - 1, ymin - 1, xmax, ymax))
            sizes[stem] = (int(row["width"]), int(row["height"]))
    for record in raccoon:
        assert sorted(o.bbox for o in record.objects) == sorted(expected[record.id]), record.id
        assert record.image_size == sizes[record.id]
        assert Path(record.images[0]) == real_data_dir / "raccoon" / "images" / f"{record.id}.jpg"
    first = raccoon[0]
    assert (first.id, first.image_size, first.objects[0].bbox) == (
        "raccoon-1",
        (650, 417),
        (80, 87, 522, 408),  # the xml says xmin 81, ymin 88 (1-based)
    )


def test_raccoon_grayscale_images_convert(raccoon: list[Record]) -> None:
    by_id = {r.id: r for r in raccoon}
    assert by_id["raccoon-150"].image_size == (275, 183)
    assert by_id["raccoon-150"].objects[0].bbox == (79, 61, 187, 169)


# --------------------------------------------------------------------------------------- YOLO (real)
@pytest.fixture(scope="module")
def aquarium(real_data_dir: Path) -> tuple[list[Record], list[str]]:
    root = real_data_dir / "aquarium_combined_v2"
    names = read_yolo_names(root / "data.yaml")
    dropped: list[str] = []
    records = from_yolo(root / "valid", names, dropped=dropped) + from_yolo(
        root / "test", names, dropped=dropped
    )
    return records, dropped


def test_yolo_names_from_data_yaml(real_data_dir: Path, tmp_path: Path) -> None:
    assert read_yolo_names(real_data_dir / "aquarium_combined_v2" / "data.yaml") == AQUARIUM_NAMES
    (tmp_path / "map.yaml").write_text("names: {0: cat, 1: dog}\n")
    assert read_yolo_names(tmp_path / "map.yaml") == ["cat", "dog"]
    (tmp_path / "bad.yaml").write_text("nc: 2\n")
    with pytest.raises(DataError, match=r"bad\.yaml: 'names' must be a non-empty list"):
        read_yolo_names(tmp_path / "bad.yaml")


def test_aquarium_counts_match_the_readme(aquarium: tuple[list[Record], list[str]]) -> None:
    records, dropped = aquarium
    assert len(records) == 190
    kept = Counter(o.label for r in records for o in r.objects)
    dropped_labels = Counter(note.rsplit("(", 1)[1].strip("')") for note in dropped)
    assert kept + dropped_labels == AQUARIUM_BOXES_PER_CLASS
    assert sum(kept.values()) + len(dropped) == 1493
    # The source has two zero-size shark boxes ("4 cx cy 0 0"); they are dropped and named.
    assert len(dropped) == 2
    assert dropped_labels == {"shark": 2}
    assert all("/test/labels/" in note and ".txt:" in note for note in dropped)
    sizes = Counter(r.image_size for r in records)
    assert sizes == {(768, 1024): 128, (1024, 768): 30, (576, 1024): 25, (1024, 576): 7}
    per_image = [len(r.objects) for r in records]
    assert (min(per_image), statistics.median(per_image), max(per_image)) == (1, 5, 45)


def test_aquarium_spot_checked_boxes_equal_the_label_file(aquarium: tuple[list[Record], list[str]]) -> None:
    # valid/labels/IMG_2277...txt lines 1-2 on a 768x1024 image:
    #   "0 0.578125 0.392578125 0.07291666666666667 0.25390625" -> cx 444 cy 402 w 56 h 260
    #   "0 0.19075520833333334 0.10205078125 0.3815104166666667 0.1708984375" -> cx 146.5 cy 104.5 w 293 h 175
    records, _ = aquarium
    record = next(r for r in records if r.id == "IMG_2277_jpeg_jpg.rf.86c72d6192da48d941ffa957f4780665")
    assert record.image_size == (768, 1024)
    assert len(record.objects) == 16
    assert record.objects[0].label == "fish"
    assert record.objects[0].bbox == pytest.approx((416, 272, 472, 532), abs=1e-9)
    assert record.objects[1].bbox == pytest.approx((0, 17, 293, 192), abs=1e-9)


# ------------------------------------------------------------------------------------ COCO round trip
def coco_from_records(records: list[Record], *, category_ids: dict[str, int]) -> dict[str, Any]:
    """A COCO detection dict written independently of the converter (file_name = image basename)."""
    images, annotations = [], []
    for image_id, record in enumerate(records, start=100):
        images.append(
            {
                "id": image_id,
                "file_name": Path(record.images[0]).name,
                "width": record.width,
                "height": record.height,
            }
        )
        for obj in record.objects:
            x1, y1, x2, y2 = obj.bbox
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": category_ids[obj.label],
                    "bbox": [x1, y1, x2 - x1, y2 - y1],
                    "area": (x2 - x1) * (y2 - y1),
                    "iscrowd": 0,
                }
            )
    categories = [{"id": cid, "name": name} for name, cid in category_ids.items()]
    return {"images": images, "annotations": annotations, "categories": categories}


def test_coco_round_trip_on_real_voc_records(
    raccoon: list[Record], real_data_dir: Path, tmp_path: Path
) -> None:
    subset = raccoon[:20]
    coco = coco_from_records(subset, category_ids={"raccoon": 7})
    # An image whose only annotation is a crowd region: no objects, the crowd kept as an ignore region.
    coco["images"].append({"id": 999, "file_name": "raccoon-150.jpg", "width": 275, "height": 183})
    coco["annotations"].append(
        {"id": 5000, "image_id": 999, "category_id": 7, "bbox": [1, 1, 50, 50], "area": 2500, "iscrowd": 1}
    )
    path = tmp_path / "instances.json"
    path.write_text(json.dumps(coco))
    converted = from_coco(path, real_data_dir / "raccoon" / "images")
    assert converted[:20] == subset
    assert converted[20].id == "raccoon-150"
    assert converted[20].objects == ()
    assert converted[20].ignore == (RecordObject("raccoon", (1.0, 1.0, 51.0, 51.0)),)
    jsonl = write_records(tmp_path / "coco.jsonl", converted)
    assert load_records(jsonl) == converted  # the ignore regions survive the JSONL round trip


def test_voc_and_coco_annotations_of_the_same_photos_agree(
    raccoon: list[Record], real_data_dir: Path, tmp_path: Path
) -> None:
    """The raccoon boxes annotated both ways: VOC xml, and a COCO json written from the source's
    csv the way VOC -> COCO converters write it (``x = xmin - 1``, ``w = xmax - xmin + 1``: VOC
    indices are 1-based and inclusive). Both conversions must give the same records."""
    root = real_data_dir / "raccoon"
    images: dict[str, dict[str, int | str]] = {}
    annotations: list[dict[str, object]] = []
    with (root / "data" / "raccoon_labels.csv").open() as f:
        for row in csv.DictReader(f):
            name, (width, height) = row["filename"], (int(row["width"]), int(row["height"]))
            image = {"id": len(images) + 1, "file_name": name, "width": width, "height": height}
            image_id = images.setdefault(name, image)["id"]
            xmin, ymin, xmax, ymax = (int(row[k]) for k in ("xmin", "ymin", "xmax", "ymax"))
            w, h = xmax - xmin + 1, ymax - ymin + 1
            box = {"bbox": [xmin - 1, ymin - 1, w, h], "area": w * h, "iscrowd": 0, "category_id": 1}
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, **box})
    coco = {
        "images": list(images.values()),
        "annotations": annotations,
        "categories": [{"id": 1, "name": "raccoon"}],
    }
    (tmp_path / "instances.json").write_text(json.dumps(coco))
    from_json = {r.id: r for r in from_coco(tmp_path / "instances.json", root / "images")}
    assert len(from_json) == len(raccoon) == 200
    for record in raccoon:
        assert sorted(o.bbox for o in from_json[record.id].objects) == sorted(o.bbox for o in record.objects)
        assert from_json[record.id].image_size == record.image_size


def test_coco_round_trip_on_real_yolo_records(
    aquarium: tuple[list[Record], list[str]], tmp_path: Path
) -> None:
    records = [r for r in aquarium[0] if "/valid/" in r.images[0]][:10]
    images_dir = Path(records[0].images[0]).parent
    coco = coco_from_records(records, category_ids={n: 2 * i + 1 for i, n in enumerate(AQUARIUM_NAMES)})
    (tmp_path / "instances.json").write_text(json.dumps(coco))
    converted = from_coco(tmp_path / "instances.json", images_dir)
    assert [(r.id, r.images, r.image_size) for r in converted] == [
        (r.id, r.images, r.image_size) for r in records
    ]
    for got, want in zip(converted, records, strict=True):
        assert [o.label for o in got.objects] == [o.label for o in want.objects]
        for a, b in zip(got.objects, want.objects, strict=True):
            assert a.bbox == pytest.approx(b.bbox, abs=1e-9)  # x + (x2 - x) may differ by one ulp


# ---------------------------------------------------------------------------- error paths (inline data)
def make_image(path: Path, size: tuple[int, int] = (40, 30)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size).save(path)
    return path


def voc_xml(filename: str, size: tuple[int, int], boxes: list[tuple[str, list[float]]]) -> str:
    objects = "".join(
        f"<object><name>{label}</name><difficult>0</difficult><bndbox><xmin>{b[0]}</xmin><ymin>{b[1]}</ymin>"
        f"<xmax>{b[2]}</xmax><ymax>{b[3]}</ymax></bndbox></object>"
        for label, b in boxes
    )
    return (
        f"<annotation><filename>{filename}</filename><size><width>{size[0]}</width>"
        f"<height>{size[1]}</height><depth>3</depth></size>{objects}</annotation>"
    )


def test_voc_size_must_match_the_real_image(tmp_path: Path) -> None:
    make_image(tmp_path / "images" / "a.jpg", (40, 30))
    (tmp_path / "annotations").mkdir()
    (tmp_path / "annotations" / "a.xml").write_text(voc_xml("a.jpg", (41, 30), [("cat", [1, 2, 3, 4])]))
    with pytest.raises(DataError, match=r"a\.xml: <size> says 41x30 but .*a\.jpg is 40x30"):
        from_voc(tmp_path)


def test_voc_box_errors_and_zero_area_drops(tmp_path: Path) -> None:
    make_image(tmp_path / "JPEGImages" / "a.jpg", (40, 30))
    (tmp_path / "Annotations").mkdir()
    xml = tmp_path / "Annotations" / "a.xml"
    boxes = [("cat", [1, 2, 3, 4]), ("dog", [5, 5, 4, 9]), ("bird", [7, 7, 7, 7])]
    xml.write_text(voc_xml("a.jpg", (40, 30), boxes))
    dropped: list[str] = []
    (record,) = from_voc(tmp_path, dropped=dropped)
    # 1-based inclusive: xmin == xmax is one pixel column, xmax == xmin - 1 covers none
    assert [o.bbox for o in record.objects] == [(0, 1, 3, 4), (6, 6, 7, 7)]
    assert dropped == [f"{xml}: object 1: dropped zero-area box [4.0, 4.0, 4.0, 9.0] ('dog')"]
    xml.write_text(voc_xml("a.jpg", (40, 30), [("cat", [1, 2, 45, 4])]))
    with pytest.raises(DataError, match=r"a\.xml: object 0: box .* outside the 40x30 image"):
        from_voc(tmp_path)
    xml.write_text(voc_xml("a.jpg", (40, 30), [("cat", [9, 2, 3, 4])]))
    with pytest.raises(DataError, match=r"a\.xml: object 0: degenerate box"):
        from_voc(tmp_path)
    with pytest.raises(DataError, match=r"none of the folders \['annotations', 'Annotations'\]"):
        from_voc(tmp_path / "JPEGImages")


def test_yolo_label_errors_name_file_and_line(tmp_path: Path) -> None:
    make_image(tmp_path / "images" / "a.jpg")
    make_image(tmp_path / "images" / "b.jpg")  # no label file: a background image
    (tmp_path / "labels").mkdir()
    label = tmp_path / "labels" / "a.txt"
    label.write_text("0 0.5 0.5 0.5 0.5\n\n1 0.25 0.5 0.5 1.0\n")
    a, b = from_yolo(tmp_path, ["cat", "dog"])
    assert a.objects[0].bbox == pytest.approx((10, 7.5, 30, 22.5))
    assert a.objects[1].bbox == pytest.approx((0, 0, 20, 30))
    assert b.objects == ()
    for text, expected in [
        ("0 0.5 0.5 0.5\n", r"a\.txt:1: expected 5 values"),
        ("0 0.1 0.5 0.5 0.5 0.2 0.3\n", r"a\.txt:1: expected 5 values .* segmentation"),
        ("0 0.5 0.5 0.5 0.5\n2 0.5 0.5 0.1 0.1\n", r"a\.txt:2: class 2 is not in names \(0\.\.1\)"),
        ("0 0.5 0.5 0.5 x\n", r"a\.txt:1: values must be an integer class and 4 numbers"),
        ("0 0.9 0.5 0.5 0.5\n", r"a\.txt:1: box .* outside the 40x30 image"),
    ]:
        label.write_text(text)
        with pytest.raises(DataError, match=expected):
            from_yolo(tmp_path, ["cat", "dog"])
    label.write_text("0 0.5 0.5 0.5 0.5\n")
    (tmp_path / "labels" / "c.txt").write_text("0 0.5 0.5 0.5 0.5\n")
    with pytest.raises(DataError, match=r"label files without an image: \['c\.txt'\]"):
        from_yolo(tmp_path, ["cat", "dog"])


def test_coco_errors_name_the_annotation(tmp_path: Path) -> None:
    make_image(tmp_path / "img" / "a.jpg", (40, 30))
    base = {
        "images": [{"id": 1, "file_name": "a.jpg", "width": 40, "height": 30}],
        "annotations": [{"id": 9, "image_id": 1, "category_id": 1, "bbox": [1, 2, 3, 4], "iscrowd": 0}],
        "categories": [{"id": 1, "name": "cat"}],
    }
    path = tmp_path / "instances.json"

    def convert(**changes: Any) -> list[Record]:
        path.write_text(json.dumps({**base, **changes}))
        return from_coco(path, tmp_path / "img")

    assert convert()[0].objects[0].bbox == (1, 2, 4, 6)
    with pytest.raises(DataError, match=r"image id 1 says 50x30 but .*a\.jpg is 40x30"):
        convert(images=[{"id": 1, "file_name": "a.jpg", "width": 50, "height": 30}])
    with pytest.raises(DataError, match=r"annotation id 9 .*category_id 3 is not in 'categories'"):
        convert(annotations=[{"id": 9, "image_id": 1, "category_id": 3, "bbox": [1, 2, 3, 4]}])
    with pytest.raises(DataError, match=r"annotation id 9 .*degenerate box"):
        convert(annotations=[{"id": 9, "image_id": 1, "category_id": 1, "bbox": [5, 2, -3, 4]}])
    with pytest.raises(DataError, match=r"has no 'bbox'"):
        convert(annotations=[{"id": 9, "image_id": 1, "category_id": 1}])
    with pytest.raises(DataError, match=r"not a COCO detection file, missing \['categories'\]"):
        path.write_text(json.dumps({"images": [], "annotations": []}))
        from_coco(path, tmp_path)
