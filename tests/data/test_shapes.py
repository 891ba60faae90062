"""The synthetic shapes set: valid records, tight boxes, object counts and sizes, determinism."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rollmatch.data.records import Record, load_image, load_records, validate_records
from rollmatch.data.shapes import SHAPE_CLASSES, ShapesDifficulty, generate_shapes, shape_sample
from rollmatch.errors import DataError

COLOURS = {c.label: np.array(c.rgb, dtype=np.uint8) for c in SHAPE_CLASSES}


@pytest.fixture(scope="module")
def shapes(shapes_jsonl: dict[str, Path]) -> dict[str, list[Record]]:
    return {split: load_records(path) for split, path in shapes_jsonl.items()}


def test_fixture_layout_and_records_are_valid(
    shapes_jsonl: dict[str, Path], shapes: dict[str, list[Record]]
) -> None:
    assert set(shapes_jsonl) == {"train", "val"}
    assert validate_records(shapes_jsonl["train"]) == []
    assert validate_records(shapes_jsonl["val"]) == []
    assert [r.id for r in shapes["train"]] == [f"train-{i:05d}" for i in range(16)]
    assert [r.id for r in shapes["val"]] == [f"val-{i:05d}" for i in range(4)]
    first_line = shapes_jsonl["train"].read_text().splitlines()[0]
    assert '"images": ["images/train-00000.png"]' in first_line  # relative: the folder is relocatable
    assert len(SHAPE_CLASSES) == len({c.label for c in SHAPE_CLASSES}) == 6


def test_objects_counts_sizes_labels_and_order(shapes: dict[str, list[Record]]) -> None:
    records = shapes["train"] + shapes["val"]
    counts = [len(r.objects) for r in records]
    assert min(counts) >= 1
    assert max(counts) <= 6
    assert len(set(counts)) >= 3  # not a constant count
    labels = {o.label for r in records for o in r.objects}
    assert labels <= set(COLOURS)
    assert len(labels) >= 5
    for record in records:
        assert record.image_size == (224, 224)
        for obj in record.objects:
            x1, y1, x2, y2 = obj.bbox
            assert 30 <= x2 - x1 <= 90, (record.id, obj)
            assert 30 <= y2 - y1 <= 90, (record.id, obj)
        assert [o.bbox[:2][::-1] for o in record.objects] == sorted(o.bbox[:2][::-1] for o in record.objects)


def test_files_hold_exactly_the_samples_of_shape_sample(shapes: dict[str, list[Record]]) -> None:
    for split, records in shapes.items():
        for index in (0, len(records) - 1):
            image, objects = shape_sample(index, split=split, seed=0)  # type: ignore[arg-type]
            assert tuple(objects) == records[index].objects
            assert np.array_equal(np.asarray(image), np.asarray(load_image(records[index].images[0])))


def _touches(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return a[0] <= b[2] and b[0] <= a[2] and a[1] <= b[3] and b[1] <= a[3]


def test_boxes_are_the_exact_extent_of_each_visible_shape() -> None:
    """On noise-free renders, each box holds pixels of exactly its colour on all four border lines
    and none just outside (shapes never cover each other, so nothing is occluded). A box touching
    another box of the same class is skipped: their pixels cannot be told apart by colour."""
    checked = 0
    for index in range(10):
        image, objects = shape_sample(index, seed=3, noise_std=0)
        padded = np.pad(np.asarray(image), ((1, 1), (1, 1), (0, 0)))  # black frame: no shape is black
        for obj in objects:
            if any(o is not obj and o.label == obj.label and _touches(o.bbox, obj.bbox) for o in objects):
                continue
            x1, y1, x2, y2 = (int(v) + 1 for v in obj.bbox)  # in padded coordinates
            exact = (padded == COLOURS[obj.label]).all(axis=-1)
            own = exact[y1:y2, x1:x2]
            assert own[0].any() and own[-1].any() and own[:, 0].any() and own[:, -1].any(), obj
            assert own.sum() >= 0.4 * own.size, obj  # a filled shape, not a few stray pixels
            assert not exact[y1 - 1, x1 - 1 : x2 + 1].any(), (obj, "above")
            assert not exact[y2, x1 - 1 : x2 + 1].any(), (obj, "below")
            assert not exact[y1 - 1 : y2 + 1, x1 - 1].any(), (obj, "left")
            assert not exact[y1 - 1 : y2 + 1, x2].any(), (obj, "right")
            checked += 1
        noisy, noisy_objects = shape_sample(index, seed=3)
        assert noisy_objects == objects
        assert not np.array_equal(np.asarray(noisy), np.asarray(image))
    assert checked >= 25


def test_backgrounds_are_noisy(shapes: dict[str, list[Record]]) -> None:
    pixels = np.asarray(load_image(shapes["train"][0].images[0]), dtype=np.float64)
    # Neighbouring-pixel differences are large on noise, ~0 on a flat or smooth background.
    assert np.abs(np.diff(pixels, axis=1)).mean() > 8


def test_same_seed_is_byte_identical_and_growing_keeps_earlier_images(tmp_path: Path) -> None:
    a = generate_shapes(tmp_path / "a", n_train=3, n_val=0, size=96, seed=5)
    b = generate_shapes(tmp_path / "b", n_train=5, n_val=0, size=96, seed=5)
    c = generate_shapes(tmp_path / "c", n_train=3, n_val=0, size=96, seed=6)
    assert set(a) == {"train"}
    a_lines, b_lines = a["train"].read_text().splitlines(), b["train"].read_text().splitlines()
    assert a_lines == b_lines[:3]
    for i in range(3):
        name = f"images/train-{i:05d}.png"
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert c["train"].read_text() != a["train"].read_text()
    again = generate_shapes(tmp_path / "a", n_train=3, n_val=0, size=96, seed=5)
    assert again["train"].read_text().splitlines() == a_lines


def test_sides_scale_with_image_size(tmp_path: Path) -> None:
    records = load_records(generate_shapes(tmp_path, n_train=6, n_val=0, size=112, seed=1)["train"])
    sides = [o.bbox[2] - o.bbox[0] for r in records for o in r.objects]
    assert min(sides) >= 15
    assert max(sides) <= 45
    assert all(r.image_size == (112, 112) for r in records)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_train": 0}, "n_train = 0"),
        ({"n_val": -1}, "n_val = -1"),
        ({"size": 32}, "size = 32: use an integer >= 64"),
        ({"seed": -2}, "seed = -2"),
    ],
)
def test_bad_arguments_are_data_errors(tmp_path: Path, kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(DataError, match=message):
        generate_shapes(tmp_path, **kwargs)


def test_difficulty_knobs_bound_counts_and_sides(tmp_path: Path) -> None:
    easy = ShapesDifficulty(min_objects=1, max_objects=2, min_side=60, max_side=110, noise_std=0.0)
    records = load_records(
        generate_shapes(tmp_path, n_train=30, n_val=0, size=112, seed=2, difficulty=easy)["train"]
    )
    counts = [len(r.objects) for r in records]
    assert set(counts) == {1, 2}
    sides = [o.bbox[2] - o.bbox[0] for r in records for o in r.objects]
    assert min(sides) >= 30 and max(sides) <= 55  # 60-110 px at 224, scaled to 112
    pixels = np.asarray(load_image(records[0].images[0]), dtype=np.float64)
    assert np.abs(np.diff(pixels, axis=1)).mean() < 3  # noise_std 0: smooth background


def test_default_difficulty_is_the_shipped_set() -> None:
    image, objects = shape_sample(4, seed=0)
    same_image, same_objects = shape_sample(4, seed=0, difficulty=ShapesDifficulty())
    assert objects == same_objects
    assert np.array_equal(np.asarray(image), np.asarray(same_image))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_objects": 0}, "min_objects = 0"),
        ({"min_objects": 3, "max_objects": 2}, "min_objects = 3, max_objects = 2"),
        ({"min_side": 100, "max_side": 50}, "min_side = 100, max_side = 50"),
        ({"max_side": 300}, "max_side = 300"),
        ({"noise_std": -1.0}, "noise_std = -1.0"),
    ],
)
def test_bad_difficulty_is_a_data_error(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(DataError, match=message):
        ShapesDifficulty(**kwargs)  # type: ignore[arg-type]
