"""Predictions as a standard COCO detection results file (``rollmatch eval --coco-results FILE``).

Owns :func:`coco_results`: the predictions JSONL that ``rollmatch eval`` writes, mapped onto the COCO
annotation json the records were converted from, as the list ``pycocotools`` ``COCO.loadRes`` and the
COCO evaluation server read: ``{"image_id", "category_id", "bbox": [x, y, w, h], "score"}`` with boxes
in pixels of the original image. The image id comes from the record id (``data convert --format coco``
makes it the file stem), the category id from the label (the category name). Scores: a decoded list
carries no confidence, so each box is scored by its position (earlier = higher, ``1 - i / (n + 1)``),
the ``map_position_scored`` of ``rollmatch eval``.

Leaves out: scoring (``rollmatch eval`` computes mAP itself) and other annotation formats.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rollmatch.errors import DataError


def coco_results(
    predictions_jsonl: str | os.PathLike[str], annotations_json: str | os.PathLike[str]
) -> tuple[list[dict[str, Any]], int]:
    """``(results, predictions left out)``: one result per predicted box whose label is a COCO
    category; boxes with any other label cannot be scored per category and are counted instead."""
    annotations = _read_json(Path(annotations_json))
    image_ids = {Path(str(image["file_name"])).stem: image["id"] for image in annotations.get("images", [])}
    category_ids = {str(c["name"]): c["id"] for c in annotations.get("categories", [])}
    if not image_ids or not category_ids:
        raise DataError(
            f"{annotations_json}: no images or categories; pass the COCO annotation json the records were "
            "converted from (--coco-annotations)"
        )
    results: list[dict[str, Any]] = []
    unknown = 0
    for lineno, line in enumerate(Path(predictions_jsonl).read_text(encoding="utf-8").splitlines(), 1):
        prediction = json.loads(line)
        image_id = image_ids.get(prediction["id"])
        if image_id is None:
            raise DataError(
                f"{predictions_jsonl}:{lineno}: record {prediction['id']!r} names no image of "
                f"{annotations_json} (record ids are the COCO file stems); evaluate records converted from it"
            )
        objects = prediction["objects"]
        for index, obj in enumerate(objects):
            category_id = category_ids.get(obj["label"])
            if category_id is None:
                unknown += 1
                continue
            x1, y1, x2, y2 = obj["bbox"]
            results.append(
                {
                    "image_id": image_id,
                    "category_id": category_id,
                    "bbox": [round(x1, 2), round(y1, 2), round(x2 - x1, 2), round(y2 - y1, 2)],
                    "score": round(1.0 - index / (len(objects) + 1), 6),
                }
            )
    return results, unknown


def write_coco_results(
    predictions_jsonl: str | os.PathLike[str],
    annotations_json: str | os.PathLike[str],
    out: str | os.PathLike[str],
) -> tuple[int, int]:
    """Write :func:`coco_results` to ``out`` as JSON; returns ``(boxes written, boxes left out)``."""
    results, unknown = coco_results(predictions_jsonl, annotations_json)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(results), encoding="utf-8")
    return len(results), unknown


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: not a readable COCO annotation json ({exc})") from exc
    if not isinstance(data, dict):
        raise DataError(f"{path}: a COCO annotation json is an object with images and categories")
    return data
