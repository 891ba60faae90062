"""Referring expressions (RefCOCO / RefCOCO+ / RefCOCOg) to grounding records: one phrase, one box.

Owns: :func:`from_refexp`, :func:`read_refs` and :data:`REFEXP_PROMPT`. Input is the releases'
*refs* (one entry per referred object: ``ref_id``, ``image_id``, ``ann_id``, ``split``,
``sentences: [{"sent_id", "sent", ...}]``) as a JSON list (``refs.json``) or a parquet file with
those columns (the Hugging Face re-releases), plus the COCO ``instances.json`` shipped beside
them (boxes ``[x, y, w, h]`` by ``ann_id``; image sizes and ``file_name`` by ``image_id``).
The UNC ``refs(unc).p`` pickle is never read: unpickling a download runs its code. Convert it once
with a trusted tool, or use the JSON / parquet release.

Each sentence becomes one record: id ``<ref_id>-<sent_id>``, the referred box as its one object,
labelled with the phrase, and a per-record ``prompt`` (``REFEXP_PROMPT`` with the phrase, or the
caller's template with ``{phrase}``). Leaves out: segmentation masks, gRefCOCO's multi-target and
no-target expressions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rollmatch.data.convert import _check_real_size, _non_empty, _read_coco_json, _read_json
from rollmatch.data.records import Record, checked_object
from rollmatch.errors import DataError

REFEXP_PROMPT = (
    'Locate the one object described as "{phrase}". Answer with a JSON list holding its box: '
    '[{"bbox_2d": [x1, y1, x2, y2], "label": "{phrase}"}].'
)
"""The default grounding prompt; ``{phrase}`` is replaced by the referring expression."""

REF_FIELDS = ("ref_id", "image_id", "ann_id", "sentences")


def read_refs(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The refs of a ``.json`` (a list of ref objects) or ``.parquet`` file (one ref per row)."""
    src = Path(path)
    if src.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{src}: reading parquet needs pyarrow; `pip install pyarrow`") from None
        refs = pq.read_table(src).to_pylist()
    else:
        refs = _read_json(src, "refs file")
    if not isinstance(refs, list):
        raise DataError(f"{src}: expected a list of refs, got {type(refs).__name__}")
    for i, ref in enumerate(refs):
        missing = [k for k in REF_FIELDS if not isinstance(ref, dict) or k not in ref]
        if missing:
            raise DataError(f"{src}: ref #{i} lacks {missing}; a ref needs {', '.join(REF_FIELDS)}")
    return refs


def from_refexp(
    refs_path: str | os.PathLike[str],
    instances_json: str | os.PathLike[str],
    images_dir: str | os.PathLike[str],
    *,
    split: str | None = None,
    prompt_template: str = REFEXP_PROMPT,
) -> list[Record]:
    """Grounding records, one per sentence of each ref (of ``split`` only, when given).

    ``file_name`` of ``instances_json`` is relative to ``images_dir`` (COCO ``train2014/``).
    """
    if "{phrase}" not in prompt_template:
        raise DataError(
            f"prompt template {prompt_template!r} has no {{phrase}}; put it where the phrase goes"
        )
    src = Path(refs_path)
    instances_src = Path(instances_json)
    instances = _read_coco_json(instances_src)
    images = {image["id"]: image for image in instances["images"]}
    boxes = {ann["id"]: ann["bbox"] for ann in instances["annotations"]}
    root = Path(images_dir).absolute()
    records: list[Record] = []
    checked_images: set[Any] = set()
    for ref in read_refs(src):
        if split is not None and ref.get("split") != split:
            continue
        where = f"{src}: ref_id {ref['ref_id']}"
        image = images.get(ref["image_id"])
        if image is None:
            raise DataError(f"{where}: image_id {ref['image_id']} is not in {instances_src}")
        if ref["ann_id"] not in boxes:
            raise DataError(f"{where}: ann_id {ref['ann_id']} is not in {instances_src}")
        path = os.path.normpath(root / str(image["file_name"]))
        size = (int(image["width"]), int(image["height"]))
        if ref["image_id"] not in checked_images:
            _check_real_size(path, size, f"{instances_src}: image id {ref['image_id']}")
            checked_images.add(ref["image_id"])
        x, y, w, h = (float(v) for v in boxes[ref["ann_id"]])
        for sentence in _sentences(ref, where):
            phrase = str(sentence["sent"]).strip()
            if not phrase:
                continue
            obj = checked_object(phrase, (x, y, x + w, y + h), size, where=where)
            records.append(
                Record(
                    id=f"{ref['ref_id']}-{sentence['sent_id']}",
                    images=(path,),
                    width=size[0],
                    height=size[1],
                    objects=(obj,),
                    prompt=prompt_template.replace("{phrase}", phrase),
                )
            )
    if not records and split is not None:
        raise DataError(
            f"{src}: no ref has split {split!r}; the splits present are listed in its 'split' field"
        )
    return _non_empty(records, src)


def _sentences(ref: dict[str, Any], where: str) -> list[dict[str, Any]]:
    sentences = ref["sentences"]
    if isinstance(sentences, str):  # some parquet releases store the list as a JSON string
        sentences = json.loads(sentences)
    if not isinstance(sentences, list) or not all(
        isinstance(s, dict) and "sent" in s and "sent_id" in s for s in sentences
    ):
        raise DataError(
            f"{where}: 'sentences' must be a list of {{'sent_id', 'sent'}}, got {str(sentences)[:120]}"
        )
    return sentences
