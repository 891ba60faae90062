"""A new user's whole road on CPU with tiny stand-ins: a COCO-format file (with a crowd box) converted
(class names written beside the JSONL) -> an Instruct-like start model, which answers in a ```json fence
with its own words for the classes: preflight stops it and names both -> stage-1 SFT on the project's
format with the class names in the prompt -> preflight passes -> Stage-2 rollout matching ->
``eval --model final/`` without ``--config`` scores what eval with the config scores -> ``export`` ->
the exported folder loads in transformers and decodes the same boxes on HF and vLLM, with no machine
path in it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rollmatch.cli import main
from rollmatch.config.load import load_config
from rollmatch.data.labels import labels_file_for
from rollmatch.data.records import load_records
from rollmatch.data.shapes import ShapesDifficulty, generate_shapes
from rollmatch.rollout.vllm_settings import vllm_installed
from rollmatch.training.entry import run_training

pytestmark = pytest.mark.heavy

PROMPT = 'Detect every {labels} in the image. Answer with a JSON list of {"bbox_2d": [x1, y1, x2, y2], "label": "..."}.'


def coco_with_a_crowd_box(shapes: Path, split: str, out: Path) -> Path:
    """The shapes split as a COCO annotation file, plus one crowd region on the first image."""
    records = [json.loads(line) for line in (shapes / f"{split}.jsonl").read_text().splitlines()]
    names = sorted({o["label"] for r in records for o in r["objects"]})
    ids = {name: i + 1 for i, name in enumerate(names)}
    images, annotations = [], []
    for n, record in enumerate(records, start=1):
        images.append(
            {"id": n, "file_name": record["images"][0], "width": record["width"], "height": record["height"]}
        )
        for obj in record["objects"]:
            x1, y1, x2, y2 = obj["bbox"]
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": n,
                    "category_id": ids[obj["label"]],
                    "bbox": [x1, y1, x2 - x1, y2 - y1],
                    "area": (x2 - x1) * (y2 - y1),
                    "iscrowd": 0,
                }
            )
    annotations.append(
        {
            "id": len(annotations) + 1,
            "image_id": 1,
            "category_id": 1,
            "bbox": [0, 0, 40, 40],
            "area": 1600,
            "iscrowd": 1,
        }
    )
    categories = [{"id": i, "name": name} for name, i in ids.items()]
    out.write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    return out


def train_instruct_stand_in(base: Path, cfg: Any, out: Path, steps: int) -> Path:
    """The tiny model taught to answer like an Instruct checkpoint: a ```json fence around the list,
    synonyms ("a red square shape") for the dataset's class names."""
    from transformers import AutoModelForImageTextToText

    from rollmatch.data.prompts import PromptEncoder

    encoder = PromptEncoder.from_pretrained(base, cfg.data)
    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
    examples = []
    for record in load_records(cfg.data.train_jsonl):
        encoded = encoder.encode(record)
        answer = [
            {"bbox_2d": list(o.bbox), "label": f"a {o.label} shape"}
            for o in encoder.gt_objects(record, encoded)
        ]
        text = "```json\n" + json.dumps(answer) + "\n```"
        examples.append(
            (encoded, [*encoder.tokenizer.encode(text, add_special_tokens=False), encoder.eos_token_id])
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for step in range(steps):
        encoded, answer_ids = examples[step % len(examples)]
        inputs = encoded.model_inputs()
        n = len(answer_ids)
        inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([answer_ids])], dim=1)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        inputs["mm_token_type_ids"] = torch.cat(
            [inputs["mm_token_type_ids"], torch.zeros(1, n, dtype=torch.long)], dim=1
        )
        labels = inputs["input_ids"].clone()
        labels[:, :-n] = -100
        model(**inputs, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out)
    encoder.processor.save_pretrained(out)
    return out


def json_of(capsys: pytest.CaptureFixture[str], argv: list[str], code: int = 0) -> dict:
    capsys.readouterr()
    assert main(argv) == code, capsys.readouterr().err[-3000:]
    out = capsys.readouterr().out
    return json.loads(out[out.index("{") : out.rindex("}") + 1])


def boxes(predictions: Path) -> list[list[dict]]:
    return [json.loads(line)["objects"] for line in predictions.read_text().splitlines()]


def test_from_an_instruct_checkpoint_and_coco_to_an_exported_detector(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shapes = generate_shapes(
        tmp_path / "shapes",
        n_train=8,
        n_val=4,
        size=112,
        seed=0,
        difficulty=ShapesDifficulty(min_objects=1, max_objects=1, min_side=30, max_side=60),
    )
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "val"):  # the crowd box does not make the conversion fail
        src = coco_with_a_crowd_box(shapes["train"].parent, split, tmp_path / f"{split}_coco.json")
        assert (
            main(
                [
                    "data",
                    "convert",
                    "--format",
                    "coco",
                    "--src",
                    str(src),
                    "--images",
                    str(shapes["train"].parent),
                    "--out",
                    str(data / f"{split}.jsonl"),
                ]
            )
            == 0
        )
    names = json.loads(labels_file_for(data / "train.jsonl").read_text())
    assert len(names) >= 2

    config = tmp_path / "stage2.yaml"
    config.write_text(
        json.dumps(
            {  # JSON is YAML
                "model": {"path": str(tiny_model_dir)},
                "data": {
                    "train_jsonl": str(data / "train.jsonl"),
                    "val_jsonl": str(data / "val.jsonl"),
                    "prompt": PROMPT,
                    "coord_frame": "norm1000",
                },
                "custom": {
                    "trainer_variant": "rollout_matching_sft",
                    "extra": {
                        "rollout_matching": {
                            "rollout_backend": "hf",
                            "max_new_tokens": 96,
                            "vllm": {
                                "enforce_eager": True,
                                "kv_cache_space_gib": 0.25,
                                "max_model_len": 1024,
                            },
                        }
                    },
                },
                "preflight": {"records": 8},
                "training": {
                    "output_dir": str(tmp_path / "stage2"),
                    "per_device_train_batch_size": 4,
                    "max_steps": 2,
                    "learning_rate": 1e-4,
                    "report_to": [],
                    "save_steps": 1000,
                    "packing": True,
                    "global_max_length": 1024,
                },
            }
        )
    )
    cfg = load_config(config)

    # The Instruct-like start model: preflight stops the run and names both problems.
    instruct = train_instruct_stand_in(tiny_model_dir, cfg, tmp_path / "instruct", steps=160)
    report = json_of(capsys, ["preflight", str(config), f"model.path={instruct}"], code=1)
    assert not report["passed"] and {"fenced_json", "unknown_label"} <= set(report["reasons"]), report
    with pytest.raises(Exception, match="fenced_json"):
        run_training(load_config(config, [f"model.path={instruct}"]))

    # Stage-1 settings: sft on the project's format, the class names in the prompt.
    stage1 = run_training(
        load_config(
            config,
            [
                f"model.path={instruct}",
                "custom.trainer_variant=sft",
                "training.max_steps=160",
                "training.learning_rate=3e-3",
                f"training.output_dir={tmp_path / 'stage1'}",
            ],
        )
    )
    report = json_of(capsys, ["preflight", str(config), f"model.path={stage1.final_model_dir}"])
    assert report["passed"], report

    # Stage-2 from the stage-1 model (its own preflight passes inside train).
    stage2 = run_training(load_config(config, [f"model.path={stage1.final_model_dir}"]))
    final = Path(stage2.final_model_dir)
    common = ["eval", "--model", str(final), "--data", str(data / "val.jsonl"), "--backend", "hf"]
    with_config = json_of(capsys, [*common, "--config", str(config), "--out", str(tmp_path / "a.jsonl")])
    without = json_of(capsys, [*common, "--out", str(tmp_path / "b.jsonl")])
    assert with_config["objects_per_image"] > 0
    for key in ("f1", "precision", "recall", "invalid", "unknown_labels"):
        assert without[key] == with_config[key], key
    assert boxes(tmp_path / "a.jsonl") == boxes(tmp_path / "b.jsonl")

    # Export: loads in transformers, names no path of this machine, decodes the same boxes on HF and vLLM.
    exported = tmp_path / "exported"
    assert main(["export", "--checkpoint", str(final), "--out", str(exported)]) == 0
    from transformers import AutoModelForImageTextToText

    AutoModelForImageTextToText.from_pretrained(exported)
    for name in ("README.md", "rollmatch_run.json"):
        text = (exported / name).read_text()
        assert str(tmp_path) not in text and "/tmp" not in text, name
    card = (exported / "README.md").read_text()
    assert "norm1000" in card and names[0] in card
    hf = ["eval", "--model", str(exported), "--data", str(data / "val.jsonl")]
    json_of(capsys, [*hf, "--backend", "hf", "--out", str(tmp_path / "hf.jsonl")])
    assert boxes(tmp_path / "hf.jsonl") == boxes(tmp_path / "a.jsonl")
    if not vllm_installed():
        pytest.skip("vLLM not installed: the vLLM half of the export check needs it")
    json_of(
        capsys,
        [
            *hf,
            "--backend",
            "vllm",
            "--out",
            str(tmp_path / "vllm.jsonl"),
            "custom.extra.rollout_matching.vllm.enforce_eager=true",
            "custom.extra.rollout_matching.vllm.kv_cache_space_gib=0.25",
        ],
    )
    assert boxes(tmp_path / "vllm.jsonl") == boxes(tmp_path / "hf.jsonl")
