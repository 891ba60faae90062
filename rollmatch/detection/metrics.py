"""Detection and parse metrics (pure: counts in, floats out).

Owns: :class:`DetectionCounts` (matching counts -> precision / recall / F1 / mean IoU),
:class:`AnswerCounts` (exact count, duplicates, recall by GT count),
:class:`ParseCounts` (parse outcomes -> ``parse/*`` and the truncated fraction) and
:func:`coco_map` (COCO-style mAP via pycocotools' ``COCOeval``). Leaves out: summing across
micro-steps and ranks (``to_sums`` gives additive ``{name: number}`` sums that the trainer adds up
exactly; ``from_sums`` reads them back, and ``training.metric_summary.summarize`` turns them into the
logged values) and logging.

Conventions: a ratio whose denominator is 0 is 0.0, except that nothing to count at all (no
prediction and no GT) is a perfect 1.0 for precision, recall and F1.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from rollmatch.detection.codec import ParseResult
from rollmatch.detection.matching import MatchResult
from rollmatch.detection.objects import DetObject, iou
from rollmatch.errors import DataError, RollmatchError


@dataclass
class DetectionCounts:
    """True/false positives, false negatives and the IoU sum of the matched pairs."""

    tp: int = 0
    fp: int = 0
    fn: int = 0
    iou_sum: float = 0.0
    ignored: int = 0  # predictions on an ignore (crowd) region: in neither precision nor recall

    def add(self, match: MatchResult, n_pred: int, n_gt: int) -> None:
        """Add one image's matching; ``n_pred``/``n_gt`` guard against a match of other lists."""
        placed = len(match.pairs) + len(match.fp) + len(match.ignored)
        if placed != n_pred or len(match.pairs) + len(match.fn) != n_gt:
            raise RollmatchError(
                f"match does not fit {n_pred} predictions / {n_gt} GT objects: {len(match.pairs)} pairs, "
                f"{len(match.fp)} fp, {len(match.ignored)} ignored, {len(match.fn)} fn; pass the lengths of "
                "the lists that were matched"
            )
        self.tp += len(match.pairs)
        self.fp += len(match.fp)
        self.fn += len(match.fn)
        self.iou_sum += sum(iou for _, _, iou in match.pairs)
        self.ignored += len(match.ignored)

    def merge(self, other: DetectionCounts) -> DetectionCounts:
        """A new total of both counts."""
        return DetectionCounts(
            tp=self.tp + other.tp,
            fp=self.fp + other.fp,
            fn=self.fn + other.fn,
            iou_sum=self.iou_sum + other.iou_sum,
            ignored=self.ignored + other.ignored,
        )

    def to_sums(self) -> dict[str, float]:
        """Additive sums (``match/tp``, ``match/fp``, ``match/fn``, ``match/iou_sum``) to add up
        across micro-steps and ranks; :meth:`from_sums` reads them back."""
        return {f"match/{f.name}": float(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_sums(cls, sums: Mapping[str, float]) -> DetectionCounts:
        """The counts in ``sums`` (missing names count 0), e.g. after summing many :meth:`to_sums`."""
        get = {f.name: sums.get(f"match/{f.name}", 0) for f in fields(cls)}
        return cls(
            tp=round(get["tp"]),
            fp=round(get["fp"]),
            fn=round(get["fn"]),
            iou_sum=float(get["iou_sum"]),
            ignored=round(get["ignored"]),
        )

    @property
    def precision(self) -> float:
        return _ratio(self.tp, self.tp + self.fp, empty=self._empty)

    @property
    def recall(self) -> float:
        return _ratio(self.tp, self.tp + self.fn, empty=self._empty)

    @property
    def f1(self) -> float:
        return _ratio(2 * self.tp, 2 * self.tp + self.fp + self.fn, empty=self._empty)

    @property
    def mean_iou(self) -> float:
        return self.iou_sum / self.tp if self.tp else 0.0

    @property
    def _empty(self) -> bool:
        return self.tp == 0 and self.fp == 0 and self.fn == 0

    def as_metrics(self, prefix: str = "match/", per: float = 1.0) -> dict[str, float]:
        """The ``match/*`` metrics: precision, recall, f1, mean_iou, and fn, fp divided by ``per``
        (e.g. the number of optimizer steps the counts cover)."""
        values = {
            "precision": self.precision,
            "recall": self.recall,
            "f1": self.f1,
            "mean_iou": self.mean_iou,
            "fn": self.fn / per,
            "fp": self.fp / per,
        }
        return {prefix + name: value for name, value in values.items()}


DUPLICATE_IOU = 0.7  # a prediction this close to an earlier one of the same answer is a duplicate
RECALL_COUNT_CAP = 8  # recall by GT count: images with this many GT objects or more share a bucket


@dataclass
class AnswerCounts:
    """Per-answer mechanism counts: exact object count, duplicates, and recall by GT count.

    What rollout matching can teach and SFT cannot shows up here first: a model that learns from
    its own answers should stop repeating objects and stop early or late less often, and recall on
    crowded images should move more than on sparse ones.
    """

    images: int = 0
    exact_count: int = 0  # answers with as many valid objects as GT objects
    duplicates: int = 0  # valid objects with the label of an earlier one and IoU >= DUPLICATE_IOU
    duplicates_any_label: int = 0  # the same, whatever the labels
    gt_by_count: dict[int, int] = field(default_factory=dict)  # GT count bucket -> GT objects
    tp_by_count: dict[int, int] = field(default_factory=dict)  # GT count bucket -> matched GT objects

    def add(self, objects: Sequence[DetObject], match: MatchResult, n_gt: int) -> None:
        self.images += 1
        self.exact_count += int(len(objects) == n_gt)
        same, any_label = duplicate_counts(objects)
        self.duplicates += same
        self.duplicates_any_label += any_label
        bucket = min(n_gt, RECALL_COUNT_CAP)
        self.gt_by_count[bucket] = self.gt_by_count.get(bucket, 0) + n_gt
        self.tp_by_count[bucket] = self.tp_by_count.get(bucket, 0) + len(match.pairs)

    def to_sums(self) -> dict[str, float]:
        """Additive sums (``answers/*``); :meth:`from_sums` reads them back."""
        sums = {
            f"answers/{name}": float(getattr(self, name))
            for name in ("images", "exact_count", "duplicates", "duplicates_any_label")
        }
        for bucket, n in self.gt_by_count.items():
            sums[f"answers/gt_{bucket}"] = float(n)
            sums[f"answers/tp_{bucket}"] = float(self.tp_by_count.get(bucket, 0))
        return sums

    @classmethod
    def from_sums(cls, sums: Mapping[str, float]) -> AnswerCounts:
        def by_count(kind: str) -> dict[int, int]:
            prefix = f"answers/{kind}_"
            return {int(k.removeprefix(prefix)): round(v) for k, v in sums.items() if k.startswith(prefix)}

        return cls(
            images=round(sums.get("answers/images", 0)),
            exact_count=round(sums.get("answers/exact_count", 0)),
            duplicates=round(sums.get("answers/duplicates", 0)),
            duplicates_any_label=round(sums.get("answers/duplicates_any_label", 0)),
            gt_by_count=by_count("gt"),
            tp_by_count=by_count("tp"),
        )

    def recall_by_gt_count(self) -> dict[str, float]:
        """Recall over the images with ``n`` GT objects (key ``"8+"`` for the last bucket)."""
        return {
            (f"{bucket}+" if bucket == RECALL_COUNT_CAP else str(bucket)): (
                self.tp_by_count.get(bucket, 0) / n if n else 1.0
            )
            for bucket, n in sorted(self.gt_by_count.items())
        }

    def as_metrics(self, valid_objects: int, prefix: str = "answers/") -> dict[str, float]:
        """``exact_count_acc`` (per image) and ``duplicate_rate`` / ``duplicate_rate_any_label``
        (per valid predicted object, ``valid_objects``)."""
        return {
            f"{prefix}exact_count_acc": self.exact_count / self.images if self.images else 0.0,
            f"{prefix}duplicate_rate": self.duplicates / valid_objects if valid_objects else 0.0,
            f"{prefix}duplicate_rate_any_label": self.duplicates_any_label / valid_objects
            if valid_objects
            else 0.0,
        }


def duplicate_counts(objects: Sequence[DetObject]) -> tuple[int, int]:
    """``(same label, any label)``: objects with IoU >= ``DUPLICATE_IOU`` to an earlier object."""
    same = any_label = 0
    for i, obj in enumerate(objects):
        close = [earlier for earlier in objects[:i] if iou(obj.bbox, earlier.bbox) >= DUPLICATE_IOU]
        any_label += int(bool(close))
        same += int(any(earlier.label == obj.label for earlier in close))
    return same, any_label


_PARSE_TOTALS = ("responses", "valid", "truncated")  # the integer fields of ParseCounts


@dataclass
class ParseCounts:
    """Parse outcomes over many responses: valid objects, invalid reasons, truncations."""

    responses: int = 0
    valid: int = 0
    truncated: int = 0
    invalid: dict[str, int] = field(default_factory=dict)
    noise_objects: int = 0  # valid objects with the noise label, dropped before matching (not in `valid`)

    def add(self, parse: ParseResult) -> None:
        self.responses += 1
        self.valid += len(parse.objects)
        self.truncated += int(parse.truncated)
        self.noise_objects += parse.noise_objects
        for reason, count in parse.invalid.items():
            self.invalid[reason] = self.invalid.get(reason, 0) + count

    @property
    def truncated_frac(self) -> float:
        """Fraction of responses that were truncated (0.0 with no response)."""
        return self.truncated / self.responses if self.responses else 0.0

    def to_sums(self) -> dict[str, float]:
        """Additive sums (``parse/responses``, ``parse/valid``, ``parse/truncated``,
        ``parse/invalid_<reason>``, ``parse/noise_objects`` when any); :meth:`from_sums` reads them back."""
        sums = {f"parse/{name}": float(getattr(self, name)) for name in _PARSE_TOTALS}
        sums.update({f"parse/invalid_{reason}": float(n) for reason, n in self.invalid.items()})
        if self.noise_objects:  # only models trained with noise objects answer them
            sums["parse/noise_objects"] = float(self.noise_objects)
        return sums

    @classmethod
    def from_sums(cls, sums: Mapping[str, float]) -> ParseCounts:
        """The counts in ``sums`` (missing names count 0)."""
        invalid = {
            k.removeprefix("parse/invalid_"): round(v)
            for k, v in sums.items()
            if k.startswith("parse/invalid_")
        }
        totals = {name: round(sums.get(f"parse/{name}", 0)) for name in _PARSE_TOTALS}
        return cls(invalid=invalid, noise_objects=round(sums.get("parse/noise_objects", 0)), **totals)

    def as_metrics(self, prefix: str = "parse/", per: float = 1.0) -> dict[str, float]:
        """``parse/valid`` and ``parse/invalid_<reason>``, divided by ``per`` (``truncated`` feeds
        ``rollout/truncated_frac``)."""
        metrics = {prefix + "valid": self.valid / per}
        metrics.update({f"{prefix}invalid_{reason}": n / per for reason, n in sorted(self.invalid.items())})
        return metrics


def coco_map(
    predictions: list[list[tuple[DetObject, float]]],
    ground_truths: list[list[DetObject]],
    labels: list[str],
    ignore_regions: list[list[DetObject]] | None = None,
) -> dict[str, float]:
    """COCO bbox mAP (IoU 0.50:0.95), AP50 and AP75 over images, scored by pycocotools.

    ``predictions[i]`` are ``(object, score)`` pairs for image ``i``; ``labels`` are the categories.
    ``ignore_regions[i]`` (optional) are image ``i``'s crowd boxes, given to pycocotools as
    ``iscrowd: 1`` GT: a detection on one is ignored, as in COCO's own evaluation.
    Boxes of one image must share a coordinate frame. Predictions whose label is not in ``labels``
    cannot be scored per category; they are left out and counted in ``unknown_label_predictions``.
    With no GT box at all the APs are NaN (undefined); with GT but no prediction they are 0.0.
    """
    if len(predictions) != len(ground_truths):
        raise DataError(
            f"coco_map got predictions for {len(predictions)} images but GT for {len(ground_truths)}; "
            "pass one (possibly empty) list per image to both"
        )
    category = {label: index + 1 for index, label in enumerate(dict.fromkeys(labels))}
    unknown_gt = sorted({o.label for image in ground_truths for o in image} - set(category))
    if unknown_gt:
        raise DataError(f"coco_map: GT labels {unknown_gt} are not in labels={list(category)}; add them")

    crowds = ignore_regions if ignore_regions is not None else [[] for _ in ground_truths]
    if len(crowds) != len(ground_truths):
        raise DataError(
            f"coco_map got ignore regions for {len(crowds)} images but GT for {len(ground_truths)}"
        )
    gt_annotations = [
        {
            "image_id": image_id,
            "category_id": category[o.label],
            "bbox": _xywh(o.bbox),
            "area": float((o.bbox[2] - o.bbox[0]) * (o.bbox[3] - o.bbox[1])),
            "iscrowd": crowd,
        }
        for crowd, per_image in ((0, ground_truths), (1, crowds))
        for image_id, image_gts in enumerate(per_image, start=1)
        for o in image_gts
        if crowd == 0 or o.label in category  # a crowd of a category nothing else has cannot be scored
    ]
    for annotation_id, annotation in enumerate(gt_annotations, start=1):  # COCOeval needs ids > 0
        annotation["id"] = annotation_id
    detections = [
        {"image_id": image_id, "category_id": category[o.label], "bbox": _xywh(o.bbox), "score": float(score)}
        for image_id, image_preds in enumerate(predictions, start=1)
        for o, score in image_preds
        if o.label in category
    ]
    unknown = sum(1 for image in predictions for o, _ in image if o.label not in category)
    result = {"unknown_label_predictions": float(unknown)}
    if not any(a["iscrowd"] == 0 for a in gt_annotations):
        return {"map": float("nan"), "map_50": float("nan"), "map_75": float("nan"), **result}
    if not detections:
        return {"map": 0.0, "map_50": 0.0, "map_75": 0.0, **result}

    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress and tables
        coco_gt = COCO()
        coco_gt.dataset = {
            "images": [{"id": i} for i in range(1, len(ground_truths) + 1)],
            "annotations": gt_annotations,
            "categories": [{"id": cid, "name": name} for name, cid in category.items()],
        }
        coco_gt.createIndex()
        evaluator = COCOeval(coco_gt, coco_gt.loadRes(detections), iouType="bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    stats = evaluator.stats
    return {"map": float(stats[0]), "map_50": float(stats[1]), "map_75": float(stats[2]), **result}


def _ratio(numerator: float, denominator: float, *, empty: bool) -> float:
    if empty:
        return 1.0
    return numerator / denominator if denominator else 0.0


def _xywh(bbox: tuple[int, int, int, int]) -> list[float]:
    x1, y1, x2, y2 = bbox
    return [float(x1), float(y1), float(x2 - x1), float(y2 - y1)]
