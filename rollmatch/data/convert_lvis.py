"""LVIS (v1 / v0.5 json release) to :class:`~rollmatch.data.records.Record`.

Owns: :func:`from_lvis`. LVIS is COCO-shaped (``images`` / ``annotations`` / ``categories``,
boxes ``[x, y, w, h]`` in pixels) with three differences this converter handles:

- v1 images carry no ``file_name``, only ``coco_url``
  (``http://images.cocodataset.org/train2017/000000391895.jpg``): the image is looked up as
  ``<images>/<train2017|val2017>/<basename>`` first, then ``<images>/<basename>``, so one
  ``--images`` folder holding COCO's ``train2017/`` and ``val2017/`` serves both splits (LVIS v1
  val draws images from both). v0.5's ``file_name`` is used as it is.
- Category names are synsets with underscores (``aerosol_can``, ``bow_(weapon)``); labels are the
  name with underscores turned into spaces (``aerosol can``, ``bow (weapon)``), the words a
  language model reads.
- Annotation is federated: per image, ``not_exhaustive_category_ids`` lists categories whose boxes
  may be incomplete and ``neg_category_ids`` those verified absent. A record holds every box that
  is annotated; the records cannot say "unknown", so predictions of a not-exhaustive category count
  as false positives in training and evaluation. :func:`from_lvis` reports how many images have such
  categories (``stats``) so the user can filter.

Leaves out: segmentation masks, ``frequency`` buckets and the LVIS AP protocol.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rollmatch.data.convert import _annotation_object, _check_real_size, _field, _non_empty, _read_coco_json
from rollmatch.data.records import Record
from rollmatch.errors import DataError


def lvis_label(name: str) -> str:
    """An LVIS synset name as words: ``aerosol_can`` -> ``aerosol can``."""
    return name.replace("_", " ").strip()


def from_lvis(
    annotation_json: str | os.PathLike[str],
    images_dir: str | os.PathLike[str],
    *,
    dropped: list[str] | None = None,
    stats: dict[str, int] | None = None,
) -> list[Record]:
    """Records from an LVIS json (``lvis_v1_val.json`` ...); images found under ``images_dir``.

    Record ids are the LVIS image ids (as strings); order follows the json's ``images`` list;
    images without annotations are kept with no objects. Zero-area boxes are dropped and described
    in ``dropped`` (logged when it is ``None``). ``stats`` (when given) receives
    ``not_exhaustive_images`` and ``not_exhaustive_boxes`` (boxes of such categories on such images).
    """
    src = Path(annotation_json)
    data = _read_coco_json(src)
    categories = {_field(c, "id", src): lvis_label(str(_field(c, "name", src))) for c in data["categories"]}
    by_image: dict[Any, list[dict[str, Any]]] = {}
    for ann in data["annotations"]:
        by_image.setdefault(_field(ann, "image_id", src), []).append(ann)
    root = Path(images_dir).absolute()
    counts = {"not_exhaustive_images": 0, "not_exhaustive_boxes": 0}
    records = []
    for image in data["images"]:
        image_id = _field(image, "id", src)
        annotations = by_image.get(image_id, [])
        not_exhaustive = set(image.get("not_exhaustive_category_ids") or [])
        if not_exhaustive:
            counts["not_exhaustive_images"] += 1
            counts["not_exhaustive_boxes"] += sum(a.get("category_id") in not_exhaustive for a in annotations)
        records.append(_lvis_record(image, annotations, categories, root, src, dropped))
    if stats is not None:
        stats.update(counts)
    return _non_empty(records, src)


def _lvis_record(
    image: dict[str, Any],
    annotations: list[dict[str, Any]],
    categories: dict[Any, str],
    root: Path,
    src: Path,
    dropped: list[str] | None,
) -> Record:
    image_id = image["id"]
    path = _image_path(image, root, src)
    size = (int(_field(image, "width", src)), int(_field(image, "height", src)))
    _check_real_size(path, size, f"{src}: image id {image_id}")
    objects = []
    for ann in annotations:
        where = f"{src}: annotation id {ann.get('id')} (image id {image_id})"
        obj = _annotation_object(ann, categories, size, where, src, dropped)
        if obj is not None:
            objects.append(obj)
    return Record(id=str(image_id), images=(path,), width=size[0], height=size[1], objects=tuple(objects))


def _image_path(image: dict[str, Any], root: Path, src: Path) -> str:
    """Where an LVIS image lies under ``root`` (see the module docstring)."""
    if "file_name" in image:
        candidates = [root / str(image["file_name"])]
    elif "coco_url" in image:
        parts = str(image["coco_url"]).rstrip("/").split("/")
        candidates = [root / parts[-2] / parts[-1], root / parts[-1]]
    else:
        raise DataError(f"{src}: image id {image.get('id')} has neither 'coco_url' (LVIS v1) nor 'file_name'")
    for candidate in candidates:
        if candidate.is_file():
            return os.path.normpath(candidate)
    raise DataError(
        f"{src}: image id {image.get('id')}: none of {[str(c) for c in candidates]} exists; pass as --images "
        "the folder holding COCO's train2017/ and val2017/ (or the images themselves)"
    )
