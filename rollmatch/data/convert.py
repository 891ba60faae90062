"""Converters from common detection annotation formats to :class:`~rollmatch.data.records.Record`.

Owns: COCO json (:func:`from_coco`), Pascal VOC xml (:func:`from_voc`), YOLO txt
(:func:`from_yolo`, class names via :func:`read_yolo_names`). Every converter returns records with
absolute image paths and pixel ``xyxy`` boxes of the stored image, checks each box like
``load_records`` does (same 1 px tolerance, clipped), and checks the annotated image size against
the real image. Leaves out: writing JSONL (``records.write_records``) and any resizing.

Choices (docs/data.md):
- COCO: ``iscrowd: 1`` annotations become the record's ``ignore`` regions (a crowd is not a single
  object, so never a target; a prediction on one is neither a match nor a false positive, as in
  COCO's evaluation); images without annotations are kept with no objects.
- VOC: pixel indices are 1-based and inclusive (``xmin = 1`` is the first column, ``xmax`` the
  last column covered), so a box becomes ``[xmin - 1, ymin - 1, xmax, ymax]`` in the project's
  0-based frame, as Detectron2's VOC loader and the usual VOC -> COCO converters do; the same
  photo then converts to the same box from VOC and from COCO. ``difficult`` objects are kept.
- YOLO: an image without a label file is a background image (no objects), as in Ultralytics.
- All: a zero-width or zero-height box (a point or line, e.g. YOLO ``w = 0``) cannot be learned or
  serialized; it is dropped and described in the caller's ``dropped`` list, or logged as a
  warning when no list is passed.
  A negative size or a box outside the image is an error.
"""

from __future__ import annotations

import json
import logging
import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from rollmatch.data.records import Record, RecordObject, checked_object, read_image_size
from rollmatch.errors import DataError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")

logger = logging.getLogger(__name__)


def natural_key(name: str) -> tuple[Any, ...]:
    """Sort key that orders embedded numbers numerically: ``raccoon-2`` before ``raccoon-10``."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


# --------------------------------------------------------------------------------------------- COCO
def from_coco(
    annotation_json: str | os.PathLike[str],
    images_dir: str | os.PathLike[str],
    *,
    dropped: list[str] | None = None,
) -> list[Record]:
    """Records from a COCO detection json; ``file_name`` is relative to ``images_dir``.

    Boxes ``[x, y, w, h]`` become ``[x, y, x + w, y + h]``; labels are category names. Record ids
    are the image file stems (must be unique). Order follows the json's ``images`` list.
    Zero-area boxes are dropped and described in ``dropped`` (logged when it is ``None``).
    """
    src = Path(annotation_json)
    data = _read_coco_json(src)
    categories = {_field(c, "id", src): str(_field(c, "name", src)) for c in data["categories"]}
    by_image: dict[Any, list[dict[str, Any]]] = {}
    for ann in data["annotations"]:
        by_image.setdefault(_field(ann, "image_id", src), []).append(ann)
    records: list[Record] = []
    seen: dict[str, str] = {}
    for image in data["images"]:
        record = _coco_record(
            image, by_image.get(_field(image, "id", src), []), categories, images_dir, src, dropped
        )
        if record.id in seen:
            raise DataError(
                f"{src}: images {seen[record.id]!r} and {image['file_name']!r} share the record id "
                f"{record.id!r} (the file stem); rename one so stems are unique"
            )
        seen[record.id] = image["file_name"]
        records.append(record)
    return _non_empty(records, src)


def _coco_record(
    image: dict[str, Any],
    annotations: list[dict[str, Any]],
    categories: dict[Any, str],
    images_dir: str | os.PathLike[str],
    src: Path,
    dropped: list[str] | None,
) -> Record:
    file_name = str(_field(image, "file_name", src))
    path = os.path.normpath(Path(images_dir).absolute() / file_name)
    size = (int(_field(image, "width", src)), int(_field(image, "height", src)))
    _check_real_size(path, size, f"{src}: image id {image['id']}")
    objects: list[RecordObject] = []
    crowds: list[RecordObject] = []
    for ann in annotations:
        where = f"{src}: annotation id {ann.get('id')} (image {file_name})"
        obj = _annotation_object(ann, categories, size, where, src, dropped)
        if obj is not None:
            (crowds if ann.get("iscrowd", 0) else objects).append(obj)
    return Record(
        id=Path(file_name).stem,
        images=(path,),
        width=size[0],
        height=size[1],
        objects=tuple(objects),
        ignore=tuple(crowds),
    )


def _annotation_object(
    ann: dict[str, Any],
    categories: dict[Any, str],
    size: tuple[int, int],
    where: str,
    src: Path,
    dropped: list[str] | None,
) -> RecordObject | None:
    """The object of one COCO-style annotation (``category_id`` + ``bbox`` [x, y, w, h]), or ``None`` for a
    zero-area box (:func:`_object_or_drop`; a negative size is a degenerate box); COCO and LVIS files share it."""
    category_id = _field(ann, "category_id", src)
    if category_id not in categories:
        raise DataError(f"{where}: category_id {category_id!r} is not in 'categories'")
    bbox = _field(ann, "bbox", src)
    if not isinstance(bbox, list) or len(bbox) != 4:
        raise DataError(f"{where}: 'bbox' must be [x, y, w, h], got {bbox!r}")
    x, y, w, h = (float(v) for v in bbox)
    return _object_or_drop(categories[category_id], (x, y, x + w, y + h), size, where, dropped)


def _field(entry: dict[str, Any], key: str, src: Path) -> Any:
    if not isinstance(entry, dict) or key not in entry:
        raise DataError(f"{src}: entry {str(entry)[:120]} has no {key!r}; a COCO detection file needs it")
    return entry[key]


def _read_json(src: Path, what: str) -> Any:
    """The JSON value of ``src``; a missing file or bad JSON is a :class:`DataError` (``what``: the file's kind)."""
    try:
        return json.loads(src.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{what} not found: {src}") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{src}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def _read_coco_json(src: Path) -> dict[str, Any]:
    data = _read_json(src, "COCO annotation file")
    missing = [
        k for k in ("images", "annotations", "categories") if not isinstance(data, dict) or k not in data
    ]
    if missing:
        raise DataError(f"{src}: not a COCO detection file, missing {missing}; pass an instances_*.json")
    return data


# ---------------------------------------------------------------------------------------------- VOC
def from_voc(folder: str | os.PathLike[str], *, dropped: list[str] | None = None) -> list[Record]:
    """Records from a Pascal VOC folder: ``annotations/*.xml`` (or ``Annotations/``) and ``images/``
    (or ``JPEGImages/``), sorted numerically by xml name. ``<size>`` must equal the real image size.
    Boxes ``xmin ymin xmax ymax`` (1-based, inclusive) become ``[xmin - 1, ymin - 1, xmax, ymax]``.
    Zero-area boxes are dropped and described in ``dropped`` (logged when it is ``None``).
    """
    root = Path(folder).absolute()
    ann_dir = _first_dir(root, ("annotations", "Annotations"))
    img_dir = _first_dir(root, ("images", "JPEGImages"))
    xml_files = sorted(ann_dir.glob("*.xml"), key=lambda p: natural_key(p.name))
    return _non_empty([_voc_record(xml_path, img_dir, dropped) for xml_path in xml_files], ann_dir)


def _voc_record(xml_path: Path, img_dir: Path, dropped: list[str] | None) -> Record:
    try:
        tree = ET.parse(xml_path).getroot()
    except ET.ParseError as exc:
        raise DataError(f"{xml_path}: not valid XML ({exc})") from None
    filename = _xml_text(tree, "filename", xml_path)
    size = (int(_xml_number(tree, "size/width", xml_path)), int(_xml_number(tree, "size/height", xml_path)))
    image_path = img_dir / filename
    _check_real_size(str(image_path), size, f"{xml_path}: <size>")
    objects: list[RecordObject] = []
    for i, obj in enumerate(tree.findall("object")):
        where = f"{xml_path}: object {i}"
        label = _xml_text(obj, "name", xml_path)
        xmin, ymin, xmax, ymax = (
            _xml_number(obj, f"bndbox/{k}", xml_path) for k in ("xmin", "ymin", "xmax", "ymax")
        )
        # 1-based inclusive pixel indices -> 0-based edges (see the module docstring)
        obj = _object_or_drop(label, (xmin - 1, ymin - 1, xmax, ymax), size, where, dropped)
        if obj is not None:
            objects.append(obj)
    return Record(
        id=xml_path.stem, images=(str(image_path),), width=size[0], height=size[1], objects=tuple(objects)
    )


def _xml_text(node: ET.Element, tag: str, xml_path: Path) -> str:
    text = node.findtext(tag)
    if text is None or not text.strip():
        raise DataError(f"{xml_path}: missing or empty <{tag}>; every VOC annotation needs it")
    return text.strip()


def _xml_number(node: ET.Element, tag: str, xml_path: Path) -> float:
    text = _xml_text(node, tag, xml_path)
    try:
        return float(text)
    except ValueError:
        raise DataError(f"{xml_path}: <{tag}> must be a number, got {text!r}") from None


# --------------------------------------------------------------------------------------------- YOLO
def read_yolo_names(data_yaml: str | os.PathLike[str]) -> list[str]:
    """Class names from a YOLO ``data.yaml`` (``names`` as a list, or a ``{id: name}`` mapping)."""
    path = Path(data_yaml)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"YOLO names file not found: {path}; pass the dataset's data.yaml") from None
    except yaml.YAMLError as exc:
        raise DataError(f"{path}: not valid YAML ({exc})") from None
    names = data.get("names") if isinstance(data, dict) else None
    if isinstance(names, dict) and sorted(names) == list(range(len(names))):
        names = [names[i] for i in range(len(names))]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n.strip() for n in names):
        raise DataError(
            f"{path}: 'names' must be a non-empty list of class names (or {{0: name, ...}}), got {names!r}"
        )
    return names


def from_yolo(
    folder: str | os.PathLike[str], names: Sequence[str], *, dropped: list[str] | None = None
) -> list[Record]:
    """Records from a YOLO split folder: ``images/*`` and ``labels/<stem>.txt`` with lines
    ``class cx cy w h`` normalised to [0, 1]; converted to pixels with the real image size.
    Zero-area boxes are dropped and described in ``dropped`` (logged when it is ``None``).
    """
    root = Path(folder).absolute()
    img_dir, label_dir = root / "images", root / "labels"
    for d in (img_dir, label_dir):
        if not d.is_dir():
            raise DataError(f"{d}: folder not found; a YOLO split has images/ and labels/ side by side")
    images = sorted(
        (p for p in img_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES),
        key=lambda p: natural_key(p.name),
    )
    stems = {p.stem for p in images}
    orphans = sorted(p.name for p in label_dir.glob("*.txt") if p.stem not in stems)
    if orphans:
        raise DataError(
            f"{label_dir}: label files without an image: {orphans[:5]}; add the images or remove them"
        )
    records = []
    for image_path in images:
        size = read_image_size(image_path)
        label_path = label_dir / f"{image_path.stem}.txt"
        objects = _yolo_objects(label_path, names, size, dropped) if label_path.exists() else ()
        records.append(
            Record(
                id=image_path.stem, images=(str(image_path),), width=size[0], height=size[1], objects=objects
            )
        )
    return _non_empty(records, img_dir)


def _yolo_objects(
    label_path: Path, names: Sequence[str], size: tuple[int, int], dropped: list[str] | None
) -> tuple[RecordObject, ...]:
    width, height = size
    objects = []
    for lineno, line in enumerate(label_path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{label_path}:{lineno}"
        parts = line.split()
        if len(parts) != 5:
            raise DataError(
                f"{where}: expected 5 values 'class cx cy w h', got {len(parts)}; "
                "segmentation/pose labels are not detection labels"
            )
        try:
            class_id, cx, cy, w, h = int(parts[0]), *(float(v) for v in parts[1:])
        except ValueError:
            raise DataError(f"{where}: values must be an integer class and 4 numbers, got {line!r}") from None
        if not 0 <= class_id < len(names):
            raise DataError(
                f"{where}: class {class_id} is not in names (0..{len(names) - 1}); check data.yaml"
            )
        bbox = ((cx - w / 2) * width, (cy - h / 2) * height, (cx + w / 2) * width, (cy + h / 2) * height)
        obj = _object_or_drop(names[class_id], bbox, size, where, dropped)
        if obj is not None:
            objects.append(obj)
    return tuple(objects)


# ------------------------------------------------------------------------------------------- shared
def _object_or_drop(
    label: str, bbox: Sequence[float], size: tuple[int, int], where: str, dropped: list[str] | None
) -> RecordObject | None:
    """A checked object, or ``None`` for a zero-width/height box (noted in ``dropped``, else logged)."""
    if bbox[2] == bbox[0] or bbox[3] == bbox[1]:
        note = f"{where}: dropped zero-area box {[round(v, 3) for v in bbox]} ({label!r})"
        if dropped is None:
            logger.warning(note)
        else:
            dropped.append(note)
        return None
    return checked_object(label, bbox, size, where=where)


def _first_dir(root: Path, names: Sequence[str]) -> Path:
    for name in names:
        if (root / name).is_dir():
            return root / name
    raise DataError(f"{root}: none of the folders {list(names)} exists; expected a Pascal VOC layout")


def _check_real_size(image_path: str, size: tuple[int, int], where: str) -> None:
    real = read_image_size(image_path)
    if real != size:
        raise DataError(
            f"{where} says {size[0]}x{size[1]} but {image_path} is {real[0]}x{real[1]}; "
            "fix the annotation (boxes must be in the stored image's pixels)"
        )


def _non_empty(records: list[Record], src: Path) -> list[Record]:
    if not records:
        raise DataError(f"{src}: no images/annotations found; check the path and the folder layout")
    return records
