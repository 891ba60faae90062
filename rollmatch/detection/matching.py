"""Hungarian matching of predicted objects to ground truth (pure: numpy + scipy).

Owns: :func:`hungarian_match` and :class:`MatchResult`. Leaves out: counting precision/recall
(``detection.metrics``) and building targets from the unmatched GT (``detection.targets``).

The assignment is ``scipy.optimize.linear_sum_assignment`` on a square matrix of size
``P + G``::

                 gt 0..G-1                      P dummy columns ("unmatched pred")
    pred 0..P-1  1 - IoU, or FORBIDDEN           fp_cost
    G dummy rows fn_cost                         0

A pair is allowed iff its IoU is positive and at least ``iou_threshold`` (and, under
``label_mode="require"``, the labels are equal). So ``iou_threshold: 0`` means "any overlap": boxes
that only touch or lie apart (IoU 0) never match, at any threshold. The dummy blocks always give a
feasible assignment, so a forbidden pair is never chosen.

Ignore regions (COCO's ``iscrowd`` boxes, a record's ``ignore``): a prediction left unmatched after the
assignment that lies on a region (:func:`~rollmatch.detection.objects.crowd_overlap` >=
``iou_threshold``, same label under ``label_mode: require``) is *ignored*: neither a match nor a false
positive, as COCO's evaluation treats detections matched to crowd GT. Regions never take part in the
assignment, so they cannot take a prediction from a real object, and any number of predictions may
fall on one region.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from pydantic import ValidationError
from scipy.optimize import linear_sum_assignment

from rollmatch.config.schema import MatchingConfig
from rollmatch.detection.objects import DetObject, crowd_overlap, iou_matrix
from rollmatch.errors import ConfigError, ConfigProblem

_DEFAULTS = MatchingConfig()


@dataclass
class MatchResult:
    """Matched pairs, unmatched GT (false negatives), unmatched predictions (false positives) and the
    unmatched predictions on an ignore region (neither)."""

    pairs: list[tuple[int, int, float]] = field(default_factory=list)  # (pred index, gt index, iou)
    fn: list[int] = field(default_factory=list)  # unmatched gt indices, sorted
    fp: list[int] = field(default_factory=list)  # unmatched pred indices off every ignore region, sorted
    ignored: list[int] = field(default_factory=list)  # unmatched pred indices on an ignore region, sorted


def hungarian_match(
    preds: Sequence[DetObject],
    gts: Sequence[DetObject],
    *,
    iou_threshold: float = _DEFAULTS.iou_threshold,
    label_mode: str = _DEFAULTS.label_mode,
    fp_cost: float = _DEFAULTS.fp_cost,
    fn_cost: float = _DEFAULTS.fn_cost,
    ignore_regions: Sequence[DetObject] = (),
) -> MatchResult:
    """Minimum-cost one-to-one matching of ``preds`` to ``gts`` (accepts ``**MatchingConfig.model_dump()``).

    Pairs are sorted by prediction index. Empty inputs are normal: no predictions -> every GT is a
    false negative; no GT -> every prediction is a false positive, unless it lies on one of
    ``ignore_regions`` (see the module docstring).
    """
    _check_settings(iou_threshold, label_mode, fp_cost, fn_cost)
    num_pred, num_gt = len(preds), len(gts)
    if num_pred == 0 or num_gt == 0:
        fp, ignored = _split_unmatched(preds, range(num_pred), ignore_regions, iou_threshold, label_mode)
        return MatchResult(pairs=[], fn=list(range(num_gt)), fp=fp, ignored=ignored)

    ious = iou_matrix(preds, gts)
    allowed = (ious > 0.0) & (ious >= iou_threshold)
    if label_mode == "require":
        allowed &= np.asarray([[p.label == g.label for g in gts] for p in preds], dtype=bool)
    # Larger than any feasible total, so it can only be picked if nothing else is possible (never).
    forbidden = 1.0 + (num_pred + num_gt) * (1.0 + fp_cost + fn_cost)

    size = num_pred + num_gt
    cost = np.zeros((size, size), dtype=np.float64)
    cost[:num_pred, :num_gt] = np.where(allowed, 1.0 - ious, forbidden)
    cost[:num_pred, num_gt:] = fp_cost
    cost[num_pred:, :num_gt] = fn_cost
    rows, cols = linear_sum_assignment(cost)

    pairs = [
        (int(r), int(c), float(ious[r, c]))
        for r, c in zip(rows, cols, strict=True)
        if r < num_pred and c < num_gt and allowed[r, c]
    ]
    matched_preds = {p for p, _, _ in pairs}
    matched_gts = {g for _, g, _ in pairs}
    unmatched = [p for p in range(num_pred) if p not in matched_preds]
    fp, ignored = _split_unmatched(preds, unmatched, ignore_regions, iou_threshold, label_mode)
    return MatchResult(
        pairs=pairs, fn=[g for g in range(num_gt) if g not in matched_gts], fp=fp, ignored=ignored
    )


def _split_unmatched(
    preds: Sequence[DetObject],
    unmatched: Iterable[int],
    regions: Sequence[DetObject],
    iou_threshold: float,
    label_mode: str,
) -> tuple[list[int], list[int]]:
    """``(false positives, ignored)``: the unmatched predictions off / on an ignore region."""
    fp: list[int] = []
    ignored: list[int] = []
    for p in unmatched:
        on_region = any(
            (label_mode != "require" or region.label == preds[p].label)
            and (overlap := crowd_overlap(preds[p].bbox, region.bbox)) > 0.0
            and overlap >= iou_threshold
            for region in regions
        )
        (ignored if on_region else fp).append(p)
    return fp, ignored


def _check_settings(iou_threshold: float, label_mode: str, fp_cost: float, fn_cost: float) -> None:
    """The ``matching.*`` bounds live in the schema (``MatchingConfig``); arguments are checked there."""
    try:
        MatchingConfig(iou_threshold=iou_threshold, label_mode=label_mode, fp_cost=fp_cost, fn_cost=fn_cost)
    except ValidationError as exc:
        raise ConfigError(
            [
                ConfigProblem(f"matching.{error['loc'][0]}", error["input"], error["msg"])
                for error in exc.errors(include_url=False)
            ]
        ) from None
