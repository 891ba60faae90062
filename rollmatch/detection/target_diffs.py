"""How far each rollout-matching target is from SFT's, in token ids (pure; ``rollmatch diagnose``).

Owns: :data:`DIAGNOSED_TARGETS` (the targets compared, by their ``loss.*`` settings),
:func:`target_diff` (one rollout: every target's token-id difference to the SFT target of the same
GT, and whether a reordered-GT target differs only by an appended miss) and :class:`TargetDiffTotals`
(the sums over a split and the rates they give). Leaves out: rolling out (``rollmatch.diagnostics``).

Token ids, never weights: a target whose ids equal SFT's trains on SFT's own states, whatever its
weights (docs/detection.md, "Which targets differ from SFT").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rollmatch.config.schema import LossConfig
from rollmatch.detection.codec import ObjectCodec, ParseResult, Tokenizer
from rollmatch.detection.matching import MatchResult
from rollmatch.detection.objects import DetObject, canonical_order
from rollmatch.detection.targets import build_matched_target

# name -> loss settings of each diagnosed target
DIAGNOSED_TARGETS: dict[str, LossConfig] = {
    "prefix_fn_matched_supervise": LossConfig(keep_prefix="matched", matched_prefix="supervise"),
    "prefix_fn_matched_none": LossConfig(keep_prefix="matched", matched_prefix="none"),
    "prefix_fn_all_none": LossConfig(keep_prefix="all", matched_prefix="none"),
    "prefix_fn_all_supervise": LossConfig(keep_prefix="all", matched_prefix="supervise"),
    "reordered_gt": LossConfig(target="reordered_gt"),
}


@dataclass
class RolloutTargetDiff:
    """One rollout: per target, its differing positions against SFT and its length."""

    mismatched: dict[str, int]  # positions whose token id differs (the longer one's extra count too)
    lengths: dict[str, int]  # max(len(target), len(sft)) per target, EOS included
    reordered_only_appended_miss: bool  # reordered GT differs from SFT only by where the misses sit


@dataclass
class TargetDiffTotals:
    """Sums over rollouts; :meth:`summary` turns them into rates."""

    rollouts: int = 0
    differing: dict[str, int] = field(default_factory=dict)
    mismatched: dict[str, int] = field(default_factory=dict)
    positions: dict[str, int] = field(default_factory=dict)
    reordered_only_appended_miss: int = 0

    def add(self, diff: RolloutTargetDiff) -> None:
        self.rollouts += 1
        for name, count in diff.mismatched.items():
            self.differing[name] = self.differing.get(name, 0) + int(count > 0)
            self.mismatched[name] = self.mismatched.get(name, 0) + count
            self.positions[name] = self.positions.get(name, 0) + diff.lengths[name]
        self.reordered_only_appended_miss += int(diff.reordered_only_appended_miss)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per target: ``differs_frac`` (rollouts whose target has other ids than SFT's) and
        ``token_mismatch_frac`` (differing positions over all positions); for ``reordered_gt`` also
        ``only_appended_miss_frac`` (of its differing targets, those whose found objects are in
        canonical order, so only the missed objects moved to the end)."""
        out: dict[str, dict[str, float]] = {}
        for name in DIAGNOSED_TARGETS:
            differing = self.differing.get(name, 0)
            out[name] = {
                "differs_frac": _rate(differing, self.rollouts),
                "token_mismatch_frac": _rate(self.mismatched.get(name, 0), self.positions.get(name, 0)),
            }
        differing = self.differing.get("reordered_gt", 0)
        out["reordered_gt"]["only_appended_miss_frac"] = _rate(self.reordered_only_appended_miss, differing)
        return out


def target_diff(
    parse: ParseResult,
    gts: Sequence[DetObject],
    match: MatchResult,
    *,
    codec: ObjectCodec,
    tokenizer: Tokenizer,
    eos_token_id: int,
) -> RolloutTargetDiff:
    """Every :data:`DIAGNOSED_TARGETS` target of one rollout against the SFT target of ``gts``."""
    sft = [*tokenizer.encode(codec.serialize(gts), add_special_tokens=False), int(eos_token_id)]
    mismatched: dict[str, int] = {}
    lengths: dict[str, int] = {}
    for name, loss in DIAGNOSED_TARGETS.items():
        ids = build_matched_target(
            parse, gts, match, codec=codec, tokenizer=tokenizer, eos_token_id=eos_token_id, loss=loss
        ).token_ids
        mismatched[name] = positional_mismatches(ids, sft)
        lengths[name] = max(len(ids), len(sft))
    found = [gts[g] for _, g, _ in sorted(match.pairs)]
    in_canonical_order = found == [o for o in canonical_order(gts) if o in found]
    only_miss = mismatched["reordered_gt"] > 0 and bool(match.fn) and in_canonical_order
    return RolloutTargetDiff(mismatched, lengths, only_miss)


def positional_mismatches(a: Sequence[int], b: Sequence[int]) -> int:
    """Positions where ``a`` and ``b`` differ, counting the longer one's extra positions."""
    return sum(x != y for x, y in zip(a, b, strict=False)) + abs(len(a) - len(b))


def _rate(count: int, total: int) -> float:
    return round(count / total, 4) if total else 0.0
