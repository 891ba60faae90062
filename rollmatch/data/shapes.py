"""The synthetic coloured-shapes detection set: small, learnable by a tiny model, fully deterministic.

Owns: :func:`generate_shapes` (PNG images + ``train.jsonl``/``val.jsonl`` in the record format of
``data.records``, and ``stats.json``: the realised objects per image and what could not be placed),
:func:`shape_sample` (one of its samples, optionally noise-free), the named presets
(:data:`SHAPES_PRESETS`) and the statistics (:class:`SplitStats`). By default each image has 1-6
filled shapes on a noisy background; shapes never cover each other (their boxes may overlap a
little), so a box is the exact pixel extent of its visible shape (``x2``/``y2`` exclusive); sides
are 30-90 px at 224 px (scaled with ``size``). Fewer, larger objects
(``ShapesDifficulty(max_objects=2, min_side=60, max_side=110)``) make a set a tiny model learns in
minutes on a CPU (docs/runbook.md, "Demo"); the ``crowd`` preset makes dense scenes.
Each image is drawn from its own random stream ``(seed, split, index)``, so the same seed gives
byte-identical files, and growing ``n_train`` keeps the earlier images unchanged.
Leaves out: how one image is laid out and drawn, the classes and the difficulty knobs
(``data.shapes_draw``, re-exported here), real data (``data.convert``) and prompt encoding
(``data.prompts``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image

from rollmatch.data.records import Record, RecordObject, write_records
from rollmatch.data.shapes_draw import (
    DISTRACTOR_CLASSES,
    SHAPE_CLASSES,
    DrawnSample,
    ShapeClass,
    ShapesDifficulty,
    draw_sample,
)
from rollmatch.errors import DataError

__all__ = [
    "DISTRACTOR_CLASSES",
    "SHAPES_PRESETS",
    "SHAPE_CLASSES",
    "STATS_FILE",
    "ShapeClass",
    "ShapesDifficulty",
    "SplitStats",
    "generate_shapes",
    "shape_sample",
]

MIN_SIZE = 64
STATS_FILE = "stats.json"
_SPLIT_STREAM = {"train": 0, "val": 1}

# Named difficulty settings (sides at 224 px). crowd: dense scenes where an autoregressive detector
# stops early, repeats and reorders: 8-30 objects of 16-32 px, a third of images with a tied row.
# medium: objects of at least one 32 px visual token of the tiny models at 224 px, few enough that a
# tiny detector can localise them, many enough for list errors (4-12 of 32-56 px); medium_dense and
# medium_sparse are the rungs above and below it of the medium study's pre-registered ladder
# (docs/runbook.md, "Medium scenes").
SHAPES_PRESETS: dict[str, ShapesDifficulty] = {
    "crowd": ShapesDifficulty(min_objects=8, max_objects=30, min_side=16, max_side=32, tied_row_frac=1 / 3),
    "medium": ShapesDifficulty(min_objects=4, max_objects=12, min_side=32, max_side=56, tied_row_frac=1 / 3),
    "medium_dense": ShapesDifficulty(
        min_objects=7, max_objects=18, min_side=32, max_side=48, tied_row_frac=1 / 3
    ),
    "medium_sparse": ShapesDifficulty(
        min_objects=3, max_objects=8, min_side=40, max_side=64, tied_row_frac=1 / 3
    ),
}


@dataclass
class SplitStats:
    """What one split really holds: objects per image and the shapes that did not make it in."""

    images: int = 0
    objects_per_image: list[int] = field(default_factory=list)
    failed_placements: int = 0  # labelled shapes that found no place (the image has fewer objects)
    failed_distractors: int = 0
    dropped_by_occlusion: int = 0
    tied_rows: int = (
        0  # images drawn with a tied row (the 2nd shape goes on the 1st one's row if it finds room)
    )
    same_class_rows: int = 0  # images with a same-class row

    def add(self, drawn: DrawnSample) -> None:
        self.images += 1
        self.objects_per_image.append(len(drawn.objects))
        self.failed_placements += drawn.failed_placements
        self.failed_distractors += drawn.failed_distractors
        self.dropped_by_occlusion += drawn.dropped_by_occlusion
        self.tied_rows += int(drawn.tied_row)
        self.same_class_rows += int(drawn.same_class_row > 0)

    def summary(self) -> dict[str, float | int]:
        """Objects per image (mean, min, p10/p50/p90, max; numpy's linear percentiles) and the counts."""
        counts = np.asarray(self.objects_per_image or [0], dtype=np.float64)
        p10, p50, p90 = (float(v) for v in np.percentile(counts, [10, 50, 90]))
        return {
            "images": self.images,
            "objects": int(counts.sum()),
            "objects_mean": float(counts.mean()),
            "objects_min": int(counts.min()),
            "objects_p10": p10,
            "objects_p50": p50,
            "objects_p90": p90,
            "objects_max": int(counts.max()),
            "failed_placements": self.failed_placements,
            "failed_distractors": self.failed_distractors,
            "dropped_by_occlusion": self.dropped_by_occlusion,
            "tied_rows": self.tied_rows,
            "same_class_rows": self.same_class_rows,
        }

    def line(self, split: str) -> str:
        """One printed line, e.g. ``train: 200 images, objects/image mean 19.4 (p10 10 / ...)``."""
        s = self.summary()
        return (
            f"{split}: {s['images']} images, objects/image mean {s['objects_mean']:.1f} "
            f"(p10 {s['objects_p10']:g} / p50 {s['objects_p50']:g} / p90 {s['objects_p90']:g}, "
            f"max {s['objects_max']}); failed placements {s['failed_placements']}, dropped by occlusion "
            f"{s['dropped_by_occlusion']}, failed distractors {s['failed_distractors']}; tied rows "
            f"{s['tied_rows']}, same-class rows {s['same_class_rows']}"
        )


def generate_shapes(
    out_dir: str | os.PathLike[str],
    *,
    n_train: int = 256,
    n_val: int = 32,
    size: int = 224,
    seed: int = 0,
    difficulty: ShapesDifficulty | None = None,
    stats: dict[str, SplitStats] | None = None,
) -> dict[str, Path]:
    """Write ``out_dir/images/*.png``, ``train.jsonl`` (+ ``val.jsonl`` when ``n_val > 0``) and
    ``stats.json`` (the difficulty, the arguments and each split's :meth:`SplitStats.summary`).

    Image paths in the JSONL files are relative to ``out_dir``, so the folder can be moved.
    Returns ``{"train": path, "val": path}`` (no ``"val"`` when ``n_val == 0``); pass a dict as
    ``stats`` to receive each split's :class:`SplitStats`.
    """
    _check_arguments(n_train=n_train, n_val=n_val, size=size, seed=seed)
    difficulty = difficulty or ShapesDifficulty()
    out = Path(out_dir).absolute()
    (out / "images").mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    split_stats: dict[str, SplitStats] = {} if stats is None else stats
    for split, count in (("train", n_train), ("val", n_val)):
        if count == 0:
            continue
        split_stats[split] = SplitStats()
        records = [
            _write_sample(out, split, i, size, seed, difficulty, split_stats[split]) for i in range(count)
        ]
        paths[split] = write_records(out / f"{split}.jsonl", records, relative_to=out)
    report = {
        "arguments": {"n_train": n_train, "n_val": n_val, "size": size, "seed": seed},
        "difficulty": asdict(difficulty),
        "splits": {split: s.summary() for split, s in split_stats.items()},
    }
    (out / STATS_FILE).write_text(json.dumps(report, indent=2) + "\n")
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
    drawn = _drawn_sample(index, split, size, seed, difficulty, noise_std)
    return drawn.image, drawn.objects


def _drawn_sample(
    index: int,
    split: str,
    size: int,
    seed: int,
    difficulty: ShapesDifficulty | None,
    noise_std: float | None,
) -> DrawnSample:
    if split not in _SPLIT_STREAM:
        raise DataError(f"split = {split!r}: use one of {sorted(_SPLIT_STREAM)}")
    difficulty = difficulty or ShapesDifficulty()
    rng = np.random.default_rng([seed, _SPLIT_STREAM[split], index])
    noise = difficulty.noise_std if noise_std is None else noise_std
    return draw_sample(size, rng, difficulty, noise_std=noise)


def _write_sample(
    out: Path, split: str, index: int, size: int, seed: int, difficulty: ShapesDifficulty, stats: SplitStats
) -> Record:
    drawn = _drawn_sample(index, split, size, seed, difficulty, None)
    stats.add(drawn)
    image_path = out / "images" / f"{split}-{index:05d}.png"
    drawn.image.save(image_path, format="PNG", compress_level=1)
    return Record(
        id=f"{split}-{index:05d}",
        images=(str(image_path),),
        width=size,
        height=size,
        objects=tuple(drawn.objects),
    )


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
