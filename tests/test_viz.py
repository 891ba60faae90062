"""Pictures: the right colour on each kind of box edge, files written by `rollmatch viz` and `eval --pictures`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rollmatch.cli import main
from rollmatch.config.schema import MatchingConfig
from rollmatch.data.records import Record, RecordObject, write_records
from rollmatch.errors import DataError
from rollmatch.viz import FALSE_POSITIVE, HALO, MATCHED, MATCHED_GT, MISSED, draw_detections, render_pictures

BACKGROUND = (90, 90, 90)
GT_MATCHED = RecordObject("red square", (10.0, 60.0, 40.0, 90.0))
GT_MISSED = RecordObject("blue circle", (60.0, 60.0, 95.0, 95.0))
PRED_MATCHED = RecordObject("red square", (12.0, 60.0, 40.0, 92.0))  # IoU 0.875 with GT_MATCHED
PRED_FP = RecordObject("fish", (60.0, 5.0, 95.0, 40.0))  # overlaps no GT


def picture_pixels() -> np.ndarray:
    image = Image.new("RGB", (100, 100), BACKGROUND)
    picture = draw_detections(
        image, [GT_MATCHED, GT_MISSED], [PRED_FP, PRED_MATCHED], record_id="r", longest_side=100
    )
    assert (picture.tp, picture.fp, picture.fn) == (1, 1, 1)
    assert picture.image.size == (100, 100)
    return np.asarray(picture.image)


def colour(pixels: np.ndarray, x: int, y: int) -> tuple[int, ...]:
    return tuple(int(v) for v in pixels[y, x])


def test_each_kind_of_box_has_its_colour_on_its_edges() -> None:
    pixels = picture_pixels()
    # matched prediction: solid green on its left (x=12) and right (x2 exclusive -> x=39) edges
    assert colour(pixels, 12, 85) == MATCHED
    assert colour(pixels, 39, 85) == MATCHED
    # its ground truth: thin white line just left of the prediction
    assert colour(pixels, 10, 85) == MATCHED_GT
    # false positive: solid red on its left edge and bottom edge (the label tag sits inside its top)
    assert colour(pixels, 60, 32) == FALSE_POSITIVE
    assert colour(pixels, 59, 32) == HALO  # dark halo: visible on a shape of the box's colour
    assert colour(pixels, 80, 39) == FALSE_POSITIVE
    # missed GT: dashed yellow (some pixels on its bottom edge, with background gaps between)
    bottom = [colour(pixels, x, 94) for x in range(61, 94)]
    assert bottom.count(MISSED) >= 10
    assert bottom.count(BACKGROUND) >= 5
    right = [colour(pixels, 94, y) for y in range(61, 94)]
    assert right.count(MISSED) >= 10 and right.count(BACKGROUND) >= 5
    # inside the boxes nothing is drawn
    assert colour(pixels, 25, 80) == BACKGROUND
    assert colour(pixels, 78, 80) == BACKGROUND


def test_pictures_match_with_the_evaluations_matching_settings() -> None:
    """A box in the right place with another label: matched when labels are ignored, a false positive
    plus a miss under ``label_mode: require`` (the default), or when the IoU threshold is above it."""
    image = Image.new("RGB", (100, 100), BACKGROUND)
    relabelled = RecordObject("fish", PRED_MATCHED.bbox)
    counts = {}
    for name, matching in (
        ("ignore", MatchingConfig(label_mode="ignore")),
        ("default", None),
        ("iou 0.9", MatchingConfig(iou_threshold=0.9, label_mode="ignore")),
    ):
        picture = draw_detections(image, [GT_MATCHED], [relabelled], longest_side=100, matching=matching)
        counts[name] = (picture.tp, picture.fp, picture.fn)
        edge = colour(np.asarray(picture.image), 12, 85)
        assert edge == (MATCHED if name == "ignore" else FALSE_POSITIVE), name
    assert counts == {"ignore": (1, 0, 0), "default": (0, 1, 1), "iou 0.9": (0, 1, 1)}


def test_boxes_scale_with_the_picture_size() -> None:
    image = Image.new("RGB", (50, 50), BACKGROUND)
    half = [RecordObject(o.label, tuple(v / 2 for v in o.bbox)) for o in (PRED_MATCHED,)]  # type: ignore[misc]
    picture = draw_detections(image, [], half, longest_side=100)
    pixels = np.asarray(picture.image)
    assert colour(pixels, 12, 85) == FALSE_POSITIVE  # no GT: the prediction is a false positive


def write_case(tmp_path: Path) -> tuple[Path, Path]:
    image_path = tmp_path / "img.png"
    Image.new("RGB", (100, 100), BACKGROUND).save(image_path)
    records = [
        Record(
            id=f"img/{i}", images=(str(image_path),), width=100, height=100, objects=(GT_MATCHED, GT_MISSED)
        )
        for i in range(3)
    ]
    data = write_records(tmp_path / "val.jsonl", records)
    objects = [{"label": o.label, "bbox": list(o.bbox)} for o in (PRED_FP, PRED_MATCHED)]
    predictions = tmp_path / "preds.jsonl"
    predictions.write_text(
        "".join(json.dumps({"id": f"img/{i}", "objects": objects}) + "\n" for i in range(2))
    )
    return data, predictions


def test_viz_command_writes_one_picture_per_predicted_image_and_a_grid(tmp_path: Path) -> None:
    data, predictions = write_case(tmp_path)
    out = tmp_path / "pictures"
    assert main(["viz", "--data", str(data), "--predictions", str(predictions), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["grid.png", "img_0.png", "img_1.png"]
    drawn = np.asarray(Image.open(out / "img_0.png").convert("RGB"))
    scale = 448 / 100
    assert colour(drawn, round(12 * scale), round(85 * scale)) == MATCHED
    grid = Image.open(out / "grid.png")
    assert grid.width >= 2 * 320 and grid.height >= 320


def test_predictions_for_unknown_ids_are_an_error(tmp_path: Path) -> None:
    _, predictions = write_case(tmp_path)
    predictions.write_text(json.dumps({"id": "nope", "objects": []}) + "\n")
    with pytest.raises(DataError, match="ids not in the data"):
        render_pictures([], predictions, tmp_path / "out")


@pytest.mark.heavy
def test_eval_pictures_draws_the_first_n_images(tiny_model_dir: Path, tmp_path: Path) -> None:
    from rollmatch.data.shapes import generate_shapes

    data = generate_shapes(tmp_path / "shapes", n_train=1, n_val=3, size=112, seed=0)["val"]
    predictions = tmp_path / "eval" / "preds.jsonl"
    argv = ["eval", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(predictions)]
    argv += ["--backend", "hf", "--pictures", "2", "custom.extra.rollout_matching.max_new_tokens=8"]
    assert main(argv) == 0
    pictures = tmp_path / "eval" / "pictures"
    assert sorted(p.name for p in pictures.iterdir()) == ["grid.png", "val-00000.png", "val-00001.png"]


def test_a_note_is_written_under_the_picture_and_parse_note_says_what_the_parse_lost() -> None:
    from rollmatch.viz import parse_note

    image = Image.new("RGB", (100, 100), BACKGROUND)
    plain = draw_detections(image, [GT_MATCHED], [PRED_MATCHED], longest_side=100)
    noted = draw_detections(image, [GT_MATCHED], [PRED_MATCHED], longest_side=100, note=["a", "b" * 200])
    assert noted.image.width == plain.image.width and noted.image.height > plain.image.height
    assert np.array_equal(np.asarray(noted.image)[:100], np.asarray(plain.image))  # the picture is unchanged
    assert parse_note({}, False) is None
    assert parse_note({"bad_json": 2, "degenerate_box": 0}, True) == "truncated, bad_json x2"
