"""The JSONL record format: one detection sample per line (documented in docs/data.md).

Owns: :class:`Record`/:class:`RecordObject`, strict loading with ``file:line`` errors, collecting
every problem of a file (``rollmatch data validate``), writing, and image loading (always RGB).
Leaves out: converters (``data.convert``), the synthetic set (``data.shapes``) and prompt encoding
(``data.prompts``).

A line::

    {"id": "raccoon-1", "images": ["images/raccoon-1.jpg"], "width": 650, "height": 417,
     "objects": [{"label": "raccoon", "bbox": [80, 87, 522, 408]}]}

``bbox`` is pixel ``[x1, y1, x2, y2]`` of the original image ``images[0]`` (``width`` x ``height``),
with ``x2 > x1`` and ``y2 > y1``. Relative image paths resolve against the JSONL file's folder and
are stored absolute. A box may exceed the image by at most :data:`BOX_TOLERANCE_PX` (rounding in
converted annotations, e.g. COCO ``x + w`` in float); such coordinates are clipped to the image on
load. Anything further out is an error. Images are used as stored: no EXIF rotation is applied.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from rollmatch.errors import DataError

BOX_TOLERANCE_PX = 1.0
"""How far (pixels) a box may lie outside the image before it is an error; within it, it is clipped."""

RECORD_FIELDS = ("id", "images", "width", "height", "objects")
OPTIONAL_RECORD_FIELDS = ("prompt", "ignore")
"""``prompt``: the record's own prompt text (a referring expression's question), replacing ``data.prompt``;
``ignore``: regions (``label`` + ``bbox``, e.g. COCO ``iscrowd`` boxes) where a prediction is neither a
match nor a false positive."""
OBJECT_FIELDS = ("label", "bbox")

Box = tuple[float, float, float, float]


@dataclass(frozen=True)
class RecordObject:
    """One annotated object: a label and a pixel ``xyxy`` box of the original image."""

    label: str
    bbox: tuple[float, float, float, float]


@dataclass(frozen=True)
class Record:
    """One sample: image path(s) (absolute once loaded), original image size, objects.

    ``width``/``height`` are the size of ``images[0]``, the image the boxes refer to; further
    images are context for the prompt.
    """

    id: str
    images: tuple[str, ...]
    width: int
    height: int
    objects: tuple[RecordObject, ...] = field(default_factory=tuple)
    prompt: str | None = None
    """The record's own prompt text (grounding: "Locate the man in red ..."); ``None``: ``data.prompt``."""
    ignore: tuple[RecordObject, ...] = field(default_factory=tuple)
    """Ignore regions (COCO crowd boxes): never a training target; a prediction on one is ignored."""

    @property
    def image_size(self) -> tuple[int, int]:
        return (self.width, self.height)

    def to_json(self, *, relative_to: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """The JSON object of this record; image paths relative to ``relative_to`` when given."""
        images = [os.path.relpath(p, relative_to) if relative_to is not None else p for p in self.images]
        out: dict[str, Any] = {
            "id": self.id,
            "images": images,
            "width": self.width,
            "height": self.height,
            "objects": [{"label": o.label, "bbox": [_json_number(v) for v in o.bbox]} for o in self.objects],
        }
        if self.prompt is not None:
            out["prompt"] = self.prompt
        if self.ignore:
            out["ignore"] = [
                {"label": o.label, "bbox": [_json_number(v) for v in o.bbox]} for o in self.ignore
            ]
        return out


# --------------------------------------------------------------------------------------- public API
def load_records(path: str | os.PathLike[str], *, max_samples: int | None = None) -> list[Record]:
    """Load a JSONL file strictly: the first bad line raises :class:`DataError` naming ``file:line``.

    With ``max_samples`` only the first N records are read (and checked); ``validate_records``
    checks a whole file. Image files must exist; their sizes are checked by ``validate_records``
    only (that opens every image).
    """
    if max_samples is not None and (isinstance(max_samples, bool) or max_samples <= 0):
        raise DataError(f"max_samples = {max_samples!r}: use a positive integer, or None for all records")
    path = Path(path)
    base_dir = path.absolute().parent
    records: list[Record] = []
    first_line_of_id: dict[str, int] = {}
    for lineno, line in _read_lines(path):
        if max_samples is not None and len(records) >= max_samples:
            break
        problems: list[str] = []
        record = _parse_line(line, base_dir, problems)
        if record is not None:
            _check_unique_id(record.id, lineno, first_line_of_id, problems)
        if problems:
            more = f" (+{len(problems) - 1} more on this line)" if len(problems) > 1 else ""
            raise DataError(
                f"{path}:{lineno}: {problems[0]}{more}; run `rollmatch data validate {path}` to list every problem"
            )
        assert record is not None
        records.append(record)
    if not records:
        raise DataError(f"{path}: no records; a JSONL dataset needs at least one line (see docs/data.md)")
    return records


def validate_records(path: str | os.PathLike[str]) -> list[str]:
    """Every problem of a JSONL file as ``file:line: field: what is wrong`` (empty list: valid).

    Besides what :func:`load_records` checks, this opens each record's first image and checks that
    its real size equals ``width`` x ``height``.
    """
    path = Path(path)
    base_dir = path.absolute().parent
    found: list[str] = []
    first_line_of_id: dict[str, int] = {}
    n_lines = 0
    try:
        for lineno, line in _read_lines(path):
            n_lines = lineno
            problems: list[str] = []
            record = _parse_line(line, base_dir, problems)
            if record is not None:
                _check_unique_id(record.id, lineno, first_line_of_id, problems)
                _check_image_size(record, problems)
            found.extend(f"{path}:{lineno}: {p}" for p in problems)
    except DataError as exc:  # unreadable file: report it with what was found so far
        return [*found, str(exc)]
    if n_lines == 0:
        found.append(f"{path}: no records; a JSONL dataset needs at least one line")
    return found


def write_records(
    path: str | os.PathLike[str],
    records: Iterable[Record],
    *,
    relative_to: str | os.PathLike[str] | None = None,
) -> Path:
    """Write records as JSONL (one per line, UTF-8); image paths relative to ``relative_to`` if given.

    Pass the output file's folder as ``relative_to`` to keep a dataset folder relocatable; by
    default the stored (absolute) paths are written. Returns the path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record.to_json(relative_to=relative_to), ensure_ascii=False) + "\n")
    return path


def load_image(path: str | os.PathLike[str]) -> Image.Image:
    """Open an image as RGB (grayscale, palette and RGBA images are converted; no EXIF rotation)."""
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise DataError(f"image file not found: {path}") from None
    except (UnidentifiedImageError, OSError) as exc:
        raise DataError(f"cannot read image {path}: {exc}; re-export it as JPEG or PNG") from None


def read_image_size(path: str | os.PathLike[str]) -> tuple[int, int]:
    """The ``(width, height)`` of an image file, read from its header only."""
    try:
        with Image.open(path) as image:
            return image.size
    except FileNotFoundError:
        raise DataError(f"image file not found: {path}") from None
    except (UnidentifiedImageError, OSError) as exc:
        raise DataError(f"cannot read image {path}: {exc}; re-export it as JPEG or PNG") from None


def checked_object(
    label: str, bbox: Sequence[float], image_size: tuple[int, int], *, where: str
) -> RecordObject:
    """A :class:`RecordObject` after the same label and box checks as loading (clipped within tolerance).

    For converters: ``where`` names the source (e.g. ``"instances.json: annotation id 17"``) and
    starts the :class:`DataError` message.
    """
    if not label.strip():
        raise DataError(f"{where}: empty label {label!r}; every object needs a class name")
    problem = box_problem(bbox, image_size)
    if problem is not None:
        raise DataError(f"{where}: {problem}")
    return RecordObject(label=label, bbox=clip_box(bbox, image_size))


def box_problem(bbox: Sequence[float], image_size: tuple[int, int]) -> str | None:
    """Why a pixel ``xyxy`` box is not acceptable in a ``(width, height)`` image, or ``None``."""
    x1, y1, x2, y2 = bbox
    width, height = image_size
    if x2 <= x1 or y2 <= y1:
        return f"degenerate box {list(bbox)}: need x2 > x1 and y2 > y1 (boxes are pixel [x1, y1, x2, y2])"
    tol = BOX_TOLERANCE_PX
    if x1 < -tol or y1 < -tol or x2 > width + tol or y2 > height + tol:
        return (
            f"box {list(bbox)} lies outside the {width}x{height} image by more than {tol:g} px; "
            "boxes are pixel [x1, y1, x2, y2] of the original image"
        )
    cx1, cy1, cx2, cy2 = clip_box(bbox, image_size)
    if cx2 <= cx1 or cy2 <= cy1:
        return f"box {list(bbox)} has no area inside the {width}x{height} image"
    return None


def clip_box(bbox: Sequence[float], image_size: tuple[int, int]) -> Box:
    """Clip a pixel ``xyxy`` box to ``[0, width] x [0, height]`` (as floats)."""
    width, height = image_size
    return (
        float(min(max(bbox[0], 0.0), width)),
        float(min(max(bbox[1], 0.0), height)),
        float(min(max(bbox[2], 0.0), width)),
        float(min(max(bbox[3], 0.0), height)),
    )


# ------------------------------------------------------------------------------------------ parsing
def _read_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` pairs split on line feeds only (CRLF accepted): JSON strings written
    with ``ensure_ascii=False`` may hold characters such as U+2028 that ``str.splitlines`` splits on.
    """
    try:
        with path.open(encoding="utf-8", newline="\n") as lines:
            for lineno, line in enumerate(lines, start=1):
                yield lineno, line.rstrip("\n").removesuffix("\r")
    except FileNotFoundError:
        raise DataError(f"records file not found: {path}") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc}); JSONL files must be UTF-8") from None


def _parse_line(line: str, base_dir: Path, problems: list[str]) -> Record | None:
    """Parse one line into a Record, appending every problem found; ``None`` if it has any."""
    if not line.strip():
        problems.append("empty line; JSONL holds exactly one JSON record per line, remove it")
        return None
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        problems.append(f"not valid JSON ({exc.msg} at column {exc.colno})")
        return None
    if not isinstance(raw, dict):
        problems.append(f"a record must be a JSON object, got {type(raw).__name__}")
        return None
    missing = [k for k in RECORD_FIELDS if k not in raw]
    allowed = RECORD_FIELDS + OPTIONAL_RECORD_FIELDS
    extra = sorted(k for k in raw if k not in allowed)
    if missing:
        problems.append(
            f"missing field(s) {', '.join(map(repr, missing))}; a record has {', '.join(RECORD_FIELDS)}"
        )
    if extra:
        problems.append(f"unknown field(s) {', '.join(map(repr, extra))}; allowed: {', '.join(allowed)}")
    if missing or extra:
        return None
    n_before = len(problems)
    record_id = raw["id"]
    if not isinstance(record_id, str) or not record_id.strip():
        problems.append(f"field 'id': must be a non-empty string, got {record_id!r}")
    width = _positive_int(raw["width"], "width", problems)
    height = _positive_int(raw["height"], "height", problems)
    images = _parse_images(raw["images"], base_dir, problems)
    size = (width, height) if width is not None and height is not None else None
    objects = _parse_objects(raw["objects"], size, problems)
    ignore = _parse_objects(raw.get("ignore", []), size, problems, name="ignore")
    prompt = raw.get("prompt")
    if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
        problems.append(
            f"field 'prompt': must be a non-empty string (or absent: data.prompt), got {prompt!r}"
        )
    if len(problems) > n_before or width is None or height is None or images is None or objects is None:
        return None
    return Record(
        id=record_id,
        images=images,
        width=width,
        height=height,
        objects=objects,
        prompt=prompt,
        ignore=ignore or (),
    )


def _positive_int(value: Any, name: str, problems: list[str]) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        problems.append(f"field '{name}': must be a positive integer (pixels), got {value!r}")
        return None
    return value


def _parse_images(value: Any, base_dir: Path, problems: list[str]) -> tuple[str, ...] | None:
    if not isinstance(value, list) or not value:
        problems.append(f"field 'images': must be a non-empty list of image paths, got {value!r}")
        return None
    paths: list[str] = []
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item.strip():
            problems.append(f"field 'images[{i}]': must be a non-empty path string, got {item!r}")
            continue
        resolved = os.path.normpath(base_dir / item)
        if not os.path.isfile(resolved):
            problems.append(
                f"field 'images[{i}]': image file not found: {resolved} (relative paths resolve against the JSONL's folder)"
            )
            continue
        paths.append(resolved)
    return tuple(paths) if len(paths) == len(value) else None


def _parse_objects(
    value: Any, image_size: tuple[int, int] | None, problems: list[str], *, name: str = "objects"
) -> tuple[RecordObject, ...] | None:
    """The ``objects`` (or ``ignore``) list: label + pixel box each."""
    field_name = name
    if not isinstance(value, list):
        problems.append(f"field '{field_name}': must be a list (possibly empty), got {type(value).__name__}")
        return None
    objects: list[RecordObject] = []
    for i, item in enumerate(value):
        name = f"{field_name}[{i}]"
        if not isinstance(item, dict):
            problems.append(f"field '{name}': must be an object with 'label' and 'bbox', got {item!r}")
            continue
        keys = sorted(item)
        if keys != sorted(OBJECT_FIELDS):
            problems.append(f"field '{name}': needs exactly the keys 'label' and 'bbox', got {keys}")
            continue
        label, bbox = item["label"], item["bbox"]
        ok = True
        if not isinstance(label, str) or not label.strip():
            problems.append(f"field '{name}.label': must be a non-empty string, got {label!r}")
            ok = False
        if not _is_box(bbox):
            problems.append(f"field '{name}.bbox': must be 4 finite numbers [x1, y1, x2, y2], got {bbox!r}")
            continue
        if image_size is None:
            continue
        problem = box_problem(bbox, image_size)
        if problem is not None:
            problems.append(f"field '{name}.bbox': {problem}")
            continue
        if ok:
            objects.append(RecordObject(label=label, bbox=clip_box(bbox, image_size)))
    return tuple(objects) if len(objects) == len(value) else None


def _is_box(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 4
        and all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value)
    )


def _check_unique_id(
    record_id: str, lineno: int, first_line_of_id: dict[str, int], problems: list[str]
) -> None:
    first = first_line_of_id.setdefault(record_id, lineno)
    if first != lineno:
        problems.append(f"field 'id': duplicate id {record_id!r} (first on line {first}); ids must be unique")


def _check_image_size(record: Record, problems: list[str]) -> None:
    try:
        real = read_image_size(record.images[0])
    except DataError as exc:
        problems.append(f"field 'images[0]': {exc}")
        return
    if real != record.image_size:
        problems.append(
            f"fields 'width'/'height': record says {record.width}x{record.height} but {record.images[0]} "
            f"is {real[0]}x{real[1]}; set them to the real image size"
        )


def _json_number(value: float) -> int | float:
    """Integral floats are written as ints so converted integer boxes stay integers in the file."""
    return int(value) if float(value).is_integer() else value
