"""One scoring path for a response: strict parse + Hungarian match against its GT (pure).

Owns: :func:`score_response` (response token ids + GT objects -> :class:`ScoredResponse`) and
:class:`ScoreCounts` (parse and matching counts added up over many responses, with additive
``to_sums`` / ``from_sums`` for aggregation across micro-steps and ranks). Training
(rollout-matching targets), evaluation (``rollmatch eval``) and ``bench/host_overhead.py`` all
score through here, so every one of them honours ``matching.*`` (``iou_threshold``,
``label_mode``, costs) the same way. Leaves out: rolling out (``rollout/``), prompt encoding
(``data.prompts``), the training target (``detection.targets``) and mAP (``detection.metrics``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rollmatch.config.schema import MatchingConfig
from rollmatch.detection.codec import ObjectCodec, ParseResult
from rollmatch.detection.count_metrics import CountOrderCounts
from rollmatch.detection.matching import MatchResult, hungarian_match
from rollmatch.detection.metrics import AnswerCounts, DetectionCounts, ParseCounts
from rollmatch.detection.noise_objects import drop_noise_objects
from rollmatch.detection.objects import DetObject


@dataclass(frozen=True)
class ScoredResponse:
    """A response's strict parse, its matching to the GT, and the GT it was matched against."""

    parse: ParseResult
    match: MatchResult
    gt_objects: tuple[DetObject, ...]

    @property
    def missed(self) -> list[DetObject]:
        """The GT objects no prediction matched (false negatives), in GT order."""
        return [self.gt_objects[g] for g in self.match.fn]

    def counts(self) -> ScoreCounts:
        """This response's counts alone (e.g. its ``to_sums()`` for the trainer's metric sums)."""
        counts = ScoreCounts()
        counts.add(self)
        return counts


def score_response(
    codec: ObjectCodec,
    response_token_ids: Sequence[int],
    gt_objects: Sequence[DetObject],
    *,
    extent: tuple[int, int],
    hit_max_tokens: bool,
    matching: MatchingConfig,
    ignore_regions: Sequence[DetObject] = (),
    noise_label: str | None = None,
) -> ScoredResponse:
    """Strictly parse ``response_token_ids`` (frame ``extent``) and match the valid objects to
    ``gt_objects`` with the ``matching`` settings; a prediction on one of ``ignore_regions`` (the
    record's crowd boxes, same frame) is neither a match nor a false positive. Never raises on model
    output. Objects labelled ``noise_label`` (a model trained with ``loss.noise_objects``) are valid
    elements taken out before matching (``detection.noise_objects.drop_noise_objects``)."""
    parse = codec.parse(response_token_ids, extent=extent, hit_max_tokens=hit_max_tokens)
    parse = drop_noise_objects(parse, noise_label)
    match = hungarian_match(parse.objects, gt_objects, **matching.model_dump(), ignore_regions=ignore_regions)
    return ScoredResponse(parse=parse, match=match, gt_objects=tuple(gt_objects))


@dataclass
class ScoreCounts:
    """Parse outcomes and matching counts over many scored responses."""

    parsing: ParseCounts = field(default_factory=ParseCounts)
    detection: DetectionCounts = field(default_factory=DetectionCounts)
    answers: AnswerCounts = field(default_factory=AnswerCounts)
    count_order: CountOrderCounts = field(default_factory=CountOrderCounts)

    def add(self, scored: ScoredResponse) -> None:
        self.parsing.add(scored.parse)
        self.detection.add(scored.match, len(scored.parse.objects), len(scored.gt_objects))
        self.answers.add(scored.parse.objects, scored.match, len(scored.gt_objects))
        self.count_order.add(scored.match, len(scored.parse.objects), len(scored.gt_objects))

    def to_sums(self) -> dict[str, float]:
        """Additive sums: ``parse/*`` (:meth:`ParseCounts.to_sums`), ``match/*``
        (:meth:`DetectionCounts.to_sums`), ``answers/*`` (:meth:`AnswerCounts.to_sums`) and ``count/*``
        (:meth:`CountOrderCounts.to_sums`)."""
        return {
            **self.parsing.to_sums(),
            **self.detection.to_sums(),
            **self.answers.to_sums(),
            **self.count_order.to_sums(),
        }

    @classmethod
    def from_sums(cls, sums: Mapping[str, float]) -> ScoreCounts:
        return cls(
            parsing=ParseCounts.from_sums(sums),
            detection=DetectionCounts.from_sums(sums),
            answers=AnswerCounts.from_sums(sums),
            count_order=CountOrderCounts.from_sums(sums),
        )
