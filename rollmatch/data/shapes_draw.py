"""How one synthetic shapes image is laid out and drawn from its random stream (pure: numpy + PIL).

Owns: the classes (:data:`SHAPE_CLASSES`, and :data:`DISTRACTOR_CLASSES` that are never labelled),
the difficulty knobs (:class:`ShapesDifficulty`) and :func:`draw_sample`, which places the shapes,
resolves occlusion, renders the image and reports what it could not place (:class:`DrawnSample`).
Leaves out: files, splits and statistics over many images (``data.shapes``).

Every knob beyond the original ones (overlap bound aside, which keeps its old value) is off by
default and draws nothing from the random stream while off, so a default image keeps its bytes.
Order of draws: background, object count, tied row, same-class row, the labelled shapes one by one,
distractors, noise.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import numpy as np
from PIL import Image, ImageDraw

from rollmatch.data.records import RecordObject
from rollmatch.errors import DataError

ShapeKind = Literal["square", "circle", "triangle", "diamond", "cross", "ring"]
CountDist = Literal["uniform", "zipf"]
Box = tuple[int, int, int, int]


@dataclass(frozen=True)
class ShapeClass:
    """One class of the set: its label, the shape drawn and its RGB fill colour."""

    label: str
    kind: ShapeKind
    rgb: tuple[int, int, int]


# Each shape comes in two colours and each colour is used once, so a label needs both cues.
SHAPE_CLASSES: tuple[ShapeClass, ...] = (
    ShapeClass("red square", "square", (220, 30, 30)),
    ShapeClass("blue circle", "circle", (30, 60, 230)),
    ShapeClass("green triangle", "triangle", (30, 190, 40)),
    ShapeClass("yellow square", "square", (240, 220, 30)),
    ShapeClass("purple circle", "circle", (150, 40, 190)),
    ShapeClass("orange triangle", "triangle", (250, 130, 20)),
)
# Shapes outside the label set (other kinds, other colours): drawn, never labelled, so a model that
# names them hallucinates. Their labels appear only in statistics.
DISTRACTOR_CLASSES: tuple[ShapeClass, ...] = (
    ShapeClass("white cross", "cross", (245, 245, 245)),
    ShapeClass("cyan diamond", "diamond", (40, 210, 220)),
    ShapeClass("pink ring", "ring", (250, 140, 200)),
)

MAX_OVERLAP = 0.2  # default max box intersection / smaller box area
PLACEMENT_TRIES = 30
TIED_ROW_PX = 3  # a tied row: top edges at most this far apart (px at 224)
SAME_CLASS_ROW = (4, 8)  # shapes in a same-class row (fewer when the image has fewer objects)
SAME_CLASS_ROW_GAP_PX = (2, 6)  # gap between neighbours of a same-class row (px at 224)
ZIPF_EXPONENT = 1.0  # count_dist zipf: P(min + k) proportional to 1 / (k + 1) ** ZIPF_EXPONENT
NOISE_STD = 12.0


@dataclass(frozen=True)
class ShapesDifficulty:
    """How hard the set is. The defaults are the set as it always shipped (same bytes per seed).

    Sides are given at 224 px and scaled with the image size; a shape that finds no free place
    after a few tries is skipped (counted as a failed placement), so crowded settings can yield
    fewer than ``min_objects``.
    """

    min_objects: int = 1
    max_objects: int = 6
    min_side: int = 30
    max_side: int = 90
    noise_std: float = NOISE_STD
    # Fraction of images whose second shape is placed on the first one's row (top edges within
    # TIED_ROW_PX), so their canonical order is decided by x: order matters, not just the set.
    tied_row_frac: float = 0.0
    # Max box intersection / smaller box area between any two shapes.
    max_overlap: float = MAX_OVERLAP
    # None: shapes never cover each other's pixels. A fraction f: later shapes are drawn over
    # earlier ones (boxes still bounded by max_overlap); a labelled shape hidden by more than f of
    # its pixels is dropped (neither drawn nor labelled); every box is the visible extent.
    occlusion: float | None = None
    # Fraction of images holding one row of 4-8 same-class, same-size shapes a few px apart, on
    # one top edge (the structured-duplicate trigger); the row counts towards the image's objects.
    same_class_row_frac: float = 0.0
    # Unlabelled shapes of DISTRACTOR_CLASSES per image (placed after the labelled ones).
    distractors: int = 0
    # How the object count is drawn in [min_objects, max_objects]: uniform, or zipf (heavy tail).
    count_dist: CountDist = "uniform"

    def __post_init__(self) -> None:
        problems = []
        if not 1 <= self.min_objects <= self.max_objects:
            problems.append(
                f"min_objects = {self.min_objects}, max_objects = {self.max_objects}: use 1 <= min <= max"
            )
        if not 8 <= self.min_side <= self.max_side <= 200:
            problems.append(
                f"min_side = {self.min_side}, max_side = {self.max_side}: use 8 <= min <= max <= 200 (px at 224)"
            )
        if not self.noise_std >= 0:
            problems.append(f"noise_std = {self.noise_std}: use a value >= 0")
        if not 0 <= self.tied_row_frac <= 1:
            problems.append(f"tied_row_frac = {self.tied_row_frac}: use a fraction in [0, 1]")
        if not 0 <= self.max_overlap <= 1:
            problems.append(f"max_overlap = {self.max_overlap}: use a fraction in [0, 1]")
        if self.occlusion is not None and not 0 <= self.occlusion < 1:
            problems.append(
                f"occlusion = {self.occlusion}: use the largest hidden fraction a kept shape may have, in [0, 1)"
            )
        if not 0 <= self.same_class_row_frac <= 1:
            problems.append(f"same_class_row_frac = {self.same_class_row_frac}: use a fraction in [0, 1]")
        if (
            isinstance(self.distractors, bool)
            or not isinstance(self.distractors, int)
            or self.distractors < 0
        ):
            problems.append(f"distractors = {self.distractors!r}: use an integer >= 0")
        if self.count_dist not in ("uniform", "zipf"):
            problems.append(f"count_dist = {self.count_dist!r}: use 'uniform' or 'zipf'")
        if problems:
            raise DataError("ShapesDifficulty: " + "; ".join(problems))


@dataclass
class DrawnSample:
    """One drawn image, its labelled objects (canonical order) and what did not make it in."""

    image: Image.Image
    objects: list[RecordObject]
    failed_placements: int = 0  # labelled shapes that found no place
    failed_distractors: int = 0  # distractors that found no place
    dropped_by_occlusion: int = 0  # labelled shapes hidden beyond ``occlusion``
    tied_row: bool = False
    same_class_row: int = 0  # shapes in this image's same-class row (0: none)


@dataclass
class _Placed:
    """A placed shape: its mask at ``(x, y)``, colour, and label (None for a distractor)."""

    mask: np.ndarray
    x: int
    y: int
    rgb: tuple[int, int, int]
    label: str | None

    @property
    def box(self) -> Box:
        h, w = self.mask.shape
        return (self.x, self.y, self.x + w, self.y + h)


def draw_sample(
    size: int, rng: np.random.Generator, difficulty: ShapesDifficulty, *, noise_std: float
) -> DrawnSample:
    """One image and its objects (top-to-bottom, then left-to-right) drawn from ``rng``."""
    pixels = _background(size, rng)
    scale = size / 224
    side_lo, side_hi = round(difficulty.min_side * scale), round(difficulty.max_side * scale)
    count = _object_count(rng, difficulty)
    # drawn only when asked for, so the default set keeps its bytes
    tied = difficulty.tied_row_frac > 0 and rng.random() < difficulty.tied_row_frac
    canvas = _Canvas(size, difficulty)
    drawn = DrawnSample(image=Image.new("RGB", (1, 1)), objects=[], tied_row=tied)
    if difficulty.same_class_row_frac > 0 and rng.random() < difficulty.same_class_row_frac:
        row = _same_class_row(rng, count, size, scale, side_lo, side_hi)
        for shape in row:
            canvas.add(shape)
        drawn.same_class_row = len(row)
        count -= len(row)
    loop_boxes: list[Box] = []
    for index in range(count):
        shape = SHAPE_CLASSES[int(rng.integers(len(SHAPE_CLASSES)))]
        mask = _shape_mask(shape.kind, int(rng.integers(side_lo, side_hi + 1)))
        row_top = loop_boxes[0][1] if tied and index == 1 and loop_boxes else None
        corner = canvas.place(mask, rng, row=row_top, row_slack=max(1, round(TIED_ROW_PX * scale)))
        if corner is None:
            drawn.failed_placements += 1
            continue
        placed = _Placed(mask, *corner, shape.rgb, shape.label)
        canvas.add(placed)
        loop_boxes.append(placed.box)
    for _ in range(difficulty.distractors):
        shape = DISTRACTOR_CLASSES[int(rng.integers(len(DISTRACTOR_CLASSES)))]
        mask = _shape_mask(shape.kind, int(rng.integers(side_lo, side_hi + 1)))
        corner = canvas.place(mask, rng)
        if corner is None:
            drawn.failed_distractors += 1
            continue
        canvas.add(_Placed(mask, *corner, shape.rgb, None))
    visible, drawn.dropped_by_occlusion = _resolve_occlusion(canvas.shapes, size, difficulty.occlusion)
    for shape, own in visible:
        pixels[shape.y : shape.y + own.shape[0], shape.x : shape.x + own.shape[1]][own] = shape.rgb
        if shape.label is not None:
            drawn.objects.append(RecordObject(label=shape.label, bbox=_visible_box(shape, own)))
    if noise_std > 0:
        # One noise pass over background and shapes alike: shapes are not flat-coloured give-aways.
        noise = rng.standard_normal(size=(size, size, 3), dtype=np.float32) * np.float32(noise_std)
        pixels = np.clip(pixels.astype(np.float32) + noise, 0, 255).astype(np.uint8)
    drawn.objects.sort(key=lambda o: (o.bbox[1], o.bbox[0], o.bbox[3], o.bbox[2], o.label))
    drawn.image = Image.fromarray(pixels)
    return drawn


class _Canvas:
    """The shapes placed so far, the pixels they cover, and the placement rules of a difficulty."""

    def __init__(self, size: int, difficulty: ShapesDifficulty):
        self.size = size
        self.max_overlap = difficulty.max_overlap
        self.may_cover = difficulty.occlusion is not None
        self.occupied = np.zeros((size, size), dtype=bool)
        self.shapes: list[_Placed] = []

    def add(self, shape: _Placed) -> None:
        h, w = shape.mask.shape
        self.occupied[shape.y : shape.y + h, shape.x : shape.x + w] |= shape.mask
        self.shapes.append(shape)

    def place(
        self, mask: np.ndarray, rng: np.random.Generator, *, row: int | None = None, row_slack: int = 0
    ) -> tuple[int, int] | None:
        """A top-left corner where ``mask``'s box overlaps every placed box by <= ``max_overlap``
        and (without occlusion) covers no drawn pixel, or None after PLACEMENT_TRIES. With ``row``,
        the top edge lies within ``row_slack`` px of it.
        """
        h, w = mask.shape
        boxes = [s.box for s in self.shapes]
        for _ in range(PLACEMENT_TRIES):
            x = int(rng.integers(0, self.size - w + 1))
            if row is None:
                y = int(rng.integers(0, self.size - h + 1))
            else:
                y = int(np.clip(row + rng.integers(-row_slack, row_slack + 1), 0, self.size - h))
            candidate = (x, y, x + w, y + h)
            if all(_overlap(candidate, b) <= self.max_overlap for b in boxes) and (
                self.may_cover or not self.occupied[y : y + h, x : x + w][mask].any()
            ):
                return (x, y)
        return None


def _object_count(rng: np.random.Generator, difficulty: ShapesDifficulty) -> int:
    lo, hi = difficulty.min_objects, difficulty.max_objects
    if difficulty.count_dist == "uniform":
        return int(rng.integers(lo, hi + 1))
    weights = 1.0 / np.arange(1, hi - lo + 2, dtype=np.float64) ** ZIPF_EXPONENT
    return lo + int(rng.choice(hi - lo + 1, p=weights / weights.sum()))


def _same_class_row(
    rng: np.random.Generator, count: int, size: int, scale: float, side_lo: int, side_hi: int
) -> list[_Placed]:
    """A row of one class and one size on one top edge, neighbours a few px apart, on an empty canvas
    (so it always fits): SAME_CLASS_ROW shapes, at most ``count`` and at most what fits across."""
    shape = SHAPE_CLASSES[int(rng.integers(len(SHAPE_CLASSES)))]
    mask = _shape_mask(shape.kind, int(rng.integers(side_lo, side_hi + 1)))
    gap_lo, gap_hi = (max(1, round(g * scale)) for g in SAME_CLASS_ROW_GAP_PX)
    gap = int(rng.integers(gap_lo, gap_hi + 1))
    h, w = mask.shape
    wanted = int(rng.integers(SAME_CLASS_ROW[0], SAME_CLASS_ROW[1] + 1))
    n = max(1, min(wanted, count, (size + gap) // (w + gap)))
    width = n * w + (n - 1) * gap
    x0 = int(rng.integers(0, size - width + 1))
    y0 = int(rng.integers(0, size - h + 1))
    return [_Placed(mask, x0 + i * (w + gap), y0, shape.rgb, shape.label) for i in range(n)]


def _resolve_occlusion(
    shapes: list[_Placed], size: int, occlusion: float | None
) -> tuple[list[tuple[_Placed, np.ndarray]], int]:
    """Each drawn shape with its visible mask (in drawing order), and how many labelled shapes were
    dropped. Later shapes cover earlier ones; going from the top shape down, a labelled shape hidden
    by more than ``occlusion`` of its pixels is dropped, which uncovers the shapes below it."""
    if occlusion is None:  # nothing covers anything: every mask is fully visible
        return [(s, s.mask) for s in shapes], 0
    covered = np.zeros((size, size), dtype=bool)
    kept: list[tuple[_Placed, np.ndarray]] = []
    dropped = 0
    for shape in reversed(shapes):
        h, w = shape.mask.shape
        region = covered[shape.y : shape.y + h, shape.x : shape.x + w]
        own = shape.mask & ~region
        if shape.label is not None and (1.0 - own.sum() / shape.mask.sum()) > occlusion:
            dropped += 1
            continue
        region |= shape.mask
        kept.append((shape, own))
    return kept[::-1], dropped


def _visible_box(shape: _Placed, own: np.ndarray) -> tuple[float, float, float, float]:
    """The pixel extent (``x2``/``y2`` exclusive) of a shape's visible pixels."""
    rows, cols = np.flatnonzero(own.any(axis=1)), np.flatnonzero(own.any(axis=0))
    return (
        float(shape.x + cols[0]),
        float(shape.y + rows[0]),
        float(shape.x + cols[-1] + 1),
        float(shape.y + rows[-1] + 1),
    )


def _background(size: int, rng: np.random.Generator) -> np.ndarray:
    """A muted base colour plus a random linear gradient (uint8, H x W x 3); noise comes later."""
    base = (rng.uniform(70, 170) + rng.uniform(-25, 25, size=3)).astype(np.float32)
    ramp = np.linspace(-1.0, 1.0, size, dtype=np.float32)
    gx, gy = rng.uniform(-20, 20, size=2).astype(np.float32)
    gradient = gx * ramp[None, :, None] + gy * ramp[:, None, None]
    return np.clip(base + gradient, 0, 255).astype(np.uint8)


def _overlap(a: Box, b: Box) -> float:
    ix = max(0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0, min(a[3], b[3]) - max(a[1], b[1]))
    smaller = min((a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1]))
    return ix * iy / smaller


@functools.cache
def _shape_mask(kind: ShapeKind, side: int) -> np.ndarray:
    """The filled pixels of a shape drawn in a ``side`` square, cropped to their exact extent (read-only)."""
    canvas = Image.new("L", (side, side), 0)
    draw = ImageDraw.Draw(canvas)
    last = side - 1  # PIL coordinates are inclusive pixel indices
    if kind == "square":
        draw.rectangle((0, 0, last, last), fill=255)
    elif kind == "circle":
        draw.ellipse((0, 0, last, last), fill=255)
    elif kind == "triangle":
        draw.polygon(((last / 2, 0), (last, last), (0, last)), fill=255)
    elif kind == "diamond":
        draw.polygon(((last / 2, 0), (last, last / 2), (last / 2, last), (0, last / 2)), fill=255)
    elif kind == "cross":
        bar = max(1, side // 3)
        draw.rectangle(((side - bar) // 2, 0, (side - bar) // 2 + bar - 1, last), fill=255)
        draw.rectangle((0, (side - bar) // 2, last, (side - bar) // 2 + bar - 1), fill=255)
    else:  # ring
        draw.ellipse((0, 0, last, last), fill=255)
        inset = max(1, side // 4)
        draw.ellipse((inset, inset, last - inset, last - inset), fill=0)
    box = canvas.getbbox()
    assert box is not None, "a shape of side >= 1 always covers pixels"
    mask = np.asarray(canvas.crop(box)) > 0
    mask.flags.writeable = False
    return mask
