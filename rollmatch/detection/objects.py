"""Detection objects and box geometry (pure: no torch, no I/O).

Owns: :class:`DetObject` (a label and an integer ``xyxy`` box in a coordinate frame), IoU,
canonical ordering, and conversion between pixel boxes and the serialization frames
(``norm1000``: 0..1000 of the image; ``pixels``: pixels of the processor-resized image).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

CoordFrame = Literal["norm1000", "pixels"]
NORM = 1000


@dataclass(frozen=True)
class DetObject:
    """One object: a label and an integer ``(x1, y1, x2, y2)`` box in some coordinate frame."""

    label: str
    bbox: tuple[int, int, int, int]


def iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two ``xyxy`` boxes (0.0 when either is empty)."""
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter / union) if union > 0 else 0.0


def crowd_overlap(pred: Sequence[float], region: Sequence[float]) -> float:
    """The share of ``pred``'s area inside an ignore (crowd) ``region``: COCO's IoU against a crowd
    box, whose "union" is the detection alone (a small box anywhere inside a crowd scores 1)."""
    ix = max(0.0, min(pred[2], region[2]) - max(pred[0], region[0]))
    iy = max(0.0, min(pred[3], region[3]) - max(pred[1], region[1]))
    area = (pred[2] - pred[0]) * (pred[3] - pred[1])
    return float(ix * iy / area) if area > 0 else 0.0


def iou_matrix(preds: Sequence[DetObject], gts: Sequence[DetObject]) -> np.ndarray:
    """Pairwise IoU, shape ``(len(preds), len(gts))``, vectorised."""
    if not preds or not gts:
        return np.zeros((len(preds), len(gts)), dtype=np.float64)
    p = np.asarray([o.bbox for o in preds], dtype=np.float64)[:, None, :]
    g = np.asarray([o.bbox for o in gts], dtype=np.float64)[None, :, :]
    ix = np.clip(np.minimum(p[..., 2], g[..., 2]) - np.maximum(p[..., 0], g[..., 0]), 0, None)
    iy = np.clip(np.minimum(p[..., 3], g[..., 3]) - np.maximum(p[..., 1], g[..., 1]), 0, None)
    inter = ix * iy
    area_p = (p[..., 2] - p[..., 0]) * (p[..., 3] - p[..., 1])
    area_g = (g[..., 2] - g[..., 0]) * (g[..., 3] - g[..., 1])
    union = area_p + area_g - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)


def canonical_order(objects: Sequence[DetObject]) -> list[DetObject]:
    """GT serialization order: top-to-bottom, then left-to-right (ties: bottom, right, label)."""
    return sorted(objects, key=lambda o: (o.bbox[1], o.bbox[0], o.bbox[3], o.bbox[2], o.label))


def frame_extent(frame: CoordFrame, frame_size: tuple[int, int]) -> tuple[int, int]:
    """The ``(max_x, max_y)`` coordinate of a frame: 1000 for ``norm1000``, the resized size for ``pixels``."""
    return (NORM, NORM) if frame == "norm1000" else (int(frame_size[0]), int(frame_size[1]))


def to_frame(
    bbox_px: Sequence[float], image_size: tuple[int, int], frame: CoordFrame, frame_size: tuple[int, int]
) -> tuple[int, int, int, int]:
    """Convert a pixel ``xyxy`` box of an ``image_size=(W, H)`` image into integer frame coordinates.

    ``frame_size`` is the processor-resized ``(W, H)`` (used by ``pixels``). Boxes are clamped to
    the frame and kept non-degenerate (``x2 > x1``, ``y2 > y1``) so every GT box is serializable.
    """
    width, height = image_size
    max_x, max_y = frame_extent(frame, frame_size)
    sx, sy = max_x / width, max_y / height
    x1 = min(max(round(bbox_px[0] * sx), 0), max_x - 1)
    y1 = min(max(round(bbox_px[1] * sy), 0), max_y - 1)
    x2 = min(max(round(bbox_px[2] * sx), x1 + 1), max_x)
    y2 = min(max(round(bbox_px[3] * sy), y1 + 1), max_y)
    return (x1, y1, x2, y2)


def from_frame(
    bbox: Sequence[int], image_size: tuple[int, int], frame: CoordFrame, frame_size: tuple[int, int]
) -> tuple[float, float, float, float]:
    """Inverse of :func:`to_frame`: frame coordinates back to pixel ``xyxy`` of the original image."""
    width, height = image_size
    max_x, max_y = frame_extent(frame, frame_size)
    sx, sy = width / max_x, height / max_y
    return (bbox[0] * sx, bbox[1] * sy, bbox[2] * sx, bbox[3] * sy)
