"""LVIS and referring-expression converters on small files written here in the releases' formats,
and the per-record ``prompt`` field they produce (loaded back, then used by the prompt encoder)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from rollmatch.cli import main
from rollmatch.data.convert_lvis import from_lvis, lvis_label
from rollmatch.data.convert_refexp import REFEXP_PROMPT, from_refexp, read_refs
from rollmatch.data.records import load_records, validate_records, write_records
from rollmatch.errors import DataError


def _image(path: Path, size: tuple[int, int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (90, 120, 30)).save(path)


# --------------------------------------------------------------------------------------------- LVIS
def _lvis_json(tmp_path: Path) -> Path:
    """An LVIS v1 file: images by ``coco_url`` from both COCO splits, federated fields, synset names."""
    _image(tmp_path / "coco" / "val2017" / "000000000139.jpg", (64, 48))
    _image(tmp_path / "coco" / "train2017" / "000000000009.jpg", (40, 30))
    data: dict[str, Any] = {
        "info": {"version": "v1"},
        "licenses": [],
        "categories": [
            {"id": 1, "name": "aerosol_can", "synonyms": ["aerosol_can", "spray_can"], "frequency": "c"},
            {"id": 2, "name": "bow_(weapon)", "synonyms": ["bow_(weapon)"], "frequency": "r"},
        ],
        "images": [
            {
                "id": 139,
                "width": 64,
                "height": 48,
                "coco_url": "http://images.cocodataset.org/val2017/000000000139.jpg",
                "not_exhaustive_category_ids": [2],
                "neg_category_ids": [1],
            },
            {
                "id": 9,
                "width": 40,
                "height": 30,
                "coco_url": "http://images.cocodataset.org/train2017/000000000009.jpg",
                "not_exhaustive_category_ids": [],
                "neg_category_ids": [],
            },
        ],
        "annotations": [
            {"id": 1, "image_id": 139, "category_id": 1, "bbox": [2.5, 3.0, 10.0, 20.0], "area": 200.0},
            {"id": 2, "image_id": 139, "category_id": 2, "bbox": [30, 10, 34.2, 38.0], "area": 9.0},
            {"id": 3, "image_id": 139, "category_id": 2, "bbox": [5, 5, 0, 4], "area": 0.0},
        ],
    }
    path = tmp_path / "lvis_v1_val.json"
    path.write_text(json.dumps(data))
    return path


def test_lvis_converts_urls_synsets_and_reports_federated_categories(tmp_path: Path) -> None:
    src = _lvis_json(tmp_path)
    dropped: list[str] = []
    stats: dict[str, int] = {}
    records = from_lvis(src, tmp_path / "coco", dropped=dropped, stats=stats)
    assert [r.id for r in records] == ["139", "9"]
    assert records[0].images[0].endswith("val2017/000000000139.jpg")
    assert records[1].images[0].endswith("train2017/000000000009.jpg")
    assert [(o.label, o.bbox) for o in records[0].objects] == [
        ("aerosol can", (2.5, 3.0, 12.5, 23.0)),
        ("bow (weapon)", (30.0, 10.0, 64.0, 48.0)),  # 64.2 clipped (within 1 px)
    ]
    assert records[1].objects == ()
    assert len(dropped) == 1 and "annotation id 3" in dropped[0]
    assert stats == {"not_exhaustive_images": 1, "not_exhaustive_boxes": 2}
    out = write_records(tmp_path / "lvis.jsonl", records)
    assert validate_records(out) == []


def test_lvis_names_the_missing_image_and_the_folder_to_pass(tmp_path: Path) -> None:
    src = _lvis_json(tmp_path)
    (tmp_path / "coco" / "train2017" / "000000000009.jpg").unlink()
    with pytest.raises(DataError, match=r"image id 9: none of .*train2017/000000000009.jpg.* --images"):
        from_lvis(src, tmp_path / "coco")


def test_lvis_label_turns_underscores_into_words() -> None:
    assert lvis_label("teddy_bear") == "teddy bear"
    assert lvis_label("apple") == "apple"


# ------------------------------------------------------------------------------------------ refexp
def _refcoco(tmp_path: Path) -> tuple[Path, Path, Path]:
    """RefCOCO's refs (the cleaned ref format, as JSON) and its instances.json."""
    images = tmp_path / "train2014"
    _image(images / "COCO_train2014_000000581857.jpg", (80, 60))
    instances = {
        "images": [{"id": 581857, "file_name": "COCO_train2014_000000581857.jpg", "width": 80, "height": 60}],
        "annotations": [
            {"id": 1719310, "image_id": 581857, "category_id": 1, "bbox": [10.5, 4.0, 20.0, 30.0]},
            {"id": 1719311, "image_id": 581857, "category_id": 1, "bbox": [40.0, 4.0, 30.0, 50.0]},
        ],
        "categories": [{"id": 1, "name": "person", "supercategory": "person"}],
    }
    refs = [
        {
            "ref_id": 0,
            "image_id": 581857,
            "ann_id": 1719310,
            "category_id": 1,
            "split": "train",
            "file_name": "COCO_train2014_000000581857_1719310.jpg",
            "sent_ids": [0, 1],
            "sentences": [
                {
                    "sent_id": 0,
                    "sent": "woman in red",
                    "raw": "Woman in red.",
                    "tokens": ["woman", "in", "red"],
                },
                {"sent_id": 1, "sent": "left lady", "raw": "left lady", "tokens": ["left", "lady"]},
            ],
        },
        {
            "ref_id": 1,
            "image_id": 581857,
            "ann_id": 1719311,
            "category_id": 1,
            "split": "testA",
            "file_name": "COCO_train2014_000000581857_1719311.jpg",
            "sent_ids": [2],
            "sentences": [{"sent_id": 2, "sent": "man on right", "raw": "man on right", "tokens": []}],
        },
    ]
    (tmp_path / "instances.json").write_text(json.dumps(instances))
    (tmp_path / "refs.json").write_text(json.dumps(refs))
    return tmp_path / "refs.json", tmp_path / "instances.json", images


def test_refexp_makes_one_record_per_sentence_with_its_prompt(tmp_path: Path) -> None:
    refs, instances, images = _refcoco(tmp_path)
    records = from_refexp(refs, instances, images, split="train")
    assert [r.id for r in records] == ["0-0", "0-1"]
    assert [[(o.label, o.bbox) for o in r.objects] for r in records] == [
        [("woman in red", (10.5, 4.0, 30.5, 34.0))],
        [("left lady", (10.5, 4.0, 30.5, 34.0))],
    ]
    assert records[0].prompt == REFEXP_PROMPT.replace("{phrase}", "woman in red")
    assert len(from_refexp(refs, instances, images)) == 3
    out = write_records(tmp_path / "ref.jsonl", records, relative_to=tmp_path)
    assert validate_records(out) == []
    assert load_records(out)[1].prompt == records[1].prompt


def test_refexp_errors_name_the_ref_and_the_fix(tmp_path: Path) -> None:
    refs, instances, images = _refcoco(tmp_path)
    with pytest.raises(DataError, match="no ref has split 'val'"):
        from_refexp(refs, instances, images, split="val")
    with pytest.raises(DataError, match=r"has no \{phrase\}"):
        from_refexp(refs, instances, images, prompt_template="Find it.")
    data = json.loads(refs.read_text())
    data[1]["ann_id"] = 5
    refs.write_text(json.dumps(data))
    with pytest.raises(DataError, match="ref_id 1: ann_id 5 is not in"):
        from_refexp(refs, instances, images)
    refs.write_text(json.dumps([{"ref_id": 3}]))
    with pytest.raises(DataError, match=r"ref #0 lacks \['image_id', 'ann_id', 'sentences'\]"):
        read_refs(refs)


def test_refexp_reads_the_parquet_release(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    refs, instances, images = _refcoco(tmp_path)
    pq.write_table(pa.Table.from_pylist(json.loads(refs.read_text())), tmp_path / "refs.parquet")
    records = from_refexp(tmp_path / "refs.parquet", instances, images)
    assert [r.id for r in records] == ["0-0", "0-1", "1-2"]


def test_cli_converts_refexp_and_lvis(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refs, instances, images = _refcoco(tmp_path)
    out = tmp_path / "ref.jsonl"
    argv = ["data", "convert", "--format", "refexp", "--src", str(refs), "--instances", str(instances)]
    assert main([*argv, "--images", str(images), "--split", "testA", "--out", str(out)]) == 0
    assert [r.id for r in load_records(out)] == ["1-2"]
    lvis = _lvis_json(tmp_path)
    out = tmp_path / "lvis.jsonl"
    argv = ["data", "convert", "--format", "lvis", "--src", str(lvis), "--images", str(tmp_path / "coco")]
    assert main([*argv, "--out", str(out)]) == 0
    assert "1 image(s) have not-exhaustively annotated categories (2 box(es)" in capsys.readouterr().out


# ------------------------------------------------------------------------------------ record prompt
def test_record_prompt_must_be_a_non_empty_string(tmp_path: Path) -> None:
    _image(tmp_path / "a.png", (10, 10))
    line = {"id": "a", "images": ["a.png"], "width": 10, "height": 10, "objects": [], "prompt": ""}
    (tmp_path / "r.jsonl").write_text(json.dumps(line) + "\n")
    with pytest.raises(DataError, match="field 'prompt': must be a non-empty string"):
        load_records(tmp_path / "r.jsonl")


def test_record_prompt_replaces_data_prompt_in_the_chat(tmp_path: Path, tiny_model_dir: Path) -> None:
    from rollmatch.config.schema import DataConfig
    from rollmatch.data.prompts import PromptEncoder

    _image(tmp_path / "a.png", (32, 32))
    lines = [
        {
            "id": "a",
            "images": ["a.png"],
            "width": 32,
            "height": 32,
            "objects": [],
            "prompt": "Locate the cat.",
        },
        {"id": "b", "images": ["a.png"], "width": 32, "height": 32, "objects": []},
    ]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    with_prompt, without = load_records(tmp_path / "r.jsonl")
    encoder = PromptEncoder.from_pretrained(tiny_model_dir, DataConfig())
    assert encoder.messages(with_prompt)[0]["content"][-1]["text"] == "Locate the cat."
    assert encoder.messages(without)[0]["content"][-1]["text"] == DataConfig().prompt
    decoded = encoder.tokenizer.decode(encoder.encode(with_prompt).input_ids)
    assert "Locate the cat." in decoded and DataConfig().prompt not in decoded
