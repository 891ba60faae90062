"""The synthetic coloured-shapes detection set: small, learnable by a tiny model, fully deterministic.

Owns: :func:`generate_shapes` (PNG images + ``train.jsonl``/``val.jsonl`` in the record format of
``data.records``), :func:`shape_sample` (one of its samples, optionally noise-free), the class
list :data:`SHAPE_CLASSES` and the difficulty knobs :class:`ShapesDifficulty`. By default each
image has 1-6 filled shapes on a noisy background; shapes never cover each other (their boxes may
overlap a little), so a box is the exact pixel extent of its visible shape (``x2``/``y2``
exclusive); sides are 30-90 px at 224 px (scaled with ``size``). Fewer, larger objects
(``ShapesDifficulty(max_objects=2, min_side=60, max_side=110)``) make a set a tiny model learns in
minutes on a CPU (docs/runbook.md, "Demo").
Each image is drawn from its own random stream ``(seed, split, index)``, so the same seed gives
byte-identical files, and growing ``n_train`` keeps the earlier images unchanged.
Leaves out: real data (``data.convert``) and prompt encoding (``data.prompts``).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image, ImageDraw

from rollmatch.data.records import Record, RecordObject, write_records
from rollmatch.errors import DataError

ShapeKind = Literal["square", "circle", "triangle"]


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

MAX_OVERLAP = 0.2  # max box intersection / smaller box area; drawn pixels never overlap
PLACEMENT_TRIES = 30
MIN_SIZE = 64
TIED_ROW_PX = 3  # a tied row: top edges at most this far apart (px at 224)
NOISE_STD = 12.0
_SPLIT_STREAM = {"train": 0, "val": 1}


@dataclass(frozen=True)
class ShapesDifficulty:
    """How hard the set is. The defaults are the set as it always shipped (same bytes per seed).

    Sides are given at 224 px and scaled with the image size; a shape that finds no free place
    after a few tries is skipped, so crowded settings can yield fewer than ``min_objects``.
    """

    min_objects: int = 1
    max_objects: int = 6
    min_side: int = 30
    max_side: int = 90
    noise_std: float = NOISE_STD
    # Fraction of images whose second shape is placed on the first one's row (top edges within
    # TIED_ROW_PX), so their canonical order is decided by x: order matters, not just the set.
    tied_row_frac: float = 0.0

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
        if problems:
            raise DataError("ShapesDifficulty: " + "; ".join(problems))


def generate_shapes(
    out_dir: str | os.PathLike[str],
    *,
    n_train: int = 256,
    n_val: int = 32,
    size: int = 224,
    seed: int = 0,
    difficulty: ShapesDifficulty | None = None,
) -> dict[str, Path]:
    """Write ``out_dir/images/*.png`` and ``train.jsonl`` (+ ``val.jsonl`` when ``n_val > 0``).

    Image paths in the JSONL files are relative to ``out_dir``, so the folder can be moved.
    Returns ``{"train": path, "val": path}`` (no ``"val"`` when ``n_val == 0``).
    """
    _check_arguments(n_train=n_train, n_val=n_val, size=size, seed=seed)
    out = Path(out_dir).absolute()
    (out / "images").mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for split, count in (("train", n_train), ("val", n_val)):
        if count == 0:
            continue
        records = [_write_sample(out, split, i, size, seed, difficulty) for i in range(count)]
        paths[split] = write_records(out / f"{split}.jsonl", records, relative_to=out)
    return paths


def shape_sample(
    index: int,
    *,
    split: Literal["train", "val"] = "train",
    size: int = 224,
    seed: int = 0,
    difficulty: ShapesDifficulty | None = None,
    noise_std: float | None = None,
) -> tuple[Image.Image, list[RecordObject]]:
    """The image and objects that :func:`generate_shapes` writes for ``split``/``index``.

    ``noise_std=0`` gives the same layout without pixel noise (for inspecting the geometry); by
    default the difficulty's ``noise_std`` applies.
    """
    if split not in _SPLIT_STREAM:
        raise DataError(f"split = {split!r}: use one of {sorted(_SPLIT_STREAM)}")
    difficulty = difficulty or ShapesDifficulty()
    rng = np.random.default_rng([seed, _SPLIT_STREAM[split], index])
    noise = difficulty.noise_std if noise_std is None else noise_std
    return _draw_sample(size, rng, difficulty, noise_std=noise)


def _draw_sample(
    size: int, rng: np.random.Generator, difficulty: ShapesDifficulty, *, noise_std: float
) -> tuple[Image.Image, list[RecordObject]]:
    """One image and its objects (top-to-bottom, then left-to-right) drawn from ``rng``."""
    pixels = _background(size, rng)
    occupied = np.zeros((size, size), dtype=bool)
    scale = size / 224
    side_lo, side_hi = round(difficulty.min_side * scale), round(difficulty.max_side * scale)
    boxes: list[tuple[int, int, int, int]] = []
    objects: list[RecordObject] = []
    count = int(rng.integers(difficulty.min_objects, difficulty.max_objects + 1))
    # drawn only when asked for, so the default set keeps its bytes
    tied = difficulty.tied_row_frac > 0 and rng.random() < difficulty.tied_row_frac
    for index in range(count):
        shape = SHAPE_CLASSES[int(rng.integers(len(SHAPE_CLASSES)))]
        mask = _shape_mask(shape.kind, int(rng.integers(side_lo, side_hi + 1)))
        row = boxes[0][1] if tied and index == 1 and boxes else None
        corner = _place(mask, occupied, boxes, rng, row=row, row_slack=max(1, round(TIED_ROW_PX * scale)))
        if corner is None:
            continue
        x, y = corner
        h, w = mask.shape
        occupied[y : y + h, x : x + w] |= mask
        pixels[y : y + h, x : x + w][mask] = shape.rgb
        boxes.append((x, y, x + w, y + h))
        objects.append(RecordObject(label=shape.label, bbox=(float(x), float(y), float(x + w), float(y + h))))
    if noise_std > 0:
        # One noise pass over background and shapes alike: shapes are not flat-coloured give-aways.
        noise = rng.standard_normal(size=(size, size, 3), dtype=np.float32) * np.float32(noise_std)
        pixels = np.clip(pixels.astype(np.float32) + noise, 0, 255).astype(np.uint8)
    objects.sort(key=lambda o: (o.bbox[1], o.bbox[0], o.bbox[3], o.bbox[2], o.label))
    return Image.fromarray(pixels), objects


def _write_sample(
    out: Path, split: str, index: int, size: int, seed: int, difficulty: ShapesDifficulty | None
) -> Record:
    image, objects = shape_sample(index, split=split, size=size, seed=seed, difficulty=difficulty)  # type: ignore[arg-type]
    image_path = out / "images" / f"{split}-{index:05d}.png"
    image.save(image_path, format="PNG", compress_level=1)
    return Record(
        id=f"{split}-{index:05d}", images=(str(image_path),), width=size, height=size, objects=tuple(objects)
    )


def _background(size: int, rng: np.random.Generator) -> np.ndarray:
    """A muted base colour plus a random linear gradient (uint8, H x W x 3); noise comes later."""
    base = (rng.uniform(70, 170) + rng.uniform(-25, 25, size=3)).astype(np.float32)
    ramp = np.linspace(-1.0, 1.0, size, dtype=np.float32)
    gx, gy = rng.uniform(-20, 20, size=2).astype(np.float32)
    gradient = gx * ramp[None, :, None] + gy * ramp[:, None, None]
    return np.clip(base + gradient, 0, 255).astype(np.uint8)


def _place(
    mask: np.ndarray,
    occupied: np.ndarray,
    boxes: list[tuple[int, int, int, int]],
    rng: np.random.Generator,
    *,
    row: int | None = None,
    row_slack: int = 0,
) -> tuple[int, int] | None:
    """A top-left corner where ``mask`` covers no drawn pixel and its box overlaps every placed box
    by <= MAX_OVERLAP (so no shape is occluded and every box stays tight), or None. With ``row``,
    the top edge lies within ``row_slack`` px of it.
    """
    h, w = mask.shape
    size = occupied.shape[0]
    for _ in range(PLACEMENT_TRIES):
        x = int(rng.integers(0, size - w + 1))
        if row is None:
            y = int(rng.integers(0, size - h + 1))
        else:
            y = int(np.clip(row + rng.integers(-row_slack, row_slack + 1), 0, size - h))
        candidate = (x, y, x + w, y + h)
        if (
            all(_overlap(candidate, b) <= MAX_OVERLAP for b in boxes)
            and not occupied[y : y + h, x : x + w][mask].any()
        ):
            return (x, y)
    return None


def _overlap(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> float:
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
    else:
        draw.polygon(((last / 2, 0), (last, last), (0, last)), fill=255)
    box = canvas.getbbox()
    assert box is not None, "a shape of side >= 1 always covers pixels"
    mask = np.asarray(canvas.crop(box)) > 0
    mask.flags.writeable = False
    return mask


def _check_arguments(*, n_train: int, n_val: int, size: int, seed: int) -> None:
    problems = []
    if isinstance(n_train, bool) or not isinstance(n_train, int) or n_train < 1:
        problems.append(f"n_train = {n_train!r}: use an integer >= 1")
    if isinstance(n_val, bool) or not isinstance(n_val, int) or n_val < 0:
        problems.append(f"n_val = {n_val!r}: use an integer >= 0")
    if isinstance(size, bool) or not isinstance(size, int) or size < MIN_SIZE:
        problems.append(f"size = {size!r}: use an integer >= {MIN_SIZE} (shapes are 30-90 px at 224)")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        problems.append(f"seed = {seed!r}: use a non-negative integer")
    if problems:
        raise DataError("generate_shapes: " + "; ".join(problems))
