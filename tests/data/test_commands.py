"""``rollmatch data shapes | convert | validate`` through the real CLI entry point (in-process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollmatch.cli import main
from rollmatch.data.records import load_records


def test_shapes_then_validate_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "shapes"
    assert main(["data", "shapes", "--out", str(out), "--train", "3", "--val", "1", "--size", "96"]) == 0
    printed = capsys.readouterr().out
    assert f"train: {out / 'train.jsonl'}" in printed
    assert f"val: {out / 'val.jsonl'}" in printed
    assert len(load_records(out / "train.jsonl")) == 3
    assert main(["data", "validate", str(out / "val.jsonl")]) == 0
    assert capsys.readouterr().out.strip() == f"{out / 'val.jsonl'}: ok"


def test_shapes_difficulty_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "shapes"
    argv = ["data", "shapes", "--out", str(out), "--train", "8", "--val", "0", "--max-objects", "1"]
    assert main([*argv, "--min-side", "100", "--max-side", "120", "--noise", "0"]) == 0
    records = load_records(out / "train.jsonl")
    assert all(len(r.objects) == 1 for r in records)
    assert all(100 <= r.objects[0].bbox[2] - r.objects[0].bbox[0] <= 120 for r in records)
    assert main([*argv, "--min-objects", "2"]) == 2  # min > max: one clear error, exit 2
    assert "min_objects = 2, max_objects = 1" in capsys.readouterr().err


def test_validate_prints_every_problem_and_exits_2(
    shapes_jsonl: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = shapes_jsonl["val"].read_text().splitlines()
    bad = json.loads(lines[1])
    bad["objects"] = [{"label": "", "bbox": [5, 5, 1, 9]}]
    path = tmp_path / "bad.jsonl"  # image paths are relative to the shapes folder: they go missing here
    path.write_text("\n".join([lines[0], json.dumps(bad), "{"]) + "\n")
    assert main(["data", "validate", str(path)]) == 2
    printed = capsys.readouterr().out.splitlines()
    assert (
        printed[0]
        == f"{path}:1: field 'images[0]': image file not found: {tmp_path / 'images' / 'val-00000.png'} (relative paths resolve against the JSONL's folder)"
    )
    assert printed[1].startswith(f"{path}:2: field 'images[0]': image file not found")
    assert printed[2].startswith(f"{path}:2: field 'objects[0].label'")
    assert printed[3].startswith(f"{path}:2: field 'objects[0].bbox': degenerate box [5, 5, 1, 9]")
    assert printed[4].startswith(f"{path}:3: not valid JSON")
    assert printed[5] == f"{path}: 5 problem(s)"


def test_convert_voc_writes_absolute_paths(
    real_data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "raccoon.jsonl"
    assert (
        main(
            ["data", "convert", "--format", "voc", "--src", str(real_data_dir / "raccoon"), "--out", str(out)]
        )
        == 0
    )
    labels = tmp_path / "raccoon.labels.json"
    assert capsys.readouterr().out.splitlines() == [
        f"wrote {out}: 200 images, 217 boxes; raccoon 217",
        f"wrote {labels}: 1 class names ({{labels}} in data.prompt lists them; docs/data.md)",
    ]
    assert json.loads(labels.read_text()) == ["raccoon"]
    first = json.loads(out.read_text().splitlines()[0])
    assert first["images"] == [str(real_data_dir / "raccoon" / "images" / "raccoon-1.jpg")]
    assert len(load_records(out)) == 200


def test_convert_yolo_reports_dropped_boxes(
    real_data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = real_data_dir / "aquarium_combined_v2"
    out = tmp_path / "aquarium_test.jsonl"
    argv = ["data", "convert", "--format", "yolo", "--src", str(root / "test"), "--out", str(out)]
    assert main(argv) == 2  # --names is required for yolo
    assert "--names is required for --format yolo" in capsys.readouterr().err
    assert main([*argv, "--names", str(root / "data.yaml")]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"wrote {out}: 63 images, 582 boxes; fish 249,")
    assert printed[1].startswith(f"wrote {tmp_path / 'aquarium_test.labels.json'}: 7 class names")
    assert "IMG_2423_jpeg_jpg.rf.1c0901882e71d5ebd26f036f4e22da65.txt:17: dropped zero-area box" in printed[2]
    assert printed[-1].startswith("dropped 2 zero-area box(es)")


def test_convert_coco_needs_images_and_names_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "x.jsonl"
    assert (
        main(["data", "convert", "--format", "coco", "--src", str(tmp_path / "i.json"), "--out", str(out)])
        == 2
    )
    assert "--images is required for --format coco" in capsys.readouterr().err
    argv = [
        "data",
        "convert",
        "--format",
        "coco",
        "--src",
        str(tmp_path / "i.json"),
        "--images",
        str(tmp_path),
    ]
    assert main([*argv, "--out", str(out)]) == 2
    assert f"COCO annotation file not found: {tmp_path / 'i.json'}" in capsys.readouterr().err
    assert not out.exists()
