"""Class names in the prompt: where the list comes from, how a large vocabulary fits one prompt
(the record's own labels plus seeded negatives), and the prompt the encoder builds with them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollmatch.config.schema import DataConfig
from rollmatch.data.labels import (
    PromptLabels,
    labels_file_for,
    read_label_file,
    resolve_labels,
    write_label_file,
)
from rollmatch.errors import ConfigError

PROMPT = "Detect every object of these classes: {labels}. Answer with a JSON list."


def test_the_list_beside_the_jsonl_is_found_and_a_missing_one_names_the_key(tmp_path: Path) -> None:
    train = tmp_path / "train.jsonl"
    assert labels_file_for(train) == tmp_path / "train.labels.json"
    data = DataConfig(train_jsonl=str(train), prompt=PROMPT)
    with pytest.raises(ConfigError, match=r"data\.labels.*train\.labels\.json"):
        resolve_labels(data)
    write_label_file(labels_file_for(train), ["person", "couch", "person"])
    assert resolve_labels(data) == ["person", "couch"]  # duplicates written once
    assert resolve_labels(DataConfig(prompt="no placeholder")) is None


def test_labels_inline_or_as_a_text_file(tmp_path: Path) -> None:
    names = tmp_path / "names.txt"
    names.write_text("cat\n\ndog\n")
    assert resolve_labels(DataConfig(labels=str(names))) == ["cat", "dog"]
    assert resolve_labels(DataConfig(labels=["a", "b"])) == ["a", "b"]
    with pytest.raises(ConfigError, match="listed twice"):
        resolve_labels(DataConfig(labels=["a", "a"]))
    with pytest.raises(ConfigError, match="no such label file"):
        read_label_file(tmp_path / "absent.json")


def test_a_large_vocabulary_lists_the_records_labels_plus_seeded_negatives() -> None:
    vocabulary = PromptLabels(tuple(f"class {i}" for i in range(1203)), max_labels=40, seed=7)
    own = ["class 5", "class 900"]
    listed = vocabulary.for_record("img-1", own)
    assert len(listed) == 40 and set(own) <= set(listed) and len(set(listed)) == 40
    assert vocabulary.for_record("img-1", own) == listed  # deterministic per record and seed
    assert vocabulary.for_record("img-2", own) != listed
    assert PromptLabels(vocabulary.names, 40, seed=8).for_record("img-1", own) != listed
    small = PromptLabels(("a", "b"), max_labels=40)
    assert small.fill(PROMPT, "x", []) == PROMPT.replace("{labels}", "a, b")


def test_the_encoder_fills_the_prompt(tiny_model_dir: Path, tmp_path: Path) -> None:
    from rollmatch.data.prompts import PromptEncoder
    from rollmatch.data.records import Record

    data = DataConfig(prompt=PROMPT, labels=["couch", "person"], coord_frame="norm1000")
    encoder = PromptEncoder.from_pretrained(tiny_model_dir, data)
    record = Record(id="r", images=(str(tmp_path / "x.png"),), width=8, height=8)
    (text,) = [c["text"] for c in encoder.messages(record)[0]["content"] if c["type"] == "text"]
    assert text == "Detect every object of these classes: couch, person. Answer with a JSON list."
    with pytest.raises(ConfigError, match=r"data\.labels"):
        PromptEncoder.from_pretrained(
            tiny_model_dir, DataConfig(prompt=PROMPT, train_jsonl=str(tmp_path / "t.jsonl"))
        )


def test_data_convert_writes_the_class_names_beside_the_jsonl(tmp_path: Path) -> None:
    from PIL import Image

    from rollmatch.cli import main

    Image.new("RGB", (64, 48)).save(tmp_path / "a.jpg")
    coco = {
        "images": [{"id": 1, "file_name": "a.jpg", "width": 64, "height": 48}],
        "annotations": [{"id": 1, "image_id": 1, "category_id": 3, "bbox": [4, 4, 20, 20], "iscrowd": 0}],
        "categories": [{"id": 3, "name": "couch"}, {"id": 1, "name": "person"}, {"id": 2, "name": "dog"}],
    }
    (tmp_path / "ann.json").write_text(json.dumps(coco))
    out = tmp_path / "train.jsonl"
    assert (
        main(
            [
                "data",
                "convert",
                "--format",
                "coco",
                "--src",
                str(tmp_path / "ann.json"),
                "--images",
                str(tmp_path),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    # every category, in id order, also those without a box in this file
    assert json.loads((tmp_path / "train.labels.json").read_text()) == ["person", "dog", "couch"]
