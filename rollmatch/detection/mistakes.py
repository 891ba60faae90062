"""Where a rollout's kept mistakes sit, for the targets that keep them (pure).

Owns: :func:`walk_elements` (each complete element of a parsed rollout with its GT and the GT still to
be found at that point), :func:`fp_divergences` / :func:`divergence` (the first character of a false
positive or duplicate that no correct continuation shares) and :func:`unlikelihood_flags` (those
characters as per-token weights of the unlikelihood term). Leaves out: building the targets
(``detection.targets``) and the loss (``training.losses``). Why that token: docs/detection.md,
"Training after the model's own mistakes".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rollmatch.detection.codec import ObjectCodec, ParseResult, Tokenizer, decode_with_offsets
from rollmatch.detection.matching import MatchResult
from rollmatch.detection.objects import DetObject


@dataclass(frozen=True)
class KeptElement:
    """One complete element of a parsed rollout, as the targets that keep every element see it."""

    index: int  # position among the complete elements
    start: int  # where its continuation starts in ``parse.prefix_text`` (after the previous "}" / the "[")
    end: int  # just after its "}"
    valid: bool
    gt: int | None  # the GT it is matched to; None for a false positive, a duplicate or an invalid element
    remaining: tuple[int, ...]  # GT indices not matched by any earlier element (the correct next objects)
    ignored: bool = False  # a valid prediction on an ignore (crowd) region: no mistake to unlearn


def walk_elements(
    parse: ParseResult, gt_of: dict[int, int], num_gts: int, ignored: frozenset[int] = frozenset()
) -> list[KeptElement]:
    """The complete elements of ``parse`` in order, each with its GT and the GT still to be found
    (``ignored``: valid-object indices on an ignore region, ``MatchResult.ignored``)."""
    starts = [1, *parse.element_ends][: parse.num_complete]  # after the "[", then after each "}"
    found: set[int] = set()
    elements: list[KeptElement] = []
    obj = 0
    for i, (start, end, valid) in enumerate(
        zip(starts, parse.element_ends, parse.element_valid, strict=True)
    ):
        gt = None
        on_region = False
        if valid:
            gt = gt_of.get(obj)
            on_region = obj in ignored
            obj += 1
        remaining = tuple(g for g in range(num_gts) if g not in found)
        elements.append(KeptElement(i, start, end, valid, gt, remaining, on_region))
        if gt is not None:
            found.add(gt)
    return elements


def fp_divergences(
    parse: ParseResult, gts: Sequence[DetObject], match: MatchResult, codec: ObjectCodec, keep: int
) -> list[int]:
    """Characters of ``parse.prefix_text`` where each kept false positive or duplicate (valid, unmatched)
    first leaves every correct continuation (:func:`divergence`); the rollout's own context."""
    gt_of = {p: g for p, g, _ in match.pairs}
    divergences: list[int] = []
    for element in walk_elements(parse, gt_of, len(gts), frozenset(match.ignored))[:keep]:
        if not element.valid or element.gt is not None or element.ignored:
            continue
        raw = parse.prefix_text[element.start : element.end]
        first = divergence(raw, [gts[g] for g in element.remaining], codec, after_element=element.index > 0)
        if first is not None:
            divergences.append(element.start + first)
    return divergences


def divergence(
    continuation: str, remaining: Sequence[DetObject], codec: ObjectCodec, *, after_element: bool
) -> int | None:
    """Index of the first character of ``continuation`` (a false positive's text from just after the
    previous element) that no correct continuation shares, or None when one equals it.

    The correct continuations at that point are each GT object not yet found, serialized as the next
    element (``, {...}``); with none left, closing the list (``]``). So a false positive after the last
    GT object diverges at its separator (``,`` where ``]`` was right), a wrong box at its first wrong
    coordinate character, a right box with a wrong label inside the label.
    """
    alternatives = [codec.append_fragment([gt], after_element=after_element)[:-1] for gt in remaining]
    if not alternatives:
        alternatives = [codec.append_fragment([], after_element=after_element)]
    shared = max(_common_prefix(continuation, alt) for alt in alternatives)
    return shared if shared < len(continuation) else None


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def unlikelihood_flags(
    token_ids: Sequence[int],
    weights: Sequence[float],
    divergences: Sequence[int],
    tokenizer: Tokenizer,
    weight: float,
) -> list[float]:
    """One unlikelihood weight per token of a target (its last id is EOS): ``weight`` at the token
    holding each divergence character of the decoded target text, 0 elsewhere.

    A token that also carries a CE weight (it is supervised toward the same id) is not flagged: one
    position is never pushed up and down at once.
    """
    spans = decode_with_offsets(tokenizer, list(token_ids[:-1])).token_spans()
    flags = [0.0] * len(token_ids)
    for char in divergences:
        index = next(i for i, (start, stop) in enumerate(spans) if start <= char < stop)
        if weights[index] == 0:
            flags[index] = weight
    return flags
