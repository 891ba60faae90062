"""Pictures of detections: ground truth and predictions drawn on each image, and grids of images.

Owns: :func:`draw_detections` (one image: matched predictions, false positives, missed ground
truth dashed, every box with its label, optional note lines under it), :func:`parse_note` (why a
response's parse lost objects, in one line), :func:`render_pictures` (records + a predictions JSONL
-> one PNG per image and ``grid.png``), :func:`compose_grid` (titled rows of pictures, e.g. a
before/after comparison) and the ``rollmatch viz`` command. Training draws the rollouts it logs
(``training.rollout_log``) with :func:`draw_detections` too.
Leaves out: rolling out and scoring (``rollmatch.evaluation`` writes the predictions JSONL read
here), and coordinate frames: records and predictions are both pixels of the original image, whatever
frame the model answered in (``rollmatch eval`` converted them), so nothing here depends on the model. Matching is redone here with the evaluation's ``matching.*`` settings (Hungarian; by default
IoU >= 0.5, geometry only), on boxes in pixels of the original image; the evaluation matches the same
boxes in its integer coordinate frame, so a pair within rounding of the IoU threshold can be drawn
differently.

Colours: matched prediction :data:`MATCHED` (green), false positive :data:`FALSE_POSITIVE` (red),
missed ground truth :data:`MISSED` (yellow, dashed), matched ground truth :data:`MATCHED_GT`
(thin white, under its prediction, so the fit is visible).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from rollmatch.config.schema import MatchingConfig
from rollmatch.data.records import Record, RecordObject, load_image, load_records
from rollmatch.detection.matching import hungarian_match
from rollmatch.detection.objects import DetObject
from rollmatch.errors import DataError

RGB = tuple[int, int, int]
MATCHED: RGB = (0, 230, 0)
FALSE_POSITIVE: RGB = (255, 0, 0)
MISSED: RGB = (255, 230, 0)
MATCHED_GT: RGB = (255, 255, 255)
HALO: RGB = (0, 0, 0)
BOX_WIDTH = 2
DASH, GAP = 6, 4  # dashed edge: pixels drawn, pixels skipped
TILE = 320  # side of one picture in a grid


@dataclass(frozen=True)
class Picture:
    """One drawn image and its counts (matched, false positives, missed)."""

    record_id: str
    image: Image.Image
    tp: int
    fp: int
    fn: int

    @property
    def caption(self) -> str:
        return f"{self.record_id}  TP {self.tp} FP {self.fp} FN {self.fn}"


def draw_detections(
    image: Image.Image,
    ground_truth: Sequence[RecordObject],
    predictions: Sequence[RecordObject],
    *,
    record_id: str = "",
    longest_side: int = 448,
    matching: MatchingConfig | None = None,
    note: Sequence[str] = (),
) -> Picture:
    """Draw ``ground_truth`` and ``predictions`` (pixel boxes of ``image``) on a resized copy.

    The copy's longest side is ``longest_side`` (boxes are scaled with it), so small images get
    readable labels. ``matching``: the evaluation's settings (default: IoU >= 0.5, geometry only).
    ``note``: lines of text written in a band under the image (the picture grows by the band).
    """
    scale = longest_side / max(image.size)
    canvas = image.convert("RGB").resize(
        (round(image.width * scale), round(image.height * scale)), Image.Resampling.BILINEAR
    )
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default(size=max(10, longest_side // 36))
    match = hungarian_match(
        _as_objects(predictions), _as_objects(ground_truth), **(matching or MatchingConfig()).model_dump()
    )
    matched_gt = {g for _, g, _ in match.pairs}
    labelled: list[tuple[tuple[float, ...], str, RGB]] = []
    for index, obj in enumerate(ground_truth):
        box = _scaled(obj.bbox, scale)
        if index in matched_gt:
            draw.rectangle(box, outline=MATCHED_GT, width=1)
        else:
            _dashed_rectangle(draw, box, MISSED, BOX_WIDTH)
            labelled.append((box, obj.label, MISSED))
    matched_pred = {p for p, _, _ in match.pairs}
    # False positives first, so a matched box drawn over the same place stays visible.
    for index in [*match.fp, *sorted(matched_pred)]:
        obj = predictions[index]
        colour = MATCHED if index in matched_pred else FALSE_POSITIVE
        box = _scaled(obj.bbox, scale)
        # A dark halo one pixel each side keeps the edge visible on a shape of the box's colour.
        halo = (box[0] - 1, box[1] - 1, box[2] + 1, box[3] + 1)
        draw.rectangle(halo, outline=HALO, width=BOX_WIDTH + 2)
        draw.rectangle(box, outline=colour, width=BOX_WIDTH)
        labelled.append((box, obj.label, colour))
    for box, label, colour in labelled:
        _label(draw, box, label, colour, font)
    if note:
        canvas = _with_note(canvas, note, font)
    return Picture(record_id, canvas, tp=len(match.pairs), fp=len(match.fp), fn=len(match.fn))


def parse_note(invalid: Mapping[str, int], truncated: bool) -> str | None:
    """Why a strict parse kept fewer objects than the response wrote, in one line; None when it lost none.

    ``invalid``: reason -> count (``detection.codec``'s ``ELEMENT_REASONS`` / ``LIST_REASONS``);
    ``truncated``: the response hit ``max_new_tokens`` or ended inside the list.
    """
    parts = [f"{reason} x{count}" for reason, count in sorted(invalid.items()) if count]
    if truncated:
        parts.insert(0, "truncated")
    return ", ".join(parts) or None


def render_pictures(
    records: Sequence[Record],
    predictions_path: str | Path,
    out_dir: str | Path,
    *,
    grid_size: int = 16,
    max_images: int | None = None,
    matching: MatchingConfig | None = None,
) -> list[Path]:
    """One ``<id>.png`` per record with a prediction line (data order) and ``grid.png`` of the first
    ``grid_size``; returns the written paths (grid last). ``max_images`` draws only the first N.
    """
    predicted = read_predictions(predictions_path)
    by_id = {r.id: r for r in records}
    unknown = [i for i in predicted if i not in by_id]
    if unknown:
        raise DataError(
            f"{predictions_path}: predictions for ids not in the data ({', '.join(unknown[:5])}"
            f"{' ...' if len(unknown) > 5 else ''}); pass the JSONL the predictions were made on"
        )
    chosen = [r for r in records if r.id in predicted][:max_images]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    pictures: list[Picture] = []
    for record in chosen:
        picture = draw_detections(
            load_image(record.images[0]),
            record.objects,
            predicted[record.id],
            record_id=record.id,
            matching=matching,
        )
        path = out / f"{file_stem(record.id)}.png"
        picture.image.save(path)
        paths.append(path)
        pictures.append(picture)
    if pictures:
        shown = pictures[:grid_size]
        columns = min(4, len(shown))
        rows = [shown[i : i + columns] for i in range(0, len(shown), columns)]
        grid = compose_grid([("", row) for row in rows], title=str(predictions_path))
        paths.append(out / "grid.png")
        grid.save(paths[-1])
    return paths


def read_predictions(path: str | Path) -> dict[str, list[RecordObject]]:
    """``id -> predicted objects`` (pixel boxes of the original image) of a predictions JSONL."""
    result: dict[str, list[RecordObject]] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            objects = [
                RecordObject(str(o["label"]), tuple(float(v) for v in o["bbox"])) for o in entry["objects"]
            ]
            result[str(entry["id"])] = objects  # type: ignore[arg-type]
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(
                f"{path}:{number}: not a predictions line ({exc}); expected "
                '{"id": ..., "objects": [{"label": ..., "bbox": [x1, y1, x2, y2]}]} as `rollmatch eval` writes'
            ) from exc
    return result


def compose_grid(
    rows: Sequence[tuple[str, Sequence[Picture]]], *, title: str = "", tile: int = TILE
) -> Image.Image:
    """Rows of pictures (each scaled into a ``tile`` square, captioned) under a legend line.

    Each row is ``(row title, pictures)``; a non-empty row title is written left of the row.
    """
    font = ImageFont.load_default(size=13)
    caption_h, header_h = 18, 24
    title_w = 120 if any(name for name, _ in rows) else 0
    columns = max((len(pictures) for _, pictures in rows), default=0)
    grid = Image.new(
        "RGB", (title_w + columns * tile, header_h + len(rows) * (tile + caption_h)), (24, 24, 24)
    )
    draw = ImageDraw.Draw(grid)
    _legend(draw, title, font)
    for r, (name, pictures) in enumerate(rows):
        top = header_h + r * (tile + caption_h)
        if name:
            draw.text((6, top + tile // 2), name, fill=(255, 255, 255), font=font)
        for c, picture in enumerate(pictures):
            thumb = picture.image.copy()
            thumb.thumbnail((tile, tile), Image.Resampling.BILINEAR)
            grid.paste(thumb, (title_w + c * tile, top))
            draw.text(
                (title_w + c * tile + 2, top + tile + 2), picture.caption, fill=(220, 220, 220), font=font
            )
    return grid


def viz_command(args: argparse.Namespace) -> int:
    """``rollmatch viz --data val.jsonl --predictions preds.jsonl --out DIR [--grid N]``."""
    matching = MatchingConfig(iou_threshold=args.iou_threshold, label_mode=args.label_mode)
    paths = render_pictures(
        load_records(args.data),
        args.predictions,
        args.out,
        grid_size=args.grid,
        max_images=args.max_images,
        matching=matching,
    )
    print(
        f"wrote {len(paths) - 1 if paths else 0} pictures and {paths[-1] if paths else 'no grid'} to {args.out}"
    )
    return 0


# ---------------------------------------------------------------------------------------- helpers
def _as_objects(objects: Sequence[RecordObject]) -> list[DetObject]:
    # Pixel boxes stay floats: IoU and matching need no integer frame.
    return [DetObject(o.label, o.bbox) for o in objects]  # type: ignore[arg-type]


def _scaled(bbox: Sequence[float], scale: float) -> tuple[float, float, float, float]:
    # Record boxes have exclusive x2/y2; PIL rectangles include their last pixel.
    x1, y1, x2, y2 = (v * scale for v in bbox)
    return (x1, y1, max(x1, x2 - 1), max(y1, y2 - 1))


def _dashed_rectangle(draw: ImageDraw.ImageDraw, box: Sequence[float], colour: RGB, width: int) -> None:
    x1, y1, x2, y2 = box
    for a, b in (((x1, y1), (x2, y1)), ((x2, y1), (x2, y2)), ((x2, y2), (x1, y2)), ((x1, y2), (x1, y1))):
        _dashed_line(draw, a, b, colour, width)


def _dashed_line(
    draw: ImageDraw.ImageDraw, a: tuple[float, float], b: tuple[float, float], colour: RGB, width: int
) -> None:
    length = max(abs(b[0] - a[0]), abs(b[1] - a[1]))
    steps = max(1.0, length)
    position = 0.0
    while position < length:
        end = min(position + DASH, length)
        start_xy = (a[0] + (b[0] - a[0]) * position / steps, a[1] + (b[1] - a[1]) * position / steps)
        end_xy = (a[0] + (b[0] - a[0]) * end / steps, a[1] + (b[1] - a[1]) * end / steps)
        draw.line([start_xy, end_xy], fill=colour, width=width)
        position += DASH + GAP


def _label(
    draw: ImageDraw.ImageDraw, box: Sequence[float], text: str, colour: RGB, font: ImageFont.FreeTypeFont
) -> None:
    """``text`` on a box-coloured tag above the box (inside it when the box touches the top)."""
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    width, height = right - left + 4, bottom - top + 2
    x, y = box[0], box[1] - height - 1
    if y < 0:
        y = box[1] + BOX_WIDTH + 1
    draw.rectangle((x, y, x + width, y + height), fill=colour)
    draw.text((x + 2 - left, y + 1 - top), text, fill=(0, 0, 0), font=font)


def _with_note(canvas: Image.Image, lines: Sequence[str], font: ImageFont.FreeTypeFont) -> Image.Image:
    """``canvas`` with a dark band under it holding ``lines`` (each cut to the picture's width)."""
    probe = ImageDraw.Draw(canvas)
    line_h = int(probe.textbbox((0, 0), "Ag", font=font)[3]) + 4
    band = Image.new("RGB", (canvas.width, canvas.height + line_h * len(lines) + 4), (24, 24, 24))
    band.paste(canvas, (0, 0))
    draw = ImageDraw.Draw(band)
    for index, line in enumerate(lines):
        while len(line) > 3 and draw.textlength(line, font=font) > canvas.width - 6:
            line = line[:-4] + "..."
        draw.text((3, canvas.height + 2 + index * line_h), line, fill=(230, 230, 230), font=font)
    return band


def _legend(draw: ImageDraw.ImageDraw, title: str, font: ImageFont.FreeTypeFont) -> None:
    x = 6
    for name, colour in (
        ("matched", MATCHED),
        ("false positive", FALSE_POSITIVE),
        ("missed GT (dashed)", MISSED),
    ):
        draw.rectangle((x, 7, x + 12, 17), outline=colour, width=2)
        draw.text((x + 16, 5), name, fill=(230, 230, 230), font=font)
        x += 22 + int(draw.textlength(name, font=font)) + 10
    if title:
        draw.text((x + 10, 5), title, fill=(160, 160, 160), font=font)


def file_stem(record_id: str) -> str:
    """``record_id`` as a safe file name (other characters become ``_``)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in record_id)
