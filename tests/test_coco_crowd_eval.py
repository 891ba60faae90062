"""COCO conventions end to end: ``data convert`` keeps ``iscrowd`` boxes as ignore regions, ``eval``
does not count predictions on them as false positives, and ``--coco-results`` writes the results JSON
that pycocotools loads and scores against the original annotation file."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from rollmatch.cli import main
from rollmatch.config.schema import DataConfig
from rollmatch.data.coco_results import write_coco_results
from rollmatch.data.commands import describe_records
from rollmatch.data.convert import from_coco
from rollmatch.data.prompts import PromptEncoder
from rollmatch.data.records import load_records, write_records
from rollmatch.data.shapes import generate_shapes
from rollmatch.detection.object_formats import build_codec
from rollmatch.detection.objects import DetObject, to_frame
from rollmatch.evaluation import evaluate
from rollmatch.rollout.types import Decoding
from tests.test_evaluation import ReplayBackend

CROWD_PX = (2.0, 2.0, 40.0, 40.0)  # x, y, w, h: the top-left corner of every image


@pytest.fixture(scope="module")
def coco_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A COCO annotation json of real shapes images (ids 101..), each with one crowd box; its images folder."""
    folder = tmp_path_factory.mktemp("coco_crowd")
    shapes = load_records(generate_shapes(folder, n_train=4, n_val=0, size=224, seed=5)["train"])
    names = sorted({o.label for r in shapes for o in r.objects})
    category = {name: 10 + i for i, name in enumerate(names)}
    images, annotations = [], []
    for image_id, record in enumerate(shapes, start=101):
        images.append(
            {
                "id": image_id,
                "file_name": Path(record.images[0]).name,
                "width": record.width,
                "height": record.height,
            }
        )
        boxes = [(o.label, o.bbox, 0) for o in record.objects] + [(names[0], None, 1)]
        for label, bbox, crowd in boxes:
            x, y, w, h = (
                CROWD_PX if bbox is None else (bbox[0], bbox[1], bbox[2] - bbox[0], bbox[3] - bbox[1])
            )
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": category[label],
                    "bbox": [x, y, w, h],
                    "area": w * h,
                    "iscrowd": crowd,
                }
            )
    coco = {
        "images": images,
        "annotations": annotations,
        "categories": [{"id": c, "name": n} for n, c in category.items()],
    }
    path = folder / "instances.json"
    path.write_text(json.dumps(coco), encoding="utf-8")
    return path, Path(shapes[0].images[0]).parent


def test_convert_keeps_and_counts_crowd_boxes(coco_set: tuple[Path, Path]) -> None:
    records = from_coco(*coco_set)
    assert all(len(r.ignore) == 1 for r in records)
    assert "4 crowd regions kept as ignore regions in 4 images" in describe_records(records)


def test_eval_ignores_predictions_on_crowds_and_writes_coco_results(
    coco_set: tuple[Path, Path], tiny_model_dir: Path, tmp_path: Path
) -> None:
    annotations, images = coco_set
    records = load_records(write_records(tmp_path / "val.jsonl", from_coco(annotations, images)))
    encoder = PromptEncoder.from_pretrained(tiny_model_dir, DataConfig(coord_frame="norm1000"))
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    texts = {}
    for record in records:  # every object found, then one box inside the crowd region
        crowd = record.ignore[0]
        inside = (crowd.bbox[0] + 4, crowd.bbox[1] + 4, crowd.bbox[2] - 4, crowd.bbox[3] - 4)
        on_crowd = DetObject(crowd.label, to_frame(inside, record.image_size, "norm1000", (0, 0)))
        texts[record.id] = codec.serialize([*encoder.gt_objects(record, encoder.encode(record)), on_crowd])

    def run(recs, out: Path):
        backend = ReplayBackend(encoder.tokenizer, texts)
        return evaluate(
            backend, encoder, codec, recs, decoding=Decoding(), predictions_path=out, progress=False
        )

    result = run(records, tmp_path / "pred.jsonl")
    assert (result.precision, result.recall, result.fp_per_image) == (1.0, 1.0, 0.0)
    assert result.ignored_predictions == len(records)
    assert result.map_50_position_scored == pytest.approx(1.0)
    stripped = [type(r)(**{**r.__dict__, "ignore": ()}) for r in records]
    assert (
        run(stripped, tmp_path / "stripped.jsonl").fp_per_image == 1.0
    )  # the old behaviour: false positives

    written, unknown = write_coco_results(tmp_path / "pred.jsonl", annotations, tmp_path / "results.json")
    results = json.loads((tmp_path / "results.json").read_text())
    assert unknown == 0 and written == len(results) == sum(len(r.objects) + 1 for r in records)
    assert {r["image_id"] for r in results} == {101, 102, 103, 104}
    first = results[0]
    assert set(first) == {"image_id", "category_id", "bbox", "score"} and len(first["bbox"]) == 4
    with contextlib.redirect_stdout(io.StringIO()):  # scored by pycocotools against the original json
        gt = COCO(str(annotations))
        evaluator = COCOeval(gt, gt.loadRes(str(tmp_path / "results.json")), iouType="bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    assert evaluator.stats[1] == pytest.approx(
        1.0, abs=0.02
    )  # AP50: boxes in original pixels, crowds ignored


def test_coco_results_needs_the_annotation_file(tmp_path: Path, capsys) -> None:
    args = ["eval", "--model", str(tmp_path), "--data", str(tmp_path / "v.jsonl"), "--coco-results", "r.json"]
    assert main(args) == 2
    assert "--coco-results needs --coco-annotations" in capsys.readouterr().err
